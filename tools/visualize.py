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

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder or model.pt of a multi-task model")
    p.add_argument("--data", default=None, help="dataset root for a calibration pass (needed for relations)")
    p.add_argument("--split", default="val")
    p.add_argument("--batches", type=int, default=4, help="calibration batches (0 = the whole split)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default=None, help="figure folder (default: <run>/figures)")
    p.add_argument("--tb", default=None, help="TensorBoard folder (default: the run's tensorboard/; 'none' skips)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")

    from squad.analysis.figures import draw_figures

    folder = Path(args.checkpoint) if Path(args.checkpoint).is_dir() else Path(args.checkpoint).parent
    out = Path(args.out) if args.out else folder / "figures"
    tb = "" if args.tb and args.tb.lower() == "none" else args.tb
    try:
        result = draw_figures(args.checkpoint, out, data=args.data, split=args.split, batches=args.batches,
                              batch_size=args.batch_size, tb_dir=tb, device=args.device, workers=args.workers)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"usage from: {result['usage_source']}")
    for f in result["files"]:
        print(f"  {f}")
    print(f"numbers: {result['json']}" + (f"\nTensorBoard: {result['tensorboard']}" if result["tensorboard"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
