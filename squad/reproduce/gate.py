"""The learnability gate: which tasks a claim's Δt may count.

A task counts when the claim's reference model (the single-task model for Δt against STL; the dense model A-MoD adapts;
the e_c = 1 MoNE model) beats the best image-independent predictor (`squad.eval.prior`: the per-pixel mean or median
map, the global mean or median, the mean class distribution or the most frequent class — fitted on the validation images
themselves, so the predictor knows the validation buildings' prior that a training-fitted one misses, and scored on them
with squad's own metrics) by at least `GATE_GAIN` percent on every seed, and by more than the seed noise: the one-sided
95 % lower bound of the mean gain over seeds is above `GATE_GAIN` too. A model that does not is fitting the spatial
prior of the data, and Δt on that task measures how fast a model learns the prior, not what the claim is about. The
other tasks are listed apart with both numbers.

`predictors` computes the predictors of a claim's data once per output folder (cached with the data, tasks and
image size they depend on); `learnability` applies the gate to the reference model's metrics of every seed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from scipy import stats as sps

from squad.data import build_dataset
from squad.eval.prior import image_independent
from squad.reproduce.specs import Context, cached
from squad.reproduce.stats import ALPHA
from squad.reproduce.verdicts import delta
from squad.tasks import get_task

GATE_GAIN = 5.0  # percent: the reference model's least gain over the best image-independent predictor, every seed


def predictors(ctx: Context, tasks: Sequence[str]) -> dict[str, dict]:
    """The image-independent predictors of ``tasks`` on ``ctx``'s data: fitted on the validation split and scored on
    it (`squad.eval.prior.image_independent`: the strongest such predictor), cached in
    ``OUT/cache/predictors-<tasks>.json``."""
    tasks = list(tasks)
    key = {"data": str(ctx.data), "tasks": tasks, "img_size": ctx.scale.img_size, "fit": "val", "eval": "val",
           "version": 2}

    def compute() -> dict:
        val = build_dataset(ctx.data, tasks, "val", image_size=ctx.scale.img_size, augment=False)
        return image_independent(val, val, tasks)

    name = "predictors-" + "-".join(sorted(tasks)) if len(tasks) <= 4 else f"predictors-{len(tasks)}-tasks"
    return cached(ctx.cache_file(f"{name}.json"), key, compute)


def learnability(table: dict[str, dict], reference: Sequence[dict[str, dict[str, float]]],
                 tasks: Sequence[str] | None = None, threshold: float = GATE_GAIN) -> dict:
    """The gate applied to a reference model's validation metrics of every seed.

    Args:
        table: `predictors`' result (``{task: {"best", "metrics", ...}}``).
        reference: per seed, ``{task: metrics}`` of the reference model.
        tasks: the tasks to gate (default: those of ``table``).
        threshold: the least gain in percent (Δt of the reference against the predictor) on every seed, and of the
            mean gain's one-sided 95 % lower bound.

    Returns:
        ``{"threshold", "learnable": [tasks], "apart": [tasks], "tasks": {task: {"metric", "predictor",
        "predictor_value", "reference": [per seed], "gain": [per seed, %], "gain_lower", "learnable"}}}``.
    """
    tasks = list(table if tasks is None else tasks)
    rows = {}
    for t in tasks:
        spec = get_task(t)
        pred = table[t]["metrics"]
        gains = [delta({t: ref[t]}, {t: pred})["per_task"][t] if t in ref else float("nan") for ref in reference]
        ok = bool(gains) and all(g == g and g >= threshold for g in gains)  # g == g: not NaN
        lower = _lower_bound(gains) if ok else float("nan")
        ok = ok and (len(gains) < 2 or lower > threshold)
        rows[t] = {"metric": spec.primary_metric, "lower_is_better": spec.lower_is_better,
                   "predictor": table[t]["best"], "predictor_value": pred.get(spec.primary_metric),
                   "reference": [ref.get(t, {}).get(spec.primary_metric) for ref in reference], "gain": gains,
                   "gain_lower": lower, "learnable": ok}
    return {"threshold": threshold, "learnable": [t for t in tasks if rows[t]["learnable"]],
            "apart": [t for t in tasks if not rows[t]["learnable"]], "tasks": rows}


def _lower_bound(values: Sequence[float]) -> float:
    """The one-sided 95 % lower bound of the mean of ``values`` (the mean itself for one value)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean
    return mean - float(sps.t.ppf(1 - ALPHA, n - 1)) * statistics.stdev(values) / math.sqrt(n)
