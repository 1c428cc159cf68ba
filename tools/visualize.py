#!/usr/bin/env python
"""Draw a trained model's routing: expert-usage heatmaps, task-relation matrices, MoD and MoNE token shares (PNG,
JSON, TensorBoard).

    python tools/visualize.py --checkpoint runs/demo --data data/synthetic --split val --out runs/demo/figures
    python tools/visualize.py --checkpoint runs/demo/model.pt            # saved usage only: heatmaps, no relations

For every MoE attention and MoE MLP layer, a tasks × experts heatmap of the share of each task's selections that
went to each expert; and tasks × tasks matrices of the mean share of experts two tasks select for the same input
token, over all routed layers and for the first, middle and last one. With --data the figures come from one pass
over that split; without it the heatmaps use the statistics saved in model.pt and the relations are skipped.
For every Mixture-of-Depths model, a tasks × MoD blocks heatmap of the share of each task's tokens each block
processed (--mod-inference threshold shows what learned routers let through); for a MoNE model, tasks × nested
experts heatmaps of the tokens per expert (set by e_c, --mone-capacity) and the mean router probability per
expert. A model without routed layers (a dense ViT) is refused. Figures are also logged to the run's TensorBoard
folder (or --tb DIR; --tb none to skip). Nothing is created before the checkpoint and its statistics are checked.
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
