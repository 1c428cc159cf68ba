#!/usr/bin/env python
"""Train a squad model with DeepSpeed.

    deepspeed --num_gpus 8 tools/train.py --config configs/taskonomy/modsquad_vit_b.yaml --out runs/msq
    deepspeed --hostfile hosts tools/train.py --config ... --out runs/msq        # several nodes
    torchrun --nproc_per_node 2 tools/train.py --config configs/demo.yaml --out runs/demo
    python tools/train.py --config configs/demo.yaml --set optim.steps=50        # one process (CPU or GPU)

With no GPU, DeepSpeed's CPU accelerator, gloo and fp32 are selected automatically. ``--resume auto`` (default)
continues the run in --out from its last complete checkpoint.

The run folder is locked while a run uses it (run.lock names the holder; a second run into it exits 2). A resume
may change only the keys that keep it exact: optim.steps/epochs/min_lr/clip, train.log_every/eval_every/
ckpt_every/keep_checkpoints/stop_at/max_nonfinite/progress, data.root/workers/val_split/val_batches (recorded in
train.log, config.prev.yaml and run_history.jsonl); any other change is refused — start a new run for it.
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
