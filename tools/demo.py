#!/usr/bin/env python
"""The demo (`make demo`): the whole pipeline on the embedded synthetic Taskonomy, on this machine, in minutes.

The tool lives in `squad.cli.demo` (also installed as `squad-demo`); usage and examples:
``python tools/demo.py --help``.
"""

import sys

try:
    from squad.cli.demo import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
