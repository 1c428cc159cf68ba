#!/usr/bin/env python
"""Train a squad model with DeepSpeed.

    deepspeed --num_gpus 8 tools/train.py --config configs/taskonomy/modsquad_vit_b.yaml --out runs/msq
    deepspeed --hostfile hosts tools/train.py --config ... --out runs/msq        # several nodes
    torchrun --nproc_per_node 2 tools/train.py --config configs/demo.yaml --out runs/demo
    python tools/train.py --config configs/demo.yaml --set optim.steps=50        # one process (CPU or GPU)

With no GPU, DeepSpeed's CPU accelerator, gloo and fp32 are selected automatically. ``--resume auto`` (default)
continues the run in --out from its last complete checkpoint.
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (squad/train/runtime.py)
try:
    from squad.cli.train import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
