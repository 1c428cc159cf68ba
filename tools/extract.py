#!/usr/bin/env python
"""Extract one task's subnetwork from a trained multi-task model into a standalone file.

The tool lives in `squad.cli.extract` (also installed as `squad-extract`); usage and examples:
``python tools/extract.py --help``.
"""

import sys

try:
    from squad.cli.extract import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
