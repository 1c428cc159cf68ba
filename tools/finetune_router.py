#!/usr/bin/env python
"""Learn a new task on a trained multi-task model by training only its routers, task embedding and head.

    python tools/finetune_router.py --checkpoint runs/x --task scene --data data/synthetic \
        --fractions 0.005,0.01,0.02,0.05 --mode router,head,full,linear-probe
    python tools/finetune_router.py --checkpoint runs/x --task class_scene --data data/synthetic --shots 5

Modes: router (router rows + task embedding + head), head (head only), full (everything), linear-probe (logistic
regression on frozen pooled features, class tasks). Every parameter a mode does not train is frozen for real and
checked bitwise unchanged. Subsets are deterministic (seeded, nested). Prints a table mode × size → metric and writes
JSON (--out). Under the deepspeed launcher or torchrun, rank 0 does all the work and the other ranks exit at once.
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
