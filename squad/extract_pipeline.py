"""The library side of tools/extract.py: load a run, measure the task's expert usage, extract, profile, score the
model before and after on held-out data, and write the extracted model with a JSON report beside it.

    report = extract_to_file("runs/demo", "depth", "runs/demo/depth.pt", theta=0.01, data="data/synthetic")
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from squad.data import EmptyDatasetError, build_dataset
from squad.evaluation import eval_loader, evaluate
from squad.extract import collect_usage, extract, layer_report, save_extracted
from squad.loading import load_full_model
from squad.profile import profile
from squad.pruning import check_keep_top, check_theta

log = logging.getLogger(__name__)


def _loader(data: str | Path, task: str, split: str, image_size: int, batch_size: int, workers: int):
    ds = build_dataset(data, [task], split, image_size=image_size, augment=False)
    return eval_loader(ds, batch_size, workers), len(ds)


def extract_to_file(checkpoint: str | Path, task: str, out: str | Path, *, theta: float | None = 0.01,
                    keep_top: float | None = None, renormalize: bool = False, data: str | Path | None = None,
                    calib_split: str = "train", calib_batches: int = 8, eval_split: str | None = "val",
                    eval_batches: int = 0, batch_size: int = 8, saved_usage: bool = False,
                    device: str | torch.device = "cpu", workers: int = 0) -> dict:
    """Extracts ``task`` from a trained model into ``out`` and returns the report (also written as JSON).

    Args:
        checkpoint: run folder or ``model.pt``.
        task: task name or alias.
        out: the extracted model file (the report goes to ``out`` with suffix ``.json``).
        theta: usage threshold in [0, 1) (ignored when ``keep_top`` is given).
        keep_top: keep the top H share of experts per layer, H in (0, 1].
        renormalize: the paper's pruned router (softmax over kept experts) instead of exact routing.
        data: dataset root for the calibration pass and the held-out metrics.
        calib_split: split for the calibration pass.
        calib_batches: calibration batches (0 = the whole split).
        eval_split: held-out split for metrics before/after (None: no metrics).
        eval_batches: evaluation batches (0 = all).
        batch_size: images per batch.
        saved_usage: use the statistics saved in ``model.pt`` even when ``data`` is given.
        device: where to run.
        workers: data loader workers.

    Raises:
        ValueError: θ or H out of range, an unknown task, a file that is not a squad model, no usage available.
        FileNotFoundError: missing checkpoint or data.
    """
    check_theta(theta if keep_top is None else None)
    check_keep_top(keep_top)
    if keep_top is None and theta is None:
        raise ValueError("give theta (a usage threshold) or keep_top (a share of experts per layer)")
    model, saved, meta = load_full_model(checkpoint)
    (t,) = model.task_index([task])
    name = model.task_names[t]
    model.to(device)
    size = model.cfg.img_size
    if data is not None and not saved_usage:
        loader, n_images = _loader(data, name, calib_split, size, batch_size, workers)
        usage = collect_usage(model, name, loader, calib_batches, device)
        images = min(n_images, calib_batches * batch_size) if calib_batches else n_images
        source = {"kind": "calibration", "data": str(data), "split": calib_split, "images": images}
    else:
        if saved is None:
            raise ValueError(f"{meta['path']} holds no usage statistics; pass data= (--data DIR) for a calibration "
                             f"pass over {name}'s data")
        usage = saved
        source = {"kind": "saved statistics", "file": meta["path"]}
    ext = extract(model, name, usage, theta=theta, keep_top=keep_top, renormalize=renormalize)
    full_prof, ext_prof = profile(model, [name]), profile(ext.model)
    layers = layer_report(ext, model)
    report = {
        "task": name,
        "checkpoint": meta["path"],
        "out": str(out),
        "criterion": {"keep_top": keep_top} if keep_top is not None else {"theta": theta},
        "routing": "renormalized" if renormalize else "exact",
        "usage": source,
        "params": _pair(full_prof["params"], ext_prof["params"]),
        "active_params": _pair(full_prof["tasks"][name]["active_params"], ext_prof["tasks"][name]["active_params"]),
        "macs": _pair(full_prof["tasks"][name]["macs"], ext_prof["tasks"][name]["macs"]),
        "experts": _pair(sum(v["experts_before"] for v in layers.values()),
                         sum(v["experts_after"] for v in layers.values())),
        "layers": layers,
        "metrics": None,
    }
    if data is not None and eval_split:
        try:
            loader, n_eval = _loader(data, name, eval_split, size, batch_size, workers)
        except (EmptyDatasetError, ValueError) as e:
            log.warning("no held-out metrics: %s", e)
        else:
            before = evaluate(model, loader, [name], device, eval_batches)[name]
            after = evaluate(ext.model, loader, [name], device, eval_batches)[name]
            report["metrics"] = {"split": eval_split, "images": n_eval, "full": before, "extracted": after}
    out = Path(out)
    save_extracted(out, ext, report)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    log.info("extracted %s: %d → %d parameters, written to %s", name, report["params"]["full"],
             report["params"]["extracted"], out)
    return report


def _pair(full: float, extracted: float) -> dict:
    return {"full": full, "extracted": extracted, "ratio": extracted / full if full else float("nan")}


def format_report(report: dict) -> str:
    """A plain-text summary table of an extraction report."""
    crit = ", ".join(f"{k} {v}" for k, v in report["criterion"].items())
    lines = [f"extracted {report['task']} ({crit}, {report['routing']} routing; usage from {report['usage']['kind']})",
             f"{'':<16}{'full':>14}{'extracted':>14}{'ratio':>9}"]
    for key in ("params", "active_params", "macs", "experts"):
        p = report[key]
        lines.append(f"{key:<16}{p['full']:>14,}{p['extracted']:>14,}{p['ratio']:>9.3f}")
    lines.append("experts kept per layer:")
    for layer, info in report["layers"].items():
        lines.append(f"  {layer:<24} {info['kind']:<4} {info['experts_after']:>3}/{info['experts_before']:<3} "
                     f"top-{info['top_k']}  {info['kept']}")
    m = report.get("metrics")
    if m:
        lines.append(f"metrics on {m['split']} ({m['images']} images):")
        for metric in m["full"]:
            lines.append(f"  {metric:<14}{m['full'][metric]:>12.4f}{m['extracted'][metric]:>12.4f}")
    return "\n".join(lines)
