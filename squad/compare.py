"""The library side of tools/evaluate.py: metrics of saved models (full or extracted) on a split, side by side,
and Δt against a baseline results file (e.g. single-task runs).

    results = evaluate_file("runs/demo", "data/synthetic", "val")
    table = side_by_side({"full": "runs/demo", "depth θ=0.01": "runs/demo/depth.pt"}, "data/synthetic")
    dt = delta_against(results, load_baseline(["runs/stl_depth/eval.json", "runs/stl_normal/eval.json"]))
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from squad.data import build_dataset
from squad.evaluation import eval_loader, evaluate
from squad.loading import load_any
from squad.metrics import delta_t
from squad.tasks import get_task


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
    model, kind = load_any(path)
    inner = model.model if kind == "extracted" else model
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
    """A text table: one row per (task, metric), one column per model."""
    labels = list(columns)
    tasks = list(dict.fromkeys(t for col in columns.values() for t in col))
    width = max(12, *(len(label) + 2 for label in labels))
    lines = [f"{'task':<20}{'metric':<12}" + "".join(f"{label:>{width}}" for label in labels)]
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
            arrow = ("↓" if spec.lower_is_better else "↑") if metric == spec.primary_metric else " "
            lines.append(f"{task:<20}{metric + ' ' + arrow:<12}" + "".join(cells))
    return "\n".join(lines)
