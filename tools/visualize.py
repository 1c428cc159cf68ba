#!/usr/bin/env python
"""Draw a trained model's expert-usage heatmaps and task-relation matrices (PNG, JSON, TensorBoard).

    python tools/visualize.py --checkpoint runs/demo --data data/synthetic --split val --out runs/demo/figures
    python tools/visualize.py --checkpoint runs/demo/model.pt            # saved usage only: heatmaps, no relations

For every MoE attention and MoE MLP layer, a tasks × experts heatmap of the share of each task's selections that
went to each expert; and tasks × tasks matrices of the mean share of experts two tasks select for the same input
token, over all routed layers and for the first, middle and last one. With --data the figures come from one pass
over that split; without it the heatmaps use the statistics saved in model.pt and the relations are skipped.
Figures are also logged to the run's TensorBoard folder (or --tb DIR; --tb none to skip).
"""

import sys

try:
    from squad.cli.visualize import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
