#!/usr/bin/env python
"""Make data for squad: render a synthetic Taskonomy, or pack a Taskonomy tree into HDF5 shards.

The tool lives in `squad.cli.make_data` (also installed as `squad-make-data`); usage and examples:
``python tools/make_data.py --help``.
"""

import sys

try:
    from squad.cli.make_data import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
