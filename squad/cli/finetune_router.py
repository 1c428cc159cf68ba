"""Learn a new task on a trained multi-task model by training only its routers, task embedding and head.

    # first a model trained without the new task (here: the demo on every task but class_scene)
    python tools/train.py --config configs/demo.yaml --out runs/no_scene --set 'data.tasks=[class_object,
        depth_euclidean, depth_zbuffer, normal, principal_curvature, reshading, edge_texture, edge_occlusion,
        keypoints2d, keypoints3d, segment_unsup2d, segment_unsup25d]'
    python tools/finetune_router.py --checkpoint runs/no_scene --task scene --data data/synthetic \
        --fractions 0.005,0.01,0.02,0.05 --mode router,head,full,linear-probe
    python tools/finetune_router.py --checkpoint runs/no_scene --task class_scene --data data/synthetic --shots 5

The model may have a head for the task that its run never trained (data.tasks left it out, as above): that head
and its router rows are learned anew. A task the run did train needs --replace.

Modes: router (router rows + task embedding + head), head (head only), full (everything), linear-probe (a linear
classifier on frozen pooled features, class tasks); every mode trains with AdamW for --steps steps. Every parameter a
mode does not train is frozen for real and checked bitwise unchanged. With --holdout, a share of each subset's images
is held out and picks each run's lr (of --lrs) and stopping step (the best of --evals evaluations):

    python tools/finetune_router.py --checkpoint runs/no_scene --task scene --data data/synthetic --mode all \
        --fractions 0.05,0.1 --holdout 0.2 --lrs 1e-4,1e-3,1e-2 --evals 5

Subsets are deterministic (seeded, nested). Prints a table mode × size → metric and writes JSON (--out). Under the
deepspeed launcher or torchrun, rank 0 does all the work and the other ranks exit at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from squad.cli import beside, device_arg, require_paths, run
from squad.config.tools import FinetuneConfig, defaults, from_namespace


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/finetune_router.py`` / ``squad-finetune-router``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder, model.pt, Hugging Face-style folder or "
                   "hf-hub:ORG/NAME of a model trained without the task")
    p.add_argument("--task", required=True, help="the new task (name or alias)")
    p.add_argument("--data", required=True, help="dataset root holding the task's data")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--fractions", "--fraction", type=_floats, default=None,
                      help="training-set shares, e.g. 0.005,0.01,0.02,0.05 (default 0.01)")
    size.add_argument("--shots", type=lambda s: [int(v) for v in _floats(s)], default=None,
                      help="images per class instead (class tasks), e.g. 1,5")
    p.add_argument("--mode", default="router", help="comma-separated: router, head, full, linear-probe (or 'all')")
    p.add_argument("--steps", type=int, help="AdamW steps per run, every mode (default 200)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float, help="learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--holdout", type=float, help="held-out selection: this share of each subset's images picks the "
                   "lr (of --lrs) and the stopping step (of --evals evaluations along the run); default 0: none")
    p.add_argument("--lrs", type=_floats, help="with --holdout: the lrs to pick from, e.g. 1e-4,1e-3,1e-2 "
                   "(default: --lr alone)")
    p.add_argument("--evals", type=int, help="with --holdout: held-out evaluations along each run (default 1: the "
                   "last step)")
    p.add_argument("--init", choices=["mean", "zero", "random"],
                   help="new router rows / task embedding start at the mean of the other tasks' (default), zero, or "
                   "random")
    p.add_argument("--seed", type=int)
    p.add_argument("--train-split", default="train")
    p.add_argument("--eval-split", default="val")
    p.add_argument("--eval-batches", type=int, help="evaluation batches (0 = the whole split)")
    p.add_argument("--replace", action="store_true", help="allow a task the model was trained with (its head and "
                   "router rows are dropped and learned again)")
    p.add_argument("--save-dir", default=None, help="also save every fine-tuned model (merged, model.pt format)")
    p.add_argument("--out", default=None, help="result JSON (default: <run>/finetune_<task>.json)")
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--workers", type=int)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    p.set_defaults(**defaults(FinetuneConfig))
    return p


def _finetune(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        return 0  # one process does the work; a launcher's other ranks have nothing to do
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")
    require_paths(data=args.data)  # before anything heavy is imported (a missing --checkpoint: its own hint below)

    from squad.io import load_model
    from squad.posttrain.finetune import MODES, check_request, finetune_table, format_table, train_without_hint
    from squad.tasks import get_task

    modes = list(MODES) if args.mode == "all" else [m.strip() for m in args.mode.split(",") if m.strip()]
    fractions = args.fractions if args.fractions is not None or args.shots is not None else [0.01]
    folder = beside(args.checkpoint)
    out = Path(args.out) if args.out else folder / f"finetune_{args.task}.json"
    from squad.io.files import check_writable

    # before any training
    check_writable(out, "--out" if args.out else "the default --out")
    cfg = from_namespace(FinetuneConfig, args)  # the tool's options, checked, in one place
    check_request(args.task, modes, fractions, args.shots, cfg)  # before any work
    try:
        model = load_model(args.checkpoint)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}; {train_without_hint(args.checkpoint, get_task(args.task).name)}") from e
    result = finetune_table(model, args.task, args.data, modes, fractions, args.shots, cfg,
                            args.train_split, args.eval_split, args.replace, args.save_dir, out)
    print(format_table(result))
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Fine-tunes a new task's routers (and the other modes); exit 2 on bad input (`squad.cli.run`)."""
    return run(_finetune, argv)


if __name__ == "__main__":
    sys.exit(main())
