"""What the claims' measurements share: the single-task baselines of a seed, the gate against them, model sizes,
Δt curves over training steps with their 95 % intervals, and the plateau of a validation curve.

Every run validates at the same steps (``eval_every`` from the scale's ``curve_evals``), so a method's validation
at step s is set against the single-task models' validations at the same step of the same seed: `delta_curve`.
`curve_band` summarises the curves of several seeds per step: mean and two-sided 95 % t-interval over seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from scipy import stats as sps

from squad.analysis.flops import profile
from squad.io import load_model
from squad.reproduce.gate import learnability, predictors
from squad.reproduce.runs import RunSpec, final_metrics, metrics_history
from squad.reproduce.specs import Context, stl_specs
from squad.reproduce.verdicts import delta, finite
from squad.tasks import get_task

PLATEAU_GAIN = 5.0  # percent: a validation curve is at a plateau when its last evaluation gains less than this


def baseline(ctx: Context, seed: int) -> dict[str, dict[str, float]]:
    """Every task's STL metrics for a seed (training the STL runs if needed)."""
    return {spec.tasks[0]: final_metrics(ctx.runner.ensure(spec))[spec.tasks[0]] for spec in stl_specs(ctx, seed)}


def baseline_histories(ctx: Context, seed: int) -> dict[str, list[tuple[int, dict]]]:
    """Every task's STL validation history for a seed: ``{task: [(step, {task: metrics})]}``."""
    return {spec.tasks[0]: metrics_history(ctx.runner.ensure(spec)) for spec in stl_specs(ctx, seed)}


def stl_gate(ctx: Context, bases: Sequence[dict[str, dict[str, float]]]) -> dict:
    """The learnability gate of ``ctx``'s tasks against the STL models of every seed (`squad.reproduce.gate`)."""
    return learnability(predictors(ctx, ctx.tasks), bases, ctx.tasks)


def size(run_dir: Path, tasks: Sequence[str]) -> dict:
    """Parameters and MACs per image and task of a run's model (`squad.profile`)."""
    prof = profile(load_model(run_dir), tasks)
    return {"params": prof["params"], "macs": statistics.fmean(prof["tasks"][t]["macs"] for t in tasks)}


def stl_summary(ctx: Context, specs: Sequence[RunSpec]) -> dict:
    """The size and cost of a set of single-task models taken together (one STL run per task, one seed): parameters
    summed (and per model), MACs per image and task averaged, step time and CPU seconds summed (one step of each),
    peak memory the largest."""
    sizes = [size(ctx.runner.path(s), s.tasks) for s in specs]
    costs = [ctx.cost(s) for s in specs]
    peaks = finite([c["peak_mib"] for c in costs])
    return {"params": sum(s["params"] for s in sizes), "params_each": statistics.fmean(s["params"] for s in sizes),
            "macs": statistics.fmean(s["macs"] for s in sizes), "step_s": sum(c["step_s"] for c in costs),
            "cpu_s": sum(c.get("cpu_s", float("nan")) for c in costs), "peak_mib": max(peaks) if peaks else None}


def budget(ctx: Context) -> str:
    return f"{ctx.scale.steps} steps of {ctx.scale.batch} images per run"


def delta_curve(history: list[tuple[int, dict]], bases: dict[str, list[tuple[int, dict]]] | list[tuple[int, dict]],
                tasks: Sequence[str]) -> list[tuple[int, float]]:
    """Δt over ``tasks`` at every step where both sides validated.

    Args:
        history: the method's ``[(step, {task: metrics})]``.
        bases: per task the baseline's history (STL: one model per task), or one history holding every task.
        tasks: the tasks Δt counts (the learnable ones).
    """
    def at(h: list[tuple[int, dict]]) -> dict[int, dict]:
        return dict(h)

    per_task = {t: at(bases[t]) for t in tasks} if isinstance(bases, dict) else {t: at(bases) for t in tasks}
    mine = at(history)
    out = []
    for step, metrics in sorted(mine.items()):
        if all(step in per_task[t] and t in per_task[t][step] for t in tasks) and all(t in metrics for t in tasks):
            base = {t: per_task[t][step][t] for t in tasks}
            out.append((step, delta({t: metrics[t] for t in tasks}, base, tasks)["mean"]))
    return out


def curve_band(curves: Sequence[list[tuple[int, float]]], level: float = 0.95) -> list[dict]:
    """Per step the mean over seeds and its two-sided ``level`` t-interval (NaN bounds with one seed)."""
    steps = sorted({s for c in curves for s, _ in c})
    out = []
    for step in steps:
        vals = finite(dict(c).get(step) for c in curves)
        n = len(vals)
        mean = statistics.fmean(vals) if vals else float("nan")
        half = float("nan")
        if n > 1:
            half = float(sps.t.ppf(0.5 + level / 2, n - 1)) * statistics.stdev(vals) / math.sqrt(n)
        out.append({"step": step, "mean": mean, "lower": mean - half, "upper": mean + half, "n": n})
    return out


def plateau(history: list[tuple[int, dict]], tasks: Sequence[str], threshold: float = PLATEAU_GAIN) -> dict:
    """Whether a run's validation curve has flattened: the gain (%, each task oriented by its primary metric, mean
    over ``tasks``) of its last validation over the one before; a plateau when it is below ``threshold``.

    Returns:
        ``{"gain", "steps": (before, last), "at_plateau", "points"}`` (no plateau with fewer than 2 validations).
    """
    if len(history) < 2:
        return {"gain": float("nan"), "steps": None, "at_plateau": False, "points": len(history)}
    (s0, before), (s1, last) = history[-2], history[-1]
    gain = delta({t: last[t] for t in tasks if t in last}, {t: before[t] for t in tasks if t in before}, tasks)["mean"]
    return {"gain": gain, "steps": (s0, s1), "at_plateau": bool(math.isfinite(gain) and gain < threshold),
            "points": len(history), "before": {t: before.get(t, {}).get(get_task(t).primary_metric) for t in tasks},
            "last": {t: last.get(t, {}).get(get_task(t).primary_metric) for t in tasks}}
