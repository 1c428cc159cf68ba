#!/usr/bin/env python
"""The demo (`make demo`): the whole pipeline on the embedded synthetic Taskonomy, on this machine, in minutes.

1. renders the synthetic dataset into data/synthetic if it is missing;
2. prints the paper configs' parameter / MAC table;
3. trains configs/demo.yaml (a small Mod-Squad: MoE attention, MoE MLP, one MoD block, all 13 tasks) with the
   deepspeed launcher on 2 ranks (CPU: DeepSpeed's CPU accelerator and gloo);
4. compares validation metrics at step 0 and at the end for every task;
5. extracts the depth subnetwork at θ = 0.01, evaluates it beside the full model, and draws the expert-usage and
   task-relation figures;
6. prints where the run, its TensorBoard logs and the figures are.

    python tools/demo.py [--out runs/demo] [--data data/synthetic] [--steps N] [--fresh]
"""

import sys

try:
    from squad.cli.demo import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
