#!/usr/bin/env python
"""Run any squad model on image files and write readable pictures and raw values per task.

The tool lives in `squad.cli.predict` (also installed as `squad-predict`); usage and examples:
``python tools/predict.py --help``.
"""

import sys

try:
    from squad.cli.predict import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
