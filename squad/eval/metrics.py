"""Multi-task metrics: accumulating additive statistics across batches and ranks, and the paper's Δt.

Each task's `metric_sums` returns float64 scalars (sums and counts). `MetricAccumulator` adds them up over an
evaluation loop (`squad.eval.evaluate.evaluate` is built on it), `all_reduce_sums` sums them across data-parallel
ranks (one collective for all tasks), and `delta_t` compares final metrics with a baseline as Mod-Squad (after
Maninis et al.) defines it:

    Δt_i = mean over the task's metrics j of (−1)^{l_j} · (M_m,j − M_b,j) / M_b,j · 100 %,  Δt = mean over tasks,

with l_j = 1 when lower is better for metric j. The direction of every metric comes from its task
(`Task.higher_is_better`, read through `Task.lower_is_better_for`). By default each task contributes its primary
metric only (depth: RMSE), as in the paper's tables; `delta_t(..., metrics=...)` picks others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from squad.distributed import is_distributed
from squad.tasks import Task, canonical_name, get_task


def add_sums(total: dict[str, torch.Tensor], sums: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adds one batch's statistics into `total` (in place) and returns it."""
    for key, value in sums.items():
        v = value.detach().to(torch.float64)
        total[key] = total[key] + v.to(total[key].device) if key in total else v.clone()
    return total


def all_reduce_sums(sums: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Sums per-task statistics over all ranks (no-op without an initialised process group).

    Args:
        sums: ``{task: {stat: float64 scalar}}``; every rank must hold the same tasks and keys.

    Returns:
        The same structure with every entry summed over ranks (new tensors).
    """
    keys = [(t, k) for t in sorted(sums) for k in sorted(sums[t])]
    if not keys:
        return {}
    device = sums[keys[0][0]][keys[0][1]].device
    flat = torch.stack([sums[t][k].to(device=device, dtype=torch.float64).reshape(()) for t, k in keys])
    if is_distributed():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (t, k), v in zip(keys, flat, strict=True):
        out.setdefault(t, {})[k] = v
    return out


class MetricAccumulator:
    """Collects `metric_sums` of several tasks over an evaluation loop.

    The tasks finalise their own metrics, so pass the model's configured tasks (``model.get_task(name)``) when its
    ``task_options`` change how a task scores (e.g. edge's ``max_dist``); names give the defaults.

    Example::

        acc = MetricAccumulator([model.get_task("depth"), model.get_task("normal")])
        for batch in loader:
            for name, task in acc.specs.items():
                acc.update(name, task.metric_sums(pred[name], task.target(batch["targets"][name]),
                                                  batch["masks"][name]))
        results = acc.compute()  # all-reduced across ranks; {task: {metric: float}}
    """

    def __init__(self, tasks: Sequence[str | Task]) -> None:
        specs = [t if isinstance(t, Task) else get_task(t) for t in tasks]
        self.specs: dict[str, Task] = {t.name: t for t in specs}
        self.tasks = list(self.specs)
        self.sums: dict[str, dict[str, torch.Tensor]] = {t: {} for t in self.tasks}

    def update(self, task: str, sums: Mapping[str, torch.Tensor]) -> None:
        """Adds one batch's statistics of `task` (its name or an alias)."""
        add_sums(self.sums[task if task in self.sums else canonical_name(task)], sums)

    def compute(self, reduce: bool = True) -> dict[str, dict[str, float]]:
        """Final metrics per task; with `reduce` the statistics are first summed across ranks."""
        sums = all_reduce_sums(self.sums) if reduce else self.sums
        return {t: self.specs[t].metrics(sums[t]) for t in self.tasks if sums.get(t)}


def delta_t(results: Mapping[str, Mapping[str, float]], baseline: Mapping[str, Mapping[str, float]],
            metrics: Mapping[str, str | Sequence[str]] | None = None) -> dict[str, float]:
    """Δt of a model against a baseline, per task and averaged, in percent (higher is better).

    Args:
        results: ``{task: {metric: value}}`` of the model (task names or aliases).
        baseline: the same for the baseline (e.g. single-task models); must hold every task of `results`.
        metrics: optional ``{task: metric}`` or ``{task: [metric, ...]}`` to use instead of a task's primary
            metric; with several, the task's Δt is the mean over them. Each metric's direction is the task's
            (`Task.lower_is_better_for`): ``accuracy``, ``top5`` and ``delta1..3`` count higher as better.

    Returns:
        ``{task: Δt_i}`` for every task of `results` (canonical names) plus ``"mean"``.

    Raises:
        KeyError: a task is missing from the baseline, or a metric from either side.
        ValueError: a baseline metric is zero or not finite, an empty metric list, or no tasks.
    """
    base = {get_task(t).name: m for t, m in baseline.items()}
    chosen = {get_task(t).name: [m] if isinstance(m, str) else list(m) for t, m in (metrics or {}).items()}
    out: dict[str, float] = {}
    for name, res in results.items():
        task = get_task(name)
        if task.name not in base:
            raise KeyError(f"delta_t: task {task.name} has no baseline (baseline tasks: {sorted(base)})")
        names = chosen.get(task.name, [task.primary_metric])
        if not names:
            raise ValueError(f"delta_t: empty metric list for task {task.name}")
        out[task.name] = sum(_relative_gain(task.name, metric, res, base[task.name]) for metric in names) / len(names)
    if not out:
        raise ValueError("delta_t: no tasks in results")
    out["mean"] = sum(out.values()) / len(out)
    return out


def _relative_gain(name: str, metric: str, res: Mapping[str, float], base: Mapping[str, float]) -> float:
    """(−1)^l · (M_m − M_b) / M_b · 100 for one metric of task `name` (l = 1 when lower is better)."""
    for side, table in (("results", res), ("baseline", base)):
        if metric not in table:
            raise KeyError(f"delta_t: {side} for task {name} lack metric {metric!r} (have {sorted(table)})")
    m, b = float(res[metric]), float(base[metric])
    if b == 0 or not math.isfinite(b):
        raise ValueError(f"delta_t: baseline {metric} of task {name} is {b}; Δt needs a finite non-zero value")
    sign = -1.0 if get_task(name).lower_is_better_for(metric) else 1.0
    return sign * (m - b) / b * 100.0
