#!/usr/bin/env python
"""Builds DeepSpeed's CPU shared-memory communication op once (part of `make` set-up on machines without a GPU).

DeepSpeed's CPU accelerator JIT-compiles this op the first time a process group starts (~1.5 minutes). It is built
into this installation's own extension folder (`squad.distributed.extensions_dir`: ``.venv/torch_extensions``), the
one every run of this installation loads it from (`squad.distributed.prepare_environment` points
``TORCH_EXTENSIONS_DIR`` there): the shared ``~/.cache/torch_extensions`` is keyed by the Python and CUDA versions
only, so checkouts with other virtual environments would rebuild each other's op there, and every run would wait.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch

    from squad.distributed import prepare_environment

    if torch.cuda.is_available():
        print("prepare_deepspeed: a GPU is present; nothing to build")
        return 0
    prepare_environment()  # DS_ACCELERATOR=cpu and TORCH_EXTENSIONS_DIR, as every run sets them
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print("prepare_deepspeed: this DeepSpeed has no CPU shared-memory op; nothing to build")
        return 0
    t0 = time.time()
    builder.load(verbose=False)
    print(f"prepare_deepspeed: {builder.absolute_name()} ready in {os.environ['TORCH_EXTENSIONS_DIR']} "
          f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
