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

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from squad.cli import beside, device_arg, require_paths, run
from squad.config.tools import EvaluateConfig, defaults, from_namespace


def _label(path: str, taken: set[str]) -> str:
    p = Path(path)
    label = p.parent.name if p.name == "model.pt" else p.stem if p.suffix else p.name
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def task_list(text: str) -> list[str] | None:
    """The ``type=`` of a ``--tasks`` option: comma-separated task names (None when empty)."""
    return [t.strip() for t in text.split(",") if t.strip()] or None


def add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `squad.config.tools.InferenceOptions` (``--mone-capacity``, ``--mod-inference``), shared by
    every tool that runs a loaded model (evaluate, predict, extract, export, visualize)."""
    p.add_argument("--mone-capacity", type=float, default=None, help="MoNE effective capacity e_c in "
                   "[1/2^(E-1), 1] (MoNE models; default: the one the model was saved with)")
    p.add_argument("--mod-inference", choices=["topk", "threshold"], default=None, help="MoD inference: the top-k "
                   "tokens per block, or every token whose learned router says yes (needs a model trained with "
                   "model.mod.aux_loss=true; the share of tokens processed is reported). Default: the saved mode")


def add_precision_argument(p: argparse.ArgumentParser, default: str = "bf16 on CUDA, fp32 on the CPU") -> None:
    """``--precision``, shared by evaluate, predict, extract and export (`squad.models.precision`)."""
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None,
                   help=f"dtype the model runs in (default: {default}; on CUDA the routed layers' grouped GEMMs "
                        "run in either without a host sync, bf16 the faster)")


def add_compile_argument(p: argparse.ArgumentParser) -> None:
    """``--compile``, shared by evaluate and predict."""
    p.add_argument("--compile", action="store_true", help="torch.compile the model before running it (inductor: the "
                   "first batches wait for the compiler, later ones run faster; graph breaks: squad.models.compile)")


def format_compute(label: str, compute: dict) -> list[str]:
    """Lines on a model's inference settings and compute (`squad.eval.evaluate.compute_summary`)."""
    lines = []
    settings = compute.get("inference") or {}
    if settings:
        lines.append(f"inference {label}: " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in settings.items()))
    for layer, per_task in (compute.get("mod_tokens") or {}).items():
        if per_task:
            mean = sum(per_task.values()) / len(per_task)
            lines.append(f"  {layer} processed {mean:.1%} of tokens (mean over {len(per_task)} tasks; "
                         f"{min(per_task.values()):.1%}–{max(per_task.values()):.1%})")
    for layer, per_task in (compute.get("mone_tokens") or {}).items():
        for task, shares in per_task.items():
            lines.append(f"  {layer} {task}: tokens per nested expert (smallest first) "
                         + " ".join(f"{v:.1%}" for v in shares))
            break  # the group sizes are fixed by e_c: the same for every task
    macs = compute.get("macs") or {}
    if macs:
        line = f"  MACs/image (mean over tasks): {sum(macs.values()) / len(macs):,.0f} at capacity"
        measured = compute.get("macs_measured")
        if measured and measured != macs:
            line += f", {sum(measured.values()) / len(measured):,.0f} from the measured MoD shares"
        lines.append(line)
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/evaluate.py`` / ``squad-evaluate``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", required=True,
                   help="run folder, model.pt, extracted model, Hugging Face-style folder or "
                   "hf-hub:ORG/NAME (repeat to compare several side by side)")
    p.add_argument("--data", required=True, help="dataset root")
    p.add_argument("--split", help="train, val, test or all (default val)")
    p.add_argument("--tasks", type=task_list, help="comma-separated tasks (default: every task of each model)")
    p.add_argument("--baseline", nargs="+", default=None, help="baseline results JSON file(s) for Δt")
    p.add_argument("--batches", type=int, help="batches to evaluate (0 = the whole split)")
    p.add_argument("--batch-size", type=int)
    add_inference_arguments(p)
    add_compile_argument(p)
    add_precision_argument(p)
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--workers", type=int)
    p.add_argument("--out", default=None, help="results JSON (default: eval_<split>.json in the first checkpoint's "
                   "run folder, or beside a model file)")
    p.set_defaults(**defaults(EvaluateConfig))
    return p


def _evaluate(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    require_paths(args.checkpoint, args.data)  # before anything heavy is imported
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")

    from squad.eval.evaluate import delta_against, evaluate_run, format_results, load_baseline
    from squad.io import load
    from squad.io.files import atomic_write_text, check_writable

    cfg = from_namespace(EvaluateConfig, args)  # the options of every model's evaluation, checked, in one place
    out = Path(args.out) if args.out else beside(args.checkpoint[0]) / f"eval_{args.split}.json"
    # before the models are loaded and run (a read-only place is refused: exit 2)
    check_writable(out, "--out" if args.out else "the default --out")
    taken: set[str] = set()
    baseline = load_baseline(args.baseline) if args.baseline else None
    models = {}
    for path in args.checkpoint:
        try:
            run_ = evaluate_run(load(path), args.data, cfg)
        except ValueError as e:
            if len(args.checkpoint) == 1:
                raise
            raise ValueError(f"{path}: {e}") from e  # name the model among several
        metrics = run_["metrics"]
        entry = {"checkpoint": path, "metrics": metrics, "compute": run_["compute"], "data": run_["data"],
                 "precision": run_["precision"]}
        if baseline is not None:
            entry["delta_t"] = delta_against(metrics, baseline)
        models[_label(path, taken)] = entry
    print(f"split {args.split} of {args.data}")
    print(format_results({label: e["metrics"] for label, e in models.items()}))
    for label, e in models.items():
        for line in format_compute(label, e["compute"]):
            print(line)
        if "delta_t" in e:
            dt = e["delta_t"]
            parts = ", ".join(f"{t} {v:+.2f}%" for t, v in dt["per_task"].items())
            print(f"Δt {label}: mean {dt['mean']:+.2f}% ({parts})"
                  + (f"; no baseline for {', '.join(dt['tasks_without_baseline'])}"
                     if dt["tasks_without_baseline"] else ""))
    result = {"split": args.split, "data": args.data}
    if len(models) == 1:
        result.update(next(iter(models.values())))
    else:
        result["models"] = models
    atomic_write_text(out, json.dumps(result, indent=2) + "\n", "the evaluation results")
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Evaluates models side by side; exit 2 on bad input, a missing baseline task included (`squad.cli.run`)."""
    return run(_evaluate, argv, bad_input=(KeyError,))  # KeyError: delta_t found no baseline for a task or metric


if __name__ == "__main__":
    sys.exit(main())
