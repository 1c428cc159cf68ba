"""Single-task subnetwork extraction (Mod-Squad §3.4): one task's router, embedding and head, and only the experts
that task uses, as a standalone model file that loads without DeepSpeed.

    ext = extract(model, "depth", usage, theta=0.01)   # usage: calibration pass or the run's saved statistics
    save_extracted("depth.pt", ext)
    ext = squad.load("depth.pt")                        # weights_only; model(images) → depth prediction
    depth = ext(images)                                 # [B, 1, H, W]

The task's usage frequencies come from a calibration pass over its data (`collect_usage`, the default in
tools/extract.py) or from the statistics saved in ``model.pt``; `squad.models.pruning` decides and slices. MoD
and MoNE parts stay as they are (with the inference settings the model had: `squad.models.inference.set_inference`).
The file holds the single-task config, the kept experts per layer, the routing mode and the weights; `squad.load`
rebuilds the model from the config, applies the same pruning and loads the weights.

A model without MoE attention / MoE MLP layers (dense MTL, MoD, A-MoD, MoNE) has no experts to prune: its
extraction still keeps only the task's head, router rows and embedding — a real single-task model, smaller by the
other tasks' heads, that loads and runs alone — and the report says that no experts could be pruned. A task the
run never trained (a head left at its initialisation) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from squad.analysis.flops import profile
from squad.config.tools import ExtractConfig
from squad.data import EmptyDatasetError, eval_loader
from squad.eval.evaluate import compute_summary, evaluate, model_dataset
from squad.io import save_extracted
from squad.io.files import atomic_write_text
from squad.models.inference import set_inference
from squad.models.precision import cast_copy, precision_dtype, precision_name
from squad.models.pruning import (
    choose_experts,
    prunable_layers,
    pruned_summary,
    task_frequencies,
)
from squad.models.single_task import SingleTaskModel
from squad.models.surgery import keep_experts, select_tasks
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- usage
def _images(batch) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict) and "rgb" in batch:
        return batch["rgb"]
    raise TypeError(f"calibration batches must be image tensors or data batches with 'rgb', got {type(batch)}")


@torch.no_grad()
def collect_usage(model: SquadViT, task: str, batches: Iterable, max_batches: int = 0,
                  device: torch.device | str | None = None) -> ExpertUsage:
    """Expert usage of ``task`` over calibration batches (the model in eval mode, as at inference).

    Args:
        model: the full model.
        task: the task (name or alias).
        batches: image tensors [B, C, H, W] or batches from `squad.data.collate`.
        max_batches: stop after this many (0 = all).
        device: where to run (default: the model's device).

    Returns:
        `ExpertUsage` over the model's tasks, filled for ``task`` only.
    """
    (t,) = model.task_index([task])
    name = model.task_names[t]
    first = next(model.parameters())
    device = device or first.device
    usage = ExpertUsage(model.task_names)
    was = model.training
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            usage.update(model(_images(batch).to(device, first.dtype), [name]).stats)  # a bf16 model: bf16 images
    finally:
        model.train(was)
    if not usage.counts:
        raise ValueError("collect_usage: no calibration batches (or the model has no routed layers)")
    return usage


# ------------------------------------------------------------------------------------------ extraction
def extract(model: SquadViT, task: str, usage: ExpertUsage | None, theta: float | None = 0.01,
            keep_top: float | None = None, renormalize: bool = False) -> SingleTaskModel:
    """Extracts ``task``'s subnetwork from a multi-task model (which is left unchanged).

    A model without MoE attention / MoE MLP layers keeps every weight of its backbone; only the other tasks' heads,
    router rows and embeddings go.

    Args:
        model: the full model.
        task: task name or alias.
        usage: its expert usage (calibration pass or saved statistics); may be None for a model without MoE
            attention / MoE MLP layers.
        theta: remove experts used by at most θ of the task's tokens (θ in [0, 1)); ignored with ``keep_top``.
        keep_top: keep the top H share of experts per layer instead (H in (0, 1]).
        renormalize: the paper's pruned router (softmax over the kept experts) instead of exact routing.

    Returns:
        The extracted `SingleTaskModel` (eval mode).
    """
    (t,) = model.task_index([task])
    name = model.task_names[t]
    if not prunable_layers(model):
        kept: dict[str, list[int]] = {}
    elif usage is None:
        raise ValueError(f"extract: {name}'s expert usage is needed to prune the model's MoE layers")
    else:
        freqs = task_frequencies(usage, name, model)
        kept = choose_experts(freqs, None if keep_top is not None else theta, keep_top)
    single = select_tasks(model, [name])
    keep_experts(single, kept, exact=not renormalize)
    return SingleTaskModel(single.eval(), name, kept, exact=not renormalize)


def kept_counts(model: nn.Module) -> dict[str, int]:
    """Layer → experts it holds now (for reports)."""
    return {name: layer.num_experts for name, layer in prunable_layers(model).items()}


def layer_report(ext: SingleTaskModel, full: SquadViT) -> dict[str, dict]:
    """Per MoE layer: kind, kept experts (original numbering), experts before/after, top-k after."""
    return pruned_summary(ext.model, ext.kept, kept_counts(full))


def _loader(model: SquadViT, data: str | Path, task: str, split: str, cfg: ExtractConfig):
    ds = model_dataset(model, data, [task], split)
    return eval_loader(ds, cfg.batch_size, cfg.workers), len(ds)


def extract_to_file(model: SquadViT, task: str, out: str | Path, cfg: ExtractConfig | None = None) -> dict:
    """Extracts ``task`` from a trained model into ``out`` and returns the report (also written as JSON).

    Args:
        model: the trained model as `squad.load_model` returns it: its ``usage`` (the statistics saved in
            ``model.pt``) serves when no calibration data is given, and its ``meta`` names the file and the tasks
            the run trained (a task it never trained is refused). Its inference settings are changed in place by
            ``cfg.inference``.
        task: task name or alias.
        out: the extracted model file (the report goes to ``out`` with suffix ``.json``).
        cfg: the criterion (θ or keep-top H), routing, calibration and evaluation data, inference settings and the
            precision of the calibration pass and the metrics (the weights are pruned and saved as they were
            loaded) — `squad.config.tools.ExtractConfig`; default: θ = 0.01 from the saved statistics, no metrics.

    Returns:
        The report: task, criterion, usage source, parameters / active parameters / MACs / experts before and after,
        per-layer kept experts, ``pruned`` (False for a model without MoE layers, with a ``note`` saying so),
        ``inference`` and ``compute`` (`squad.eval.evaluate.compute_summary` of the extracted model on the held-out
        split, e.g. the share of tokens its MoD blocks processed), and the metrics before/after.

    Raises:
        ValueError: θ or H out of range, an unknown task (the message lists the model's tasks), a task the run never
            trained, no usage available, an inference setting the model cannot take.
        FileNotFoundError: missing data.
    """
    cfg = cfg or ExtractConfig()
    cfg.check()
    theta, keep_top, data, device = cfg.theta, cfg.keep_top, cfg.data, cfg.device
    saved = getattr(model, "usage", None)
    meta = getattr(model, "meta", None) or {"path": f"the {model.cfg.name} model in memory"}
    (t,) = model.task_index([task])
    name = model.task_names[t]
    trained = (meta.get("extra") or {}).get("trained_tasks")
    if trained is not None and name not in trained:
        raise ValueError(f"{meta['path']}: the run never trained {name} (its head is untrained; the run trained "
                         f"{', '.join(trained)}); extract a trained task, or learn {name} first with "
                         f"tools/finetune_router.py")
    inference = set_inference(model, **dataclasses.asdict(cfg.inference))
    model.to(device)
    dtype = precision_dtype(cfg.precision, device)
    runner = cast_copy(model, dtype)  # the passes run in ``precision``; the weights pruned and saved stay as loaded
    prunable = bool(prunable_layers(model))
    if not prunable:
        usage, source = None, {"kind": "none (no MoE attention / MoE MLP layers to prune)"}
        log.info("%s has no MoE attention / MoE MLP layers: no experts can be pruned; keeping %s's head, router rows "
                 "and embedding only", meta["path"], name)
    elif data is not None and not cfg.saved_usage:
        loader, n_images = _loader(model, data, name, cfg.calib_split, cfg)
        usage = collect_usage(runner, name, loader, cfg.calib_batches, device)
        images = min(n_images, cfg.calib_batches * cfg.batch_size) if cfg.calib_batches else n_images
        source = {"kind": "calibration", "data": str(data), "split": cfg.calib_split, "images": images}
    else:
        if saved is None:
            raise ValueError(f"{meta['path']} holds no usage statistics; pass data= (--data DIR) for a calibration "
                             f"pass over {name}'s data")
        usage = saved
        source = {"kind": "saved statistics", "file": meta["path"]}
    ext = extract(model, name, usage, theta=theta, keep_top=keep_top, renormalize=cfg.renormalize)
    full_prof, ext_prof = profile(model, [name]), profile(ext.model)
    layers = layer_report(ext, model)
    report = {
        "task": name,
        "checkpoint": meta["path"],
        "out": str(out),
        "criterion": {"keep_top": keep_top} if keep_top is not None else {"theta": theta},
        "routing": "renormalized" if cfg.renormalize else "exact",
        "usage": source,
        "pruned": prunable,
        "params": _pair(full_prof["params"], ext_prof["params"]),
        "active_params": _pair(full_prof["tasks"][name]["active_params"], ext_prof["tasks"][name]["active_params"]),
        "macs": _pair(full_prof["tasks"][name]["macs"], ext_prof["tasks"][name]["macs"]),
        "experts": _pair(sum(v["experts_before"] for v in layers.values()),
                         sum(v["experts_after"] for v in layers.values())),
        "layers": layers,
        "inference": inference,
        "precision": precision_name(dtype),
        "compute": None,
        "metrics": None,
    }
    if not prunable:
        report["note"] = (f"no experts could be pruned: {model.cfg.name} has no MoE attention / MoE MLP layers; "
                          f"the extracted model keeps the shared backbone and only {name}'s head, router rows and "
                          f"task embedding")
    if data is not None and cfg.eval_split:
        try:
            loader, _ = _loader(model, data, name, cfg.eval_split, cfg)
        except (EmptyDatasetError, ValueError) as e:
            log.warning("no held-out metrics: %s", e)
        else:
            scored: dict = {}  # the images actually scored (--eval-batches N: N batches, not the whole split)
            before = evaluate(runner, loader, [name], device, cfg.eval_batches, dtype=dtype, counts=scored)[name]
            usage_after = ExpertUsage(ext.model.task_names)
            after = evaluate(cast_copy(ext.model, dtype), loader, [name], device, cfg.eval_batches, dtype=dtype,
                             usage=usage_after)[name]
            report["metrics"] = {"split": cfg.eval_split, "images": scored["images"], "full": before,
                                 "extracted": after}
            report["compute"] = compute_summary(ext.model, [name], usage_after)
    out = Path(out)
    save_extracted(out, ext, report)
    atomic_write_text(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n", "the extraction report")
    log.info("extracted %s: %d → %d parameters, written to %s", name, report["params"]["full"],
             report["params"]["extracted"], out)
    return report


def _pair(full: float, extracted: float) -> dict:
    return {"full": full, "extracted": extracted, "ratio": extracted / full if full else None}


def format_report(report: dict) -> str:
    """A plain-text summary table of an extraction report."""
    crit = ", ".join(f"{k} {v}" for k, v in report["criterion"].items())
    lines = [f"extracted {report['task']} ({crit}, {report['routing']} routing; usage from {report['usage']['kind']})",
             f"{'':<16}{'full':>14}{'extracted':>14}{'ratio':>9}"]
    for key in ("params", "active_params", "macs", "experts"):
        p = report[key]
        ratio = f"{p['ratio']:>9.3f}" if p["ratio"] is not None else f"{'-':>9}"
        lines.append(f"{key:<16}{p['full']:>14,}{p['extracted']:>14,}{ratio}")
    if report.get("note"):
        lines.append(report["note"])
    else:
        lines.append("experts kept per layer:")
    for layer, info in report["layers"].items():
        lines.append(f"  {layer:<24} {info['kind']:<4} {info['experts_after']:>3}/{info['experts_before']:<3} "
                     f"top-{info['top_k']}  {info['kept']}")
    settings = report.get("inference") or {}
    if settings:
        lines.append("inference: " + ", ".join(f"{k} {v}" for k, v in settings.items()))
    compute = report.get("compute") or {}
    for layer, per_task in (compute.get("mod_tokens") or {}).items():
        lines.append(f"  {layer}: processed {', '.join(f'{t} {v:.1%}' for t, v in per_task.items())} of tokens")
    if compute.get("macs_measured"):
        lines.append("MACs from the measured MoD shares: "
                     + ", ".join(f"{t} {v:,}" for t, v in compute["macs_measured"].items()))
    m = report.get("metrics")
    if m:
        lines.append(f"metrics on {m['split']} ({m['images']} images):")
        for metric in m["full"]:
            lines.append(f"  {metric:<14}{m['full'][metric]:>12.4f}{m['extracted'][metric]:>12.4f}")
    return "\n".join(lines)
