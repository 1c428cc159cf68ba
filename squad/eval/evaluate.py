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

Example::

    results = evaluate_file("runs/demo", "data/synthetic", "val")
    table = side_by_side({"full": "runs/demo", "depth θ=0.01": "runs/demo/depth.pt"}, "data/synthetic")
    dt = delta_against(results, load_baseline(["runs/stl_depth/eval.json", "runs/stl_normal/eval.json"]))
    print(format_results({"full": results}))
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from squad.analysis.usage import ExpertUsage
from squad.data import build_dataset, collate
from squad.data.samplers import ShardSampler
from squad.eval.metrics import MetricAccumulator, delta_t
from squad.io import load
from squad.models.single_task import SingleTaskModel
from squad.tasks import get_task

# --------------------------------------------------------------------------------------------- running a model


def eval_loader(dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """An in-order loader over this rank's shard of ``dataset``."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), rank, world),
                      num_workers=workers, collate_fn=collate)


@torch.no_grad()
def evaluate(model, loader, tasks: Sequence[str], device: torch.device | str = "cpu", max_batches: int = 0,
             dtype: torch.dtype | None = None, usage: ExpertUsage | None = None) -> dict[str, dict[str, float]]:
    """Every task's metrics over ``loader`` (all ranks' shares combined).

    Args:
        model: a `SquadViT` (or anything with the same call signature).
        loader: batches from `squad.data.collate`.
        tasks: the tasks to score (all run in one fused pass per batch).
        device: where to run.
        max_batches: stop after this many batches per rank (0 = all).
        dtype: input dtype (e.g. bfloat16 for a bf16 model).
        usage: when given, the routing statistics of the pass are added to it (calibration).

    Returns:
        task → metric → value (in the units the task's `decode` gives), keyed by the names in ``tasks``; a task
        that saw no batch maps to ``{}``.
    """
    was_training = model.training
    model.eval()
    acc = MetricAccumulator(list(tasks))
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
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
    return {t: final.get(get_task(t).name, {}) for t in tasks}


# ------------------------------------------------------------------------------------------------ saved models


def evaluate_model(model, tasks: Sequence[str], data: str | Path, split: str = "val", batches: int = 0,
                   batch_size: int = 8, device: str | torch.device = "cpu", workers: int = 0) -> dict:
    """Metrics of an in-memory `SquadViT` (or a `SingleTaskModel`) on ``tasks`` of a split: task → metric → value."""
    inner = getattr(model, "model", model)
    ds = build_dataset(data, list(tasks), split, image_size=inner.cfg.img_size, augment=False)
    inner.to(device)
    return evaluate(inner, eval_loader(ds, batch_size, workers), list(tasks), device, batches)


def evaluate_file(path: str | Path, data: str | Path, split: str = "val", tasks: Sequence[str] | None = None,
                  batches: int = 0, batch_size: int = 8, device: str | torch.device = "cpu",
                  workers: int = 0) -> dict[str, dict[str, float]]:
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

    Raises:
        ValueError: a task the model does not have (listing its tasks), or not a squad model file.
    """
    model = load(path)
    inner = model.model if isinstance(model, SingleTaskModel) else model
    names = inner.task_names if tasks is None else [inner.task_names[i] for i in inner.task_index(list(tasks))]
    return evaluate_model(inner, names, data, split, batches, batch_size, device, workers)


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
