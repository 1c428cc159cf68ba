"""Draw a trained model's routing: expert-usage heatmaps, task-relation matrices, token maps over the image.

PNG, JSON and TensorBoard; the token maps show which tokens MoD blocks process and each token's MoNE width.

    python tools/visualize.py --checkpoint runs/demo --data data/synthetic --split val --out runs/demo/figures
    python tools/visualize.py --checkpoint runs/demo/model.pt            # saved usage only: heatmaps, no relations

For every MoE attention and MoE MLP layer, a tasks × experts heatmap of the share of each task's selections that
went to each expert; and tasks × tasks matrices of the mean share of experts two tasks select for the same input
token, over all routed layers and for the first, middle and last one. With --data the figures come from one pass
over that split; without it the heatmaps use the statistics saved in model.pt and the relations are skipped.
For every Mixture-of-Depths model (learned routing or A-MoD's attention routing) and MoNE model, per task, the
first --images images of the split with a map per MoD block of the tokens it processed (the patches it skipped
darkened; --mod-inference threshold shows what learned routers let through) and, for MoNE, each token's nested
width (tokens_<task>.png; the maps are the layers' own recorded choices); the share of tokens each block processed
is in figures.json. For a MoNE model also tasks × nested experts heatmaps of the tokens per expert (set by e_c,
--mone-capacity) and the mean router probability per expert. A model without routed layers (a dense ViT) is
refused. Figures are also logged to the run's TensorBoard folder (or --tb DIR; --tb none to skip). Nothing is
created before the checkpoint and its statistics are checked.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from squad.cli import beside, device_arg, require_paths, run
from squad.cli.evaluate import add_inference_arguments
from squad.config.tools import VisualizeConfig, defaults, from_namespace


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/visualize.py`` / ``squad-visualize``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder, model.pt, Hugging Face-style folder or "
                   "hf-hub:ORG/NAME of a multi-task model")
    p.add_argument("--data", help="dataset root for a calibration pass (needed for relations and token maps)")
    p.add_argument("--split")
    p.add_argument("--batches", type=int, help="calibration batches (0 = the whole split)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--images", type=int, help="images of the split the token maps show (MoD / A-MoD / MoNE models; "
                   "default 4, 0: none)")
    p.add_argument("--out", default=None, help="figure folder (default: <run>/figures)")
    p.add_argument("--tb", default=None, help="TensorBoard folder (default: the run's tensorboard/; 'none' skips)")
    add_inference_arguments(p)
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--workers", type=int)
    p.set_defaults(**defaults(VisualizeConfig))
    return p


def _visualize(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    require_paths(args.checkpoint, args.data)  # before anything heavy is imported
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")

    from squad.analysis.figures import draw_figures
    from squad.io import load_model

    cfg = from_namespace(VisualizeConfig, args)  # the tool's options, checked, in one place
    folder = beside(args.checkpoint)
    out = Path(args.out) if args.out else folder / "figures"
    from squad.io.files import check_writable

    # before the model is loaded and run
    check_writable(out, "--out" if args.out else "the default --out", folder=True)
    model = load_model(args.checkpoint)  # checked before anything is created
    tb = "" if args.tb and args.tb.lower() == "none" else args.tb
    if tb is None and Path(args.checkpoint).is_dir() and (folder / "tensorboard").is_dir():
        tb = folder / "tensorboard"  # the run's own TensorBoard
    result = draw_figures(model, out, cfg, tb_dir=tb)
    print(f"usage from: {result['usage_source']}")
    for f in result["files"]:
        print(f"  {f}")
    print(f"numbers: {result['json']}" + (f"\nTensorBoard: {result['tensorboard']}" if result["tensorboard"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Draws the usage and relation figures of a model; exit 2 on bad input (`squad.cli.run`)."""
    return run(_visualize, argv)


if __name__ == "__main__":
    sys.exit(main())
