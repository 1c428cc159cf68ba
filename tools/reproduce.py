#!/usr/bin/env python
"""Reproduce the papers' claims on the embedded data and write a report.

The tool lives in `squad.cli.reproduce` (also installed as `squad-reproduce`); usage and examples:
``python tools/reproduce.py --help``.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (squad/runtime.py)
try:
    from squad.cli.reproduce import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
