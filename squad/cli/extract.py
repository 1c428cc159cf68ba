"""Extract one task's subnetwork from a trained multi-task model into a standalone file.

    python tools/extract.py --checkpoint runs/demo --task depth --theta 0.01 --data data/synthetic
    python tools/extract.py --checkpoint runs/demo/model.pt --task normal --keep-top 0.4 --out normal.pt
    python tools/extract.py --checkpoint runs/demo --task depth --theta 0.01 --saved-usage   # no data needed

Expert usage comes from a calibration pass over the task's data (--data, --calib-split, --calib-batches) or, with
--saved-usage or without --data, from the statistics saved in model.pt. Experts used by at most θ of the task's
tokens (or all but the top H share with --keep-top) are removed from every MoE attention and MoE MLP layer;
routing stays exact unless --renormalize. Prints a summary and writes the model and a JSON report; load the model
with ``squad.load_extracted(path)``.

A model without MoE attention / MoE MLP layers (dense MTL, MoD, A-MoD, MoNE) has no experts to prune: the extracted
model keeps the backbone and only the task's head, router rows and task embedding, and the report says so (no
calibration data needed). --mone-capacity and --mod-inference set MoNE's e_c and MoD's inference mode for the
calibration, the metrics and the extracted model. A task the run never trained is refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from squad.cli import beside, device_arg, require_paths, run
from squad.cli.evaluate import add_inference_arguments, add_precision_argument
from squad.config.tools import ExtractConfig, defaults, from_namespace


def _default_out(checkpoint: str, task: str, theta: float | None, keep_top: float | None) -> Path:
    folder = beside(checkpoint)
    crit = f"top{keep_top:g}" if keep_top is not None else f"theta{theta:g}"
    return folder / f"{task}_{crit}.pt"


def _split_or_none(text: str) -> str | None:
    return None if text.lower() == "none" else text


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/extract.py`` / ``squad-extract`` (defaults: `squad.config.tools.ExtractConfig`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder or model.pt of the trained multi-task model, a "
                   "Hugging Face-style folder or a hub id hf-hub:ORG/NAME[@REVISION]")
    p.add_argument("--task", required=True, help="task to extract (name or alias, e.g. depth)")
    p.add_argument("--theta", type=float, help="remove experts used by at most this share of the task's tokens, in "
                   "[0, 1) (default 0.01)")
    p.add_argument("--keep-top", type=float, help="instead keep the top H share of experts per layer, H in (0, 1]")
    p.add_argument("--renormalize", action="store_true", help="softmax over the kept experts only (the paper's "
                   "pruned router) instead of exact routing")
    p.add_argument("--data", help="dataset root for the calibration pass and held-out metrics")
    p.add_argument("--calib-split")
    p.add_argument("--calib-batches", type=int, help="calibration batches (0 = the whole split)")
    p.add_argument("--eval-split", type=_split_or_none, help="held-out split for metrics before/after ('none' to "
                   "skip)")
    p.add_argument("--eval-batches", type=int, help="evaluation batches (0 = the whole split)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--saved-usage", action="store_true", help="use the usage statistics saved in model.pt")
    add_inference_arguments(p)
    add_precision_argument(p)
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--workers", type=int)
    p.add_argument("--out", default=None, help="output file (default: <run>/<task>_theta<θ>.pt); the report is "
                   "written beside it as .json")
    p.add_argument("--hf-out", default=None, metavar="FOLDER", help="also write the extracted model as a Hugging "
                   "Face-style folder (model.safetensors, config.json with the kept experts, a model card)")
    p.set_defaults(**defaults(ExtractConfig))
    return p


def _extract(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    cfg = from_namespace(ExtractConfig, args)  # the tool's options, checked, in one place
    require_paths(args.checkpoint, args.data)  # both before anything heavy is imported
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")

    from squad.io import load_model
    from squad.io.files import check_writable
    from squad.posttrain.extract import extract_to_file, format_report

    out = args.out or _default_out(args.checkpoint, args.task, cfg.theta, cfg.keep_top)
    # before the model is loaded and calibrated
    check_writable(out, "--out" if args.out else "the default --out")
    if args.hf_out:
        check_writable(Path(args.hf_out), "--hf-out", folder=True)
    report = extract_to_file(load_model(args.checkpoint), args.task, out, cfg)
    print(format_report(report))
    print(f"model: {out}\nreport: {Path(out).with_suffix('.json')}")
    if args.hf_out:
        from squad.deploy.hf import save_pretrained
        from squad.io import load_extracted

        save_pretrained(load_extracted(out), args.hf_out)
        print(f"folder: {args.hf_out} (model.safetensors, config.json, README.md; squad.load opens it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Extracts one task's subnetwork and writes it with its report; exit 2 on bad input (`squad.cli.run`)."""
    return run(_extract, argv)


if __name__ == "__main__":
    sys.exit(main())
