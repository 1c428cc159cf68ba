"""Evaluating models: every task's metrics on a split, several models side by side, and Δt against a baseline.

Two halves, the second built on the first:

* Running a model: `eval_loader` gives this rank's in-order share of a dataset; `evaluate` runs a model over it
  in one fused pass per batch and scores every task with a `MetricAccumulator` (each task's additive statistics
  summed over batches, then over ranks, then finalised; `squad.eval.metrics`). The training engine uses both.
* Saved models and reports (the library side of tools/evaluate.py): `evaluate_model` and `evaluate_file` score an
  in-memory model or a run folder / ``model.pt`` / extracted model on a split, `side_by_side` scores several;
  `load_baseline` reads baseline results files (e.g. single-task runs), `delta_against` computes Δt against them
  (`squad.eval.metrics.delta_t`), `primary` picks each task's primary metric, and `format_results` prints the
  tables, each metric with its direction (``↓`` lower / ``↑`` higher is better, from the task).
* Inference settings (every tool that runs a saved model): `set_inference` sets MoNE's effective capacity e_c and
  MoD's inference mode (top-k or threshold) on a loaded model, refusing what the model cannot do; `evaluate_run`
  scores a saved model under them and reports the compute actually spent (`compute_summary`: the share of tokens
  each MoD block processed, tokens per nested MoNE expert, MACs per image at capacity and from the measured shares).

Example::

    results = evaluate_file("runs/demo", "data/synthetic", "val")
    table = side_by_side({"full": "runs/demo", "depth θ=0.01": "runs/demo/depth.pt"}, "data/synthetic")
    dt = delta_against(results, load_baseline(["runs/stl_depth/eval.json", "runs/stl_normal/eval.json"]))
    run = evaluate_run("runs/mod", "data/synthetic", mod_inference="threshold")   # + run["compute"]
    print(format_results({"full": results}))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from squad.analysis.flops import mod_shares, mone_shares, profile
from squad.analysis.usage import ExpertUsage
from squad.data import TaskonomyBase, build_dataset, collate, report
from squad.data.samplers import InOrderBatches
from squad.eval.metrics import MetricAccumulator, delta_t
from squad.io import load
from squad.layers.mod import MoDBlock
from squad.layers.mone import MoNEBlock
from squad.models.single_task import SingleTaskModel
from squad.tasks import get_task

# --------------------------------------------------------------------------------------------- running a model


def eval_loader(dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """An in-order loader over this rank's shard of ``dataset``, every sample at most once.

    A sample the dataset cannot use (a corrupt or wrong-size file, `squad.data.accounting`) is left out — its
    batch is smaller — never replaced by its neighbour, so nothing is scored twice.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if isinstance(dataset, TaskonomyBase):
        dataset = dataset.without_substitutes()
    return DataLoader(InOrderBatches(dataset, batch_size, rank, world, collate), batch_size=None,
                      num_workers=workers)


@torch.no_grad()
def evaluate(model, loader, tasks: Sequence[str], device: torch.device | str = "cpu", max_batches: int = 0,
             dtype: torch.dtype | None = None, usage: ExpertUsage | None = None,
             counts: dict | None = None) -> dict[str, dict[str, float]]:
    """Every task's metrics over ``loader`` (all ranks' shares combined).

    Args:
        model: a `SquadViT` (or anything with the same call signature).
        loader: batches from `squad.data.collate`.
        tasks: the tasks to score (all run in one fused pass per batch).
        device: where to run.
        max_batches: stop after this many batches per rank (0 = all).
        dtype: input dtype (e.g. bfloat16 for a bf16 model).
        usage: when given, the routing statistics of the pass are added to it (calibration).
        counts: when given, ``counts["images"]`` is set to the images scored over all ranks (samples the data could
            not produce are left out, `eval_loader`).

    Returns:
        task → metric → value (in the units the task's `decode` gives), keyed by the names in ``tasks``; a task
        that saw no batch maps to ``{}``.
    """
    was_training = model.training
    model.eval()
    acc = MetricAccumulator(list(tasks))
    scored = 0
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            scored += batch["rgb"].shape[0]
            images = batch["rgb"].to(device)
            if dtype is not None:
                images = images.to(dtype)
            out = model(images, list(tasks))
            if usage is not None:
                usage.update(out.stats)
            for t, pred in out.preds.items():
                task = get_task(t)
                target = task.target(batch["targets"][t].to(device))
                acc.update(t, task.metric_sums(pred.float(), target, batch["masks"][t].to(device)))
    finally:
        model.train(was_training)
    final = acc.compute()
    if counts is not None:
        total = torch.tensor([float(scored)], dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        counts["images"] = int(total.item())
    return {t: final.get(get_task(t).name, {}) for t in tasks}


# ------------------------------------------------------------------------------------------------ saved models


def evaluate_model(model, tasks: Sequence[str], data: str | Path, split: str = "val", batches: int = 0,
                   batch_size: int = 8, device: str | torch.device = "cpu", workers: int = 0) -> dict:
    """Metrics of an in-memory `SquadViT` (or a `SingleTaskModel`) on ``tasks`` of a split: task → metric → value."""
    inner = getattr(model, "model", model)
    ds = build_dataset(data, list(tasks), split, image_size=inner.cfg.img_size, augment=False)
    inner.to(device)
    return evaluate(inner, eval_loader(ds, batch_size, workers), list(tasks), device, batches)


def set_inference(model, mone_capacity: float | None = None, mod_inference: str | None = None) -> dict:
    """Sets how a loaded model runs at inference: MoNE's effective capacity and MoD's routing mode.

    Args:
        model: a `SquadViT` or `SingleTaskModel` (changed in place; an extraction of it keeps the settings).
        mone_capacity: MoNE effective capacity e_c in [1/2^(E-1), 1] (None: leave it).
        mod_inference: ``"topk"`` (k = ceil(C · N) tokens per MoD block) or ``"threshold"`` (the tokens whose
            learned router logit is > 0, i.e. sigmoid > 0.5; needs learned MoD routers trained with
            ``model.mod.aux_loss``) (None: leave it).

    Returns:
        The settings now in effect (`inference_settings`).

    Raises:
        ValueError: a setting for a model without such blocks, e_c out of range, an unknown mode, or threshold
            inference the model's MoD routers were not trained for.
    """
    inner = getattr(model, "model", model)
    mod = [m for m in inner.modules() if isinstance(m, MoDBlock)]
    if mone_capacity is not None:
        if not any(isinstance(m, MoNEBlock) for m in inner.modules()):
            raise ValueError(f"mone_capacity (--mone-capacity) applies to Mixture of Nested Experts models; this "
                             f"model ({inner.cfg.name}) has no MoNE blocks")
        inner.set_mone_capacity(float(mone_capacity))
    if mod_inference is not None:
        if mod_inference not in ("topk", "threshold"):
            raise ValueError(f"mod_inference (--mod-inference) must be topk or threshold, got {mod_inference!r}")
        if not mod:
            raise ValueError(f"mod_inference (--mod-inference) applies to Mixture-of-Depths models; this model "
                             f"({inner.cfg.name}) has no MoD blocks")
        if mod_inference == "threshold":
            if not any(b.routing == "learned" for b in mod):
                raise ValueError("threshold MoD inference keeps the tokens whose learned router logit is > 0; this "
                                 "model's MoD blocks route on attention (A-MoD) and have no router to threshold: "
                                 "use topk")
            if not inner.cfg.mod.aux_loss:
                raise ValueError("threshold MoD inference needs routers trained to threshold (model.mod.aux_loss="
                                 "true, the BCE against top-k membership); this model was trained without it, so "
                                 "its router logits carry no threshold: use topk")
        new = dataclasses.replace(inner.cfg.mod, inference=mod_inference)
        new.check("model.mod")
        for block in mod:
            block.cfg = new
        inner.cfg = dataclasses.replace(inner.cfg, mod=new)
    return inference_settings(inner)


def inference_settings(model) -> dict:
    """``{"mone_capacity": e_c}`` for a MoNE model, ``{"mod_inference": mode, "mod_capacity": C}`` for a MoD model
    (both for a model with both kinds; ``{}`` for neither)."""
    inner = getattr(model, "model", model)
    out: dict = {}
    if any(isinstance(m, MoNEBlock) for m in inner.modules()):
        out["mone_capacity"] = float(inner.mone_capacity)
    mod = [m for m in inner.modules() if isinstance(m, MoDBlock)]
    if mod:
        learned = any(b.routing == "learned" for b in mod)
        out["mod_inference"] = mod[0].cfg.inference if learned else "topk"
        out["mod_capacity"] = float(mod[0].cfg.capacity)
    return out


def compute_summary(model, tasks: Sequence[str], usage: ExpertUsage | None = None) -> dict:
    """The compute a model spent per image and task, from its settings and (when given) recorded statistics.

    Args:
        model: a `SquadViT` or `SingleTaskModel`.
        tasks: canonical task names to report.
        usage: statistics recorded while it ran (e.g. `evaluate`'s ``usage``), for the measured MoD shares.

    Returns:
        ``{"inference": inference_settings, "macs": {task: MACs at capacity}}``, and with statistics of MoD blocks
        ``"mod_tokens"`` (block → task → share of tokens processed) and ``"macs_measured"`` (task → MACs with MoD
        blocks at their measured shares), with MoNE statistics ``"mone_tokens"`` (router → task → share per
        nested expert, smallest first).
    """
    inner = getattr(model, "model", model)
    tasks = list(tasks)
    prof = profile(inner, tasks)
    out: dict = {"inference": inference_settings(inner), "macs": {t: prof["tasks"][t]["macs"] for t in tasks}}
    if usage is not None:
        shares = {layer: {t: v for t, v in per.items() if t in tasks} for layer, per in mod_shares(usage).items()}
        if any(shares.values()):
            measured = profile(inner, tasks, mod_share=shares)
            out["mod_tokens"] = shares
            out["macs_measured"] = {t: measured["tasks"][t]["macs"] for t in tasks}
        mone = {layer: {t: v for t, v in per.items() if t in tasks} for layer, per in mone_shares(usage).items()}
        if any(mone.values()):
            out["mone_tokens"] = mone
    return out


def evaluate_run(path: str | Path, data: str | Path, split: str = "val", tasks: Sequence[str] | None = None,
                 batches: int = 0, batch_size: int = 8, device: str | torch.device = "cpu", workers: int = 0, *,
                 mone_capacity: float | None = None, mod_inference: str | None = None) -> dict:
    """Metrics and compute of a run folder / ``model.pt`` / extracted model on a split, under inference settings.

    Args:
        path, data, split, tasks, batches, batch_size, device, workers: as `evaluate_file`.
        mone_capacity: MoNE effective capacity e_c for this evaluation (`set_inference`).
        mod_inference: MoD inference mode for this evaluation, ``"topk"`` or ``"threshold"`` (`set_inference`).

    Returns:
        ``{"metrics": {task: {metric: value}}, "compute": compute_summary, "data": DataReport.as_dict()}``; under
        threshold MoD inference ``compute["mod_tokens"]`` is the share of tokens each MoD block actually processed
        and ``compute["macs_measured"]`` the MACs per image from it. ``data`` counts the images scored and the
        files the split could not use (`squad.data.accounting`; its summary line is logged too).

    Raises:
        ValueError: a task the model does not have (listing its tasks), not a squad model file, or an inference
            setting the model cannot take.
    """
    model = load(path)
    inner = model.model if isinstance(model, SingleTaskModel) else model
    set_inference(inner, mone_capacity, mod_inference)
    names = inner.task_names if tasks is None else [inner.task_names[i] for i in inner.task_index(list(tasks))]
    ds = build_dataset(data, list(names), split, image_size=inner.cfg.img_size, augment=False)
    inner.to(device)
    usage = ExpertUsage(inner.task_names)
    counts: dict = {}
    metrics = evaluate(inner, eval_loader(ds, batch_size, workers), list(names), device, batches, usage=usage,
                       counts=counts)
    usage.all_reduce()
    data_report = report(ds, split if isinstance(split, str) else "+".join(split), images=counts["images"])
    logging.getLogger("squad.data").info("%s", data_report.line())
    return {"metrics": metrics, "compute": compute_summary(inner, names, usage), "data": data_report.as_dict()}


def evaluate_file(path: str | Path, data: str | Path, split: str = "val", tasks: Sequence[str] | None = None,
                  batches: int = 0, batch_size: int = 8, device: str | torch.device = "cpu",
                  workers: int = 0, *, mone_capacity: float | None = None,
                  mod_inference: str | None = None) -> dict[str, dict[str, float]]:
    """Metrics of a run folder / ``model.pt`` / extracted model on a split.

    Args:
        path: the model file or run folder.
        data: dataset root.
        split: ``train``, ``val``, ``test`` or ``all``.
        tasks: tasks to score (default: every task of the model; an extracted model has one).
        batches: batches to use (0 = the whole split).
        batch_size: images per batch.
        device: where to run.
        workers: loader workers.
        mone_capacity: MoNE effective capacity e_c (`set_inference`; default: the saved one).
        mod_inference: MoD inference mode, topk or threshold (`set_inference`; default: the saved one).

    Raises:
        ValueError: a task the model does not have (listing its tasks), not a squad model file, or an inference
            setting the model cannot take.
    """
    return evaluate_run(path, data, split, tasks, batches, batch_size, device, workers, mone_capacity=mone_capacity,
                        mod_inference=mod_inference)["metrics"]


def side_by_side(models: Mapping[str, str | Path], data: str | Path, split: str = "val", batches: int = 0,
                 batch_size: int = 8, device: str | torch.device = "cpu", workers: int = 0) -> dict:
    """Several models on the same split.

    Args:
        models: column label → run folder / model file (full or extracted).

    Returns:
        ``{"split": split, "models": {label: {task: {metric: value}}}}``; a task appears under every model that
        has it (an extracted model only has its own).
    """
    return {"split": split,
            "models": {label: evaluate_file(path, data, split, None, batches, batch_size, device, workers)
                       for label, path in models.items()}}


# --------------------------------------------------------------------------------------------- Δt and reports


def primary(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each task's primary metric (the one Δt uses by default)."""
    return {t: m[get_task(t).primary_metric] for t, m in results.items() if m}


def load_baseline(paths: str | Path | Sequence[str | Path]) -> dict[str, dict[str, float]]:
    """Baseline metrics from one or more JSON files (later files add or replace tasks).

    Accepted layouts: ``{"metrics": {task: {metric: v}}}`` (tools/evaluate.py output), ``{task: {metric: v}}``,
    or an extraction report (its ``metrics.extracted``).

    Raises:
        FileNotFoundError, ValueError: missing or unreadable file, or no task metrics in it.
    """
    if isinstance(paths, str | Path):
        paths = [paths]
    out: dict[str, dict[str, float]] = {}
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"baseline results file not found: {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a JSON results file ({e})") from e
        if isinstance(data, dict) and isinstance(data.get("metrics"), dict):
            top, data = data, data["metrics"]
            if "extracted" in data and "task" in top:  # an extraction report
                data = {top["task"]: data["extracted"]}
        tables = {}
        for task, metrics in (data.items() if isinstance(data, dict) else []):
            try:
                name = get_task(task).name
            except ValueError:
                continue
            if isinstance(metrics, dict):
                tables[name] = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if not tables:
            raise ValueError(f"{p}: no task metrics found (expected {{'metrics': {{task: {{metric: value}}}}}})")
        out.update(tables)
    return out


def delta_against(results: Mapping[str, Mapping[str, float]], baseline: Mapping[str, Mapping[str, float]]) -> dict:
    """Δt (percent, higher is better) per task and its mean, over the tasks both sides have.

    Returns:
        ``{"per_task": {task: Δt}, "mean": Δt, "tasks_without_baseline": [...]}``.

    Raises:
        ValueError: no task in common.
    """
    common = {t: m for t, m in results.items() if get_task(t).name in {get_task(b).name for b in baseline} and m}
    missing = sorted(t for t in results if t not in common)
    if not common:
        raise ValueError(f"the baseline has none of the evaluated tasks ({', '.join(sorted(results))}); "
                         f"it covers {', '.join(sorted(baseline))}")
    dt = delta_t(common, baseline)
    mean = dt.pop("mean")
    return {"per_task": dt, "mean": mean, "tasks_without_baseline": missing}


def format_results(columns: Mapping[str, Mapping[str, Mapping[str, float]]], primary_only: bool = False) -> str:
    """A text table: one row per (task, metric), one column per model.

    Each metric carries its direction (``↓`` lower is better, ``↑`` higher is better, from the task's
    `higher_is_better`), and the primary metric a ``*``; a legend line ends the table.

    Args:
        columns: column label → ``{task: {metric: value}}``; missing or NaN values print as ``-``.
        primary_only: one row per task, its primary metric.
    """
    labels = list(columns)
    tasks = list(dict.fromkeys(t for col in columns.values() for t in col))
    width = max(12, *(len(label) + 2 for label in labels))
    lines = [f"{'task':<20}{'metric':<14}" + "".join(f"{label:>{width}}" for label in labels)]
    for task in tasks:
        spec = get_task(task)
        metrics = list(dict.fromkeys(m for col in columns.values() for m in col.get(task, {})))
        if primary_only:
            metrics = [spec.primary_metric]
        for metric in metrics:
            cells = []
            for label in labels:
                v = columns[label].get(task, {}).get(metric)
                cells.append(f"{'-':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v))
                             else f"{v:>{width}.4f}")
            arrow = "↓" if spec.lower_is_better_for(metric) else "↑"
            mark = "*" if metric == spec.primary_metric else ""
            lines.append(f"{task:<20}{metric + ' ' + arrow + mark:<14}" + "".join(cells))
    lines.append("↓ lower is better, ↑ higher is better, * primary metric (Δt)")
    return "\n".join(lines)
