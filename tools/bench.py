#!/usr/bin/env python
"""squad's performance table: every case of `squad.bench.cases.CASES`, ratios timed side by side in one run.

The tool lives in `squad.cli.bench` (also installed as `squad-bench`); usage and examples:
``python tools/bench.py --help``.
"""

import os
import sys

if __name__ == "__main__" and "--no-tuning" not in sys.argv[1:]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp
try:
    from squad.cli.bench import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
