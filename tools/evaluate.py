#!/usr/bin/env python
"""Evaluate trained models on a split: every task's metrics, Δt against a baseline, several models side by side.

The tool lives in `squad.cli.evaluate` (also installed as `squad-evaluate`); usage and examples:
``python tools/evaluate.py --help``.
"""

import sys

try:
    from squad.cli.evaluate import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
