"""The learnability gate: which tasks a claim's Δt may count.

A task counts when the claim's reference model (the single-task model for Δt against STL; the dense model A-MoD
adapts; the e_c = 1 MoNE model) beats the best image-independent predictor (`squad.eval.prior`: the training
split's per-pixel mean or median map, its global mean or median, the mean class distribution or the most frequent
class — whichever scores best on the same validation images with squad's own metrics) by at least `GATE_GAIN`
percent on every seed. A model that does not is fitting the spatial prior of the data, and Δt on that task measures
how fast a model learns the prior, not what the claim is about. The other tasks are listed apart with both numbers.

`predictors` computes the predictors of a claim's data once per output folder (cached with the data, tasks and
image size they depend on); `learnability` applies the gate to the reference model's metrics of every seed.
"""

from __future__ import annotations

from collections.abc import Sequence

from squad.data import build_dataset
from squad.eval.prior import image_independent
from squad.reproduce.specs import Context, cached
from squad.reproduce.verdicts import delta
from squad.tasks import get_task

GATE_GAIN = 5.0  # percent: the reference model's least gain over the best image-independent predictor, every seed


def predictors(ctx: Context, tasks: Sequence[str]) -> dict[str, dict]:
    """The image-independent predictors of ``tasks`` on ``ctx``'s data: fitted on the training split, scored on the
    validation split (`squad.eval.prior.image_independent`), cached in ``OUT/cache/predictors-<tasks>.json``."""
    tasks = list(tasks)
    key = {"data": str(ctx.data), "tasks": tasks, "img_size": ctx.scale.img_size, "fit": "train", "eval": "val",
           "version": 1}

    def compute() -> dict:
        common = {"image_size": ctx.scale.img_size, "augment": False}
        train = build_dataset(ctx.data, tasks, "train", **common)
        val = build_dataset(ctx.data, tasks, "val", **common)
        return image_independent(train, val, tasks)

    name = "predictors-" + "-".join(sorted(tasks)) if len(tasks) <= 4 else f"predictors-{len(tasks)}-tasks"
    return cached(ctx.cache_file(f"{name}.json"), key, compute)


def learnability(table: dict[str, dict], reference: Sequence[dict[str, dict[str, float]]],
                 tasks: Sequence[str] | None = None, threshold: float = GATE_GAIN) -> dict:
    """The gate applied to a reference model's validation metrics of every seed.

    Args:
        table: `predictors`' result (``{task: {"best", "metrics", ...}}``).
        reference: per seed, ``{task: metrics}`` of the reference model.
        tasks: the tasks to gate (default: those of ``table``).
        threshold: the least gain in percent (Δt of the reference against the predictor) on every seed.

    Returns:
        ``{"threshold", "learnable": [tasks], "apart": [tasks], "tasks": {task: {"metric", "predictor",
        "predictor_value", "reference": [per seed], "gain": [per seed, %], "learnable"}}}``.
    """
    tasks = list(table if tasks is None else tasks)
    rows = {}
    for t in tasks:
        spec = get_task(t)
        pred = table[t]["metrics"]
        gains = [delta({t: ref[t]}, {t: pred})["per_task"][t] if t in ref else float("nan") for ref in reference]
        ok = bool(gains) and all(g == g and g >= threshold for g in gains)  # g == g: not NaN
        rows[t] = {"metric": spec.primary_metric, "lower_is_better": spec.lower_is_better,
                   "predictor": table[t]["best"], "predictor_value": pred.get(spec.primary_metric),
                   "reference": [ref.get(t, {}).get(spec.primary_metric) for ref in reference], "gain": gains,
                   "learnable": ok}
    return {"threshold": threshold, "learnable": [t for t in tasks if rows[t]["learnable"]],
            "apart": [t for t in tasks if not rows[t]["learnable"]], "tasks": rows}
