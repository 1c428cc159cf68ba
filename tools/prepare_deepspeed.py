#!/usr/bin/env python
"""Builds DeepSpeed's CPU shared-memory communication op once (part of `make` set-up on machines without a GPU).

DeepSpeed's CPU accelerator JIT-compiles this op the first time a process group starts (~1.5 minutes, cached in
~/.cache/torch_extensions). Doing it during set-up keeps that cost out of the first training run and the tests.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    if torch.cuda.is_available():
        print("prepare_deepspeed: a GPU is present; nothing to build")
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("prepare_deepspeed: this DeepSpeed has no CPU shared-memory op; nothing to build")
        return 0
    t0 = time.time()
    builder.load(verbose=False)
    print(f"prepare_deepspeed: {builder.absolute_name()} ready ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
