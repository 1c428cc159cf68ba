#!/usr/bin/env python
"""Learn a new task on a trained multi-task model by training only its routers, task embedding and head.

The tool lives in `squad.cli.finetune_router` (also installed as `squad-finetune-router`); usage and examples:
``python tools/finetune_router.py --help``.
"""

import sys

try:
    from squad.cli.finetune_router import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
