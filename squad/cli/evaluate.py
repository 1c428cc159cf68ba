"""Evaluate trained models on a split: every task's metrics, Δt against a baseline, several models side by side.

    python tools/evaluate.py --checkpoint runs/demo --data data/synthetic --split val
    python tools/evaluate.py --checkpoint runs/demo --checkpoint runs/demo/depth_theta0.01.pt --data data/synthetic
    python tools/evaluate.py --checkpoint runs/msq --data DATA --baseline runs/stl_a/eval.json runs/stl_b/eval.json

A checkpoint is a run folder, a model.pt, or an extracted model (tools/extract.py). Δt (percent, higher is better)
is computed per task from each task's primary metric against the baseline results (files written by this tool,
merged; e.g. one per single-task run), and averaged. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from squad.cli import run


def _label(path: str, taken: set[str]) -> str:
    p = Path(path)
    label = p.parent.name if p.name == "model.pt" else p.stem if p.suffix else p.name
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/evaluate.py`` / ``squad-evaluate``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", required=True,
                   help="run folder, model.pt or extracted model (repeat to compare several side by side)")
    p.add_argument("--data", required=True, help="dataset root")
    p.add_argument("--split", default="val", help="train, val, test or all (default val)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: every task of each model)")
    p.add_argument("--baseline", nargs="+", default=None, help="baseline results JSON file(s) for Δt")
    p.add_argument("--batches", type=int, default=0, help="batches to evaluate (0 = the whole split)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default: eval_<split>.json beside the first checkpoint)")
    return p


def _evaluate(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")

    from squad.eval.evaluate import delta_against, evaluate_file, format_results, load_baseline

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    taken: set[str] = set()
    baseline = load_baseline(args.baseline) if args.baseline else None
    models = {}
    for path in args.checkpoint:
        metrics = evaluate_file(path, args.data, args.split, tasks, args.batches, args.batch_size, args.device,
                                args.workers)
        entry = {"checkpoint": path, "metrics": metrics}
        if baseline is not None:
            entry["delta_t"] = delta_against(metrics, baseline)
        models[_label(path, taken)] = entry
    print(f"split {args.split} of {args.data}")
    print(format_results({label: e["metrics"] for label, e in models.items()}))
    for label, e in models.items():
        if "delta_t" in e:
            dt = e["delta_t"]
            parts = ", ".join(f"{t} {v:+.2f}%" for t, v in dt["per_task"].items())
            print(f"Δt {label}: mean {dt['mean']:+.2f}% ({parts})"
                  + (f"; no baseline for {', '.join(dt['tasks_without_baseline'])}"
                     if dt["tasks_without_baseline"] else ""))
    first = Path(args.checkpoint[0])
    out = Path(args.out) if args.out else (first if first.is_dir() else first.parent) / f"eval_{args.split}.json"
    result = {"split": args.split, "data": args.data}
    if len(models) == 1:
        result.update(next(iter(models.values())))
    else:
        result["models"] = models
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Evaluates models side by side; exit 2 on bad input, a missing baseline task included (`squad.cli.run`)."""
    return run(_evaluate, argv, bad_input=(KeyError,))  # KeyError: delta_t found no baseline for a task or metric


if __name__ == "__main__":
    sys.exit(main())
