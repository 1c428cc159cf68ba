#!/usr/bin/env python
"""Train a squad model with DeepSpeed.

    deepspeed --num_gpus 8 tools/train.py --config configs/taskonomy/modsquad_vit_b.yaml --out runs/msq
    deepspeed --hostfile hosts tools/train.py --config ... --out runs/msq        # several nodes
    torchrun --nproc_per_node 2 tools/train.py --config configs/demo.yaml --out runs/demo
    python tools/train.py --config configs/demo.yaml --set optim.steps=50        # one process (CPU or GPU)

With no GPU, DeepSpeed's CPU accelerator, gloo and fp32 are selected automatically. ``--resume auto`` (default)
continues the run in --out from its last complete checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (see squad/runtime.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config YAML (configs/demo.yaml, configs/taskonomy/...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=1e-4 --set model.depth=6 (repeatable)")
    p.add_argument("--out", default=None, help="run folder (default: runs/<config name>)")
    p.add_argument("--resume", default="auto", help="auto (default), none, or a run/checkpoint folder")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    args = p.parse_args(argv)

    from squad.distributed import prepare_environment

    prepare_environment()  # before deepspeed is imported anywhere
    from squad.config import ConfigError, load_config
    from squad.engine import TrainingError, train
    from squad.train_config import RunConfig

    try:
        cfg = load_config(args.config, args.set, cls=RunConfig)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    try:
        path = train(cfg, out, args.resume)
    except (FileNotFoundError, PermissionError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(f"model: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
