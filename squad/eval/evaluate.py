"""Evaluating models: every task's metrics on a split, several models side by side, and Δt against a baseline.

Two halves, the second built on the first:

* Running a model: `evaluate` runs a model over a loader (`squad.data.eval_loader`: this rank's in-order share of
  a dataset) in one fused pass per batch and scores every task with a `MetricAccumulator` (each task's additive
  statistics summed over batches, then over ranks, then finalised; `squad.eval.metrics`). The training engine uses
  it. Tasks decode and score as the model configures them (``model.cfg.task_options``).
* Models and reports (the library side of tools/evaluate.py; the models are loaded ones, `squad.load`):
  `evaluate_model` scores a model on a split, `evaluate_run` also under inference settings
  (`squad.models.inference.set_inference`: MoNE's e_c, MoD's top-k or threshold) with the compute actually spent
  (`compute_summary`: the share of tokens each MoD block processed, tokens per nested MoNE expert, MACs per image at
  capacity and from the measured shares), `side_by_side` scores several; `load_baseline` reads baseline results
  files (e.g. single-task runs), `delta_against` computes Δt against them (`squad.eval.metrics.delta_t`), `primary`
  picks each task's primary metric, and `format_results` prints the tables, each metric with its direction (``↓``
  lower / ``↑`` higher is better, from the task).

Example::

    model = squad.load("runs/demo")
    results = evaluate_model(model, model.task_names, "data/synthetic", "val")
    table = side_by_side({"full": model, "depth θ=0.01": squad.load("runs/demo/depth.pt")}, "data/synthetic")
    dt = delta_against(results, load_baseline(["runs/stl_depth/eval.json", "runs/stl_normal/eval.json"]))
    run = evaluate_run(squad.load("runs/mod"), "data/synthetic",                           # + run["compute"]
                       EvaluateConfig(inference=InferenceOptions(mod_inference="threshold")))
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

from squad.analysis.flops import mod_shares, mone_shares, profile
from squad.config.tools import EvaluateConfig
from squad.data import build_dataset, eval_loader, report
from squad.eval.metrics import MetricAccumulator, delta_t
from squad.layers.parallel import is_sharded
from squad.models.compile import compile_model
from squad.models.inference import inference_settings, set_inference
from squad.models.precision import cast_model, precision_name
from squad.models.single_task import SingleTaskModel
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT
from squad.tasks import get_task

# --------------------------------------------------------------------------------------------- running a model


@torch.no_grad()
def evaluate(model, loader, tasks: Sequence[str], device: torch.device | str = "cpu", max_batches: int = 0,
             dtype: torch.dtype | None = None, usage: ExpertUsage | None = None,
             counts: dict | None = None) -> dict[str, dict[str, float]]:
    """Every task's metrics over ``loader`` (all ranks' shares combined).

    Args:
        model: a `SquadViT` (or anything with the same call signature); its tasks (``model.get_task``: configured by
            its ``task_options``; the defaults for a model without one) decode the targets' units and score the
            predictions.
        loader: batches from `squad.data.collate` (a dataset built with the model's ``task_options``).
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
    task_of = getattr(model, "get_task", None) or get_task  # a SquadViT's configured tasks; defaults otherwise
    specs = {t: task_of(t) for t in tasks}
    acc = MetricAccumulator(list(specs.values()))
    scored = 0
    # expert-parallel layers exchange tokens, ZeRO-3 gathers each layer's weights: every rank runs every pass
    lockstep = is_sharded(model) or any(hasattr(p, "ds_id") for p in model.parameters())
    try:
        for i, batch in enumerate(_batches(loader, lockstep, device)):
            if max_batches and i >= max_batches:
                break
            if batch is None:  # this rank is out of batches, others are not: a pass whose results nobody reads
                cfg = model.cfg
                model(torch.zeros(1, cfg.in_chans, cfg.img_size, cfg.img_size, device=device, dtype=dtype),
                      list(tasks))
                continue
            scored += batch["rgb"].shape[0]
            images = batch["rgb"].to(device)
            if dtype is not None:
                images = images.to(dtype)
            out = model(images, list(tasks))
            if usage is not None:
                usage.update(out.stats)
            for t, pred in out.preds.items():
                task = specs.get(t) or task_of(t)
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
    return {t: final.get(specs[t].name, {}) for t in tasks}


def _batches(loader, lockstep: bool, device):
    """The loader's batches; with ``lockstep`` (an expert-parallel model, whose layers exchange tokens with the other
    ranks of their group, or a ZeRO-3 one, whose layers gather their weights from them) the ranks agree before each
    batch whether any still has one, and a rank that has none gets None until none has."""
    if not lockstep or not (dist.is_initialized() and dist.get_world_size() > 1):
        yield from loader
        return
    it = iter(loader)
    while True:
        batch = next(it, None)
        flag = torch.tensor([float(batch is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        yield batch


# ------------------------------------------------------------------------------------------------------- models


def _inner(model: SquadViT | SingleTaskModel) -> SquadViT:
    """The `SquadViT` that runs (an extracted model's pruned one)."""
    return model.model if isinstance(model, SingleTaskModel) else model


def model_dataset(model: SquadViT | SingleTaskModel, data: str | Path, tasks: Sequence[str], split: str | Sequence[str],
                  **kwargs):
    """``model``'s evaluation data: ``tasks`` of a split at its image size, decoded as its tasks decode them
    (``task_options``), with no augmentation (`squad.data.build_dataset`; ``kwargs`` go there too)."""
    inner = _inner(model)
    return build_dataset(data, list(tasks), split, image_size=inner.cfg.img_size, augment=False,
                         task_options=inner.cfg.task_options, **kwargs)


def evaluate_model(model: SquadViT | SingleTaskModel, tasks: Sequence[str], data: str | Path, split: str = "val",
                   batches: int = 0, batch_size: int = 8, device: str | torch.device = "cpu",
                   workers: int = 0) -> dict:
    """Metrics of a `SquadViT` (or a `SingleTaskModel`) on ``tasks`` of a split: task → metric → value."""
    inner = _inner(model)
    ds = model_dataset(inner, data, tasks, split)
    inner.to(device)
    return evaluate(inner, eval_loader(ds, batch_size, workers), list(tasks), device, batches)


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
    inner = _inner(model)
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


def evaluate_run(model: SquadViT | SingleTaskModel, data: str | Path, cfg: EvaluateConfig | None = None) -> dict:
    """Metrics and compute of a model (full or extracted, as `squad.load` returns it) on a split, under inference
    settings.

    Args:
        model: the model (its inference settings are changed in place by ``cfg.inference``: `set_inference`).
        data: dataset root.
        cfg: the split, tasks (default: every task of the model; an extracted model has one), batches (0: the whole
            split), batch size, device, loader workers, inference settings, torch.compile and the precision the
            model is cast to in place (``"bf16"`` / ``"fp32"``; default bf16 on CUDA, fp32 elsewhere:
            `squad.models.precision`) — `squad.config.tools.EvaluateConfig`; default: the whole val split as the
            model was saved.

    Returns:
        ``{"metrics": {task: {metric: value}}, "compute": compute_summary, "data": DataReport.as_dict(),
        "precision": "bf16" | "fp32"}``; under
        threshold MoD inference ``compute["mod_tokens"]`` is the share of tokens each MoD block actually processed
        and ``compute["macs_measured"]`` the MACs per image from it. ``data`` counts the images scored and the
        files the split could not use (`squad.data.accounting`; its summary line is logged too).

    Raises:
        ValueError: a task the model does not have (listing its tasks), or an inference setting the model cannot
            take.
    """
    cfg = cfg or EvaluateConfig()
    cfg.check()
    split, tasks, device = cfg.split, cfg.tasks, cfg.device
    inner = _inner(model)
    set_inference(inner, **dataclasses.asdict(cfg.inference))
    names = inner.task_names if tasks is None else [inner.task_names[i] for i in inner.task_index(list(tasks))]
    ds = model_dataset(inner, data, names, split)
    dtype = cast_model(inner, cfg.precision, device)
    if cfg.compile:
        compile_model(inner)
    usage = ExpertUsage(inner.task_names)
    counts: dict = {}
    metrics = evaluate(inner, eval_loader(ds, cfg.batch_size, cfg.workers), list(names), device, cfg.batches,
                       dtype=dtype,
                       usage=usage, counts=counts)
    usage.all_reduce()
    data_report = report(ds, split if isinstance(split, str) else "+".join(split), images=counts["images"])
    logging.getLogger("squad.data").info("%s", data_report.line())
    return {"metrics": metrics, "compute": compute_summary(inner, names, usage), "data": data_report.as_dict(),
            "precision": precision_name(dtype)}


def side_by_side(models: Mapping[str, SquadViT | SingleTaskModel], data: str | Path,
                 cfg: EvaluateConfig | None = None) -> dict:
    """Several models on the same split, each with every task it has (``cfg.tasks`` is not used).

    Args:
        models: column label → model (full or extracted, as `squad.load` returns them).
        data: dataset root.
        cfg: the evaluation's settings (`evaluate_run`).

    Returns:
        ``{"split": split, "models": {label: {task: {metric: value}}}}``; a task appears under every model that
        has it (an extracted model only has its own).
    """
    cfg = dataclasses.replace(cfg or EvaluateConfig(), tasks=None)
    return {"split": cfg.split, "models": {label: evaluate_run(model, data, cfg)["metrics"]
                                           for label, model in models.items()}}


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
