#!/usr/bin/env python
"""Evaluate trained models on a split: every task's metrics, Δt against a baseline, several models side by side.

    python tools/evaluate.py --checkpoint runs/demo --data data/synthetic --split val
    python tools/evaluate.py --checkpoint runs/demo --checkpoint runs/demo/depth_theta0.01.pt --data data/synthetic
    python tools/evaluate.py --checkpoint runs/msq --data DATA --baseline runs/stl_a/eval.json runs/stl_b/eval.json

A checkpoint is a run folder, a model.pt, or an extracted model (tools/extract.py). Δt (percent, higher is better)
is computed per task from each task's primary metric against the baseline results (files written by this tool,
merged; e.g. one per single-task run), and averaged. Prints a table and writes JSON (--out).

    python tools/evaluate.py --checkpoint runs/mone --data DATA --mone-capacity 0.5
    python tools/evaluate.py --checkpoint runs/mod --data DATA --mod-inference threshold

--mone-capacity sets MoNE's effective capacity e_c, --mod-inference MoD's inference mode (top-k, or threshold:
the tokens a learned router lets through; the model must have been trained with model.mod.aux_loss=true). Every
model's compute is reported too: MACs per image at capacity and, for MoD models, the share of tokens each MoD block
actually processed and the MACs from it; for MoNE models the tokens per nested expert.
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
