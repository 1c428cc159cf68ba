#!/usr/bin/env python
"""Turn a dense ViT into the initialisation of a Mod-Squad (or any squad model): sparse upcycling.

The tool lives in `squad.cli.upcycle` (also installed as `squad-upcycle`); usage and examples:
``python tools/upcycle.py --help``.
"""

import sys

try:
    from squad.cli.upcycle import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
