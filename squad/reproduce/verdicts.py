"""Judging a claim: paired per-seed comparisons, the verdict rule written into the report, and Δt.

`compare` turns one quantity per seed on each side into ``holds`` / ``reversed`` / ``within noise`` / ``one seed``;
`precondition` records what a fair test needs; `verdict` turns a claim's comparisons and preconditions into
``reproduced`` / ``not reproduced`` / ``inconclusive`` (`RULE` says how, in the words the report prints). `delta`
is Mod-Squad's Δt per task and its mean, leaving out tasks whose baseline metric is zero (where Δt is undefined).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from squad.eval.metrics import delta_t
from squad.tasks import get_task

RULE = (
    "Each claim is split into comparisons between two quantities measured on every seed (same data, steps and "
    "widths). For a comparison 'A > B' the per-seed differences d = A − B are taken, and the noise is the largest "
    "of the sample standard deviations over seeds of d, of A and of B. The comparison **holds** when every d > 0 "
    "and their mean exceeds the noise (the ordering holds beyond the seed spread), it is **reversed** when every "
    "d < 0 and −mean exceeds the noise, and it is **within noise** otherwise. 'A ≥ B − m' (not worse than B by more "
    "than a margin m; m = 0: equal or better) takes d = A − B + m: it **holds** only when every seed's d > 0, is "
    "**reversed** when every d < 0 and −mean exceeds the noise, and is **within noise** otherwise. 'A ≤ c' for a "
    "fixed bound holds when every seed's A ≤ c and is reversed when every seed's A > c. Some claims also name "
    "preconditions of a fair test (e.g. the dense model A-MoD adapts has reached a plateau); a precondition that is "
    "not met makes the claim inconclusive whatever its comparisons say. A claim is **reproduced** when all its "
    "comparisons hold, **not reproduced** when one is reversed, and **inconclusive** otherwise — and always with "
    "fewer than 2 seeds (no spread to judge against)."
)
VERDICTS = ("reproduced", "not reproduced", "inconclusive")


def finite(values: Sequence[float]) -> list[float]:
    """The values that are numbers (not None, NaN or infinite), as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def spread(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation (NaN for one value), n and the values themselves."""
    vals = finite(values)
    return {"mean": statistics.fmean(vals) if vals else float("nan"),
            "std": statistics.stdev(vals) if len(vals) > 1 else float("nan"), "n": len(vals),
            "values": [float(v) for v in values]}


def compare(label: str, a: Sequence[float], b: Sequence[float], kind: str = "greater", margin: float = 0.0) -> dict:
    """One paired comparison over seeds (`RULE`).

    Args:
        label: what is compared, for the report.
        a, b: one value per seed each (b may be a fixed bound repeated).
        kind: ``"greater"`` (a > b), ``"not_worse"`` (a ≥ b − margin) or ``"at_most"`` (a ≤ b, a fixed bound).
        margin: the margin of ``not_worse``.

    Returns:
        ``{"label", "kind", "margin", "a", "b", "diffs", "mean", "std" (of the differences), "noise", "status"}``
        with status ``holds``, ``reversed``, ``within noise`` or ``one seed``.
    """
    pairs = [(float(x), float(y)) for x, y in zip(a, b, strict=True)
             if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))]
    if kind == "at_most":
        d = [y - x for x, y in pairs]  # bound − value: positive = within the bound
    else:
        d = [x - y + (margin if kind == "not_worse" else 0.0) for x, y in pairs]
    mean = statistics.fmean(d) if d else float("nan")
    std = statistics.stdev(d) if len(d) > 1 else float("nan")
    noise = max(std, statistics.stdev([p[0] for p in pairs]), statistics.stdev([p[1] for p in pairs])) \
        if len(d) > 1 else float("nan")
    if len(d) < 2:
        status = "one seed"
    elif kind == "at_most":
        status = "holds" if all(v >= 0 for v in d) else "reversed" if all(v < 0 for v in d) else "within noise"
    else:
        ahead = all(v > 0 for v in d) and mean > noise
        behind = all(v < 0 for v in d) and -mean > noise
        if kind == "not_worse":  # non-inferiority: every seed must be on the right side of the margin
            ahead = all(v > 0 for v in d)
        status = "holds" if ahead else "reversed" if behind else "within noise"
    return {"label": label, "kind": kind, "margin": margin, "a": [p[0] for p in pairs], "b": [p[1] for p in pairs],
            "diffs": d, "mean": mean, "std": std, "noise": noise, "status": status}


def precondition(label: str, met: bool, detail: str = "") -> dict:
    """A condition a claim's test needs to be fair (`RULE`): ``{"label", "status": "met" | "not met", "detail"}``."""
    return {"label": label, "status": "met" if met else "not met", "detail": detail}


def verdict(comparisons: Sequence[dict], preconditions: Sequence[dict] = ()) -> str:
    """``reproduced`` / ``not reproduced`` / ``inconclusive`` from the comparisons and preconditions (`RULE`)."""
    statuses = [c["status"] for c in comparisons]
    if not statuses or "one seed" in statuses or any(p["status"] != "met" for p in preconditions):
        return "inconclusive"
    if all(s == "holds" for s in statuses):
        return "reproduced"
    if "reversed" in statuses:
        return "not reproduced"
    return "inconclusive"


def delta(results: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]]) -> dict:
    """Δt (percent, higher is better) per task and its mean over the tasks where it is defined.

    A task whose baseline metric is zero or missing (e.g. an accuracy of 0 after a few tiny steps) has no Δt (NaN)
    and is left out of the mean; ``undefined`` names those tasks.
    """
    per, undefined = {}, []
    for task, metrics in results.items():
        try:
            per[task] = delta_t({task: metrics}, {task: baseline[task]})[get_task(task).name]
        except (KeyError, ValueError):
            per[task], undefined = float("nan"), [*undefined, task]
    vals = finite(per.values())
    return {"per_task": per, "mean": statistics.fmean(vals) if vals else float("nan"), "undefined": undefined}


def primary_of(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each task's primary metric."""
    return {t: m.get(get_task(t).primary_metric, float("nan")) for t, m in metrics.items() if m}
