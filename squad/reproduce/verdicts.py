"""Judging a claim: paired per-seed comparisons, their test (`squad.reproduce.stats`), the verdict rule written into
the report, and Δt.

`compare` turns one quantity per seed on each side into the per-seed differences the claim predicts to be positive;
`judge` tests a claim's comparisons (its parts first, the rest secondary, those reported apart a family of their own);
`precondition` records what a fair test needs; `verdict` turns the parts, the preconditions and the claim's standing
(untestable, plumbing only) into one word (`VERDICTS`). `RULE` says all this
in the words the report prints. `delta` is Mod-Squad's Δt per task and its mean over the tasks it is asked for (the
learnable ones, `squad.reproduce.gate`), leaving out tasks whose baseline metric is zero (where Δt is undefined).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from squad.eval.metrics import delta_t
from squad.reproduce.stats import ALPHA, MIN_SEEDS, TESTED_SEEDS, judge_family
from squad.tasks import get_task

RULE = (
    "Each claim is split into comparisons between two quantities measured on every seed (same data, steps and "
    "widths), each turned into per-seed differences d that the paper predicts to be positive: 'A > B' takes "
    "d = A − B, 'A ≥ B − m' (not worse than B by more than a margin m) takes d = A − B + m, 'A ≤ c' for a fixed "
    "bound takes d = c − A. Every comparison is tested on its own differences (a one-sided paired t-test with n − 1 "
    "degrees of freedom: no seed variance is pooled across comparisons, and a mean of components is tested on its "
    "own per-seed series); its 95 % bounds are mean ∓ t(0.95, n − 1) · s / √n. A claim declares its **parts**, the "
    "co-primary comparisons that together make what the paper says; they are judged with Holm's correction over "
    "them (once for 'holds', once for 'reversed'), so that any part is named falsely ≤ 5 % of the time. A part "
    "**holds**, is **reversed**, is **within noise**, or is **within tolerance** (tested, but its mean difference is "
    "no larger than the spread the same runs show under another thread count or machine: no finding). The claim is "
    "**reproduced** when every part holds, **partly reproduced** when some part holds and another does not (each "
    "named with its status), **not reproduced** when no part holds and one is reversed, and **inconclusive** when "
    "none holds or reverses. The other comparisons are **secondary** (a Holm family of their own, and the controls "
    "reported apart another): shown, not in the verdict. A verdict needs ≥ "
    f"{MIN_SEEDS} paired seeds; with {TESTED_SEEDS}-{MIN_SEEDS - 1} the parts are tested and shown but the claim is "
    "**too few seeds**; with 2 the report gives the **direction only** (ahead / behind), with 1 nothing. Δt counts "
    "only the tasks whose reference model beats the best image-independent predictor fitted on the validation "
    "images themselves by ≥ 5 % on every seed and by more than the seed noise on the mean (the learnability gate); "
    "the other tasks are listed apart with both numbers. A precondition of a fair test that is not met makes the "
    "claim **inconclusive**; a claim whose test cannot run at this scale is **untestable**; on synthetic stand-in "
    "data (PASCAL-Context) or at the plumbing scale (tiny) it is **plumbing only** (the numbers are shown, no verdict "
    f"is given). Under no effect, on null data shaped like this report's own comparisons (contrasts of shared "
    f"series, variances 259× apart, correlated components and their mean), the rule names a part falsely as holding "
    f"or as reversed ≤ {ALPHA:.0%} of the time each (tests/test_reproduce.py simulates it)."
)
VERDICTS = ("reproduced", "partly reproduced", "not reproduced", "inconclusive", "too few seeds", "direction only",
            "untestable", "plumbing only")
STATUSES = ("holds", "reversed", "within noise", "within tolerance", "ahead", "behind", "tied", "one seed")
KINDS = ("greater", "not_worse", "at_most")


def finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (not None, NaN or infinite), as floats."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def spread(values: Sequence[float | None]) -> dict:
    """Mean, sample standard deviation (NaN for one value), n and the values themselves."""
    vals = finite(values)
    return {"mean": statistics.fmean(vals) if vals else float("nan"),
            "std": statistics.stdev(vals) if len(vals) > 1 else float("nan"), "n": len(vals),
            "values": [float(v) if v is not None else float("nan") for v in values]}


def compare(label: str, a: Sequence[float | None], b: Sequence[float | None], kind: str = "greater",
            margin: float = 0.0, pool: str = "Δt") -> dict:
    """One paired comparison over seeds, not yet judged (`judge` tests it with the claim's others).

    Args:
        label: what is compared, for the report.
        a, b: one value per seed each (b may be a fixed bound repeated).
        kind: ``"greater"`` (a > b), ``"not_worse"`` (a ≥ b − margin) or ``"at_most"`` (a ≤ b, a fixed bound).
        margin: the margin of ``not_worse``.
        pool: its unit: comparisons of a claim with the same unit pool their seed variance.

    Returns:
        ``{"label", "kind", "margin", "pool", "a", "b", "diffs"}`` (seeds where either side is missing are left
        out); `judge` adds the test's figures and ``status``.

    Raises:
        ValueError: an unknown kind, or ``a`` and ``b`` of different lengths.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown comparison kind {kind!r}; kinds: {', '.join(KINDS)}")
    if len(a) != len(b):
        raise ValueError(f"{label}: {len(a)} values against {len(b)} (one per seed on each side)")
    pairs = [(float(x), float(y)) for x, y in zip(a, b, strict=True)
             if x is not None and y is not None and math.isfinite(float(x)) and math.isfinite(float(y))]
    if kind == "at_most":
        d = [y - x for x, y in pairs]  # bound − value: positive = within the bound
    else:
        d = [x - y + (margin if kind == "not_worse" else 0.0) for x, y in pairs]
    return {"label": label, "kind": kind, "margin": margin, "pool": pool, "a": [p[0] for p in pairs],
            "b": [p[1] for p in pairs], "diffs": d}


def judge(comparisons: list[dict], apart: Sequence[dict] = (), parts: int = 1,
          tolerance: dict[str, float] | None = None) -> tuple[list[dict], list[dict]]:
    """Tests a claim's comparisons (the first ``parts`` are its parts, the rest secondary) and those reported apart,
    each on its own differences (`squad.reproduce.stats.judge_family`); ``tolerance`` (unit → cross-machine spread,
    `squad.reproduce.tolerance`) sets each comparison's tolerance by its ``pool``. Fills them in and returns them."""
    for c in [*comparisons, *apart]:
        if tolerance and c.get("pool") in tolerance:
            c["tolerance"] = float(tolerance[c["pool"]])
    judge_family(list(comparisons), list(apart), parts)
    return list(comparisons), list(apart)


def precondition(label: str, met: bool, detail: str = "") -> dict:
    """A condition a claim's test needs to be fair (`RULE`): ``{"label", "status": "met" | "not met", "detail"}``."""
    return {"label": label, "status": "met" if met else "not met", "detail": detail}


def parts_of(comparisons: Sequence[dict]) -> list[dict]:
    """A judged claim's parts (role ``part``; a claim judged before parts existed: its first comparison)."""
    parts = [c for c in comparisons if c.get("role") == "part"]
    return parts or list(comparisons[:1])


def verdict(comparisons: Sequence[dict], preconditions: Sequence[dict] = (), *, untestable: str | None = None,
            plumbing: bool = False, min_seeds: int = MIN_SEEDS) -> str:
    """One of `VERDICTS` from the judged parts, the preconditions and the claim's standing (`RULE`): ``plumbing``
    (synthetic stand-in data, or the tiny scale) gives "plumbing only", ``untestable`` (the reason) "untestable";
    parts on fewer than ``min_seeds`` seeds give "too few seeds" (`provisional` says what they would give)."""
    if plumbing:
        return "plumbing only"
    if untestable:
        return "untestable"
    if not comparisons or any(p["status"] != "met" for p in preconditions):
        return "inconclusive"
    parts = parts_of(comparisons)
    for c in parts:
        if "status" not in c:
            raise ValueError(f"comparison {c['label']!r} is not judged yet (squad.reproduce.verdicts.judge)")
    seeds = min(c.get("n", 0) for c in parts)
    if seeds < 2:
        return "inconclusive"
    if seeds < TESTED_SEEDS:
        return "direction only"
    if seeds < min_seeds:
        return "too few seeds"
    status = [c["status"] for c in parts]
    if all(s == "holds" for s in status):
        return "reproduced"
    if "holds" in status:
        return "partly reproduced"
    return "not reproduced" if "reversed" in status else "inconclusive"


def provisional(comparisons: Sequence[dict], preconditions: Sequence[dict] = ()) -> str:
    """What `verdict` would say with the seeds there are (≥ `TESTED_SEEDS`), for a claim with too few for one."""
    return verdict(comparisons, preconditions, min_seeds=TESTED_SEEDS)


def parts_summary(comparisons: Sequence[dict]) -> str:
    """The parts that did not hold, each with its status (``""`` when every part holds)."""
    return "; ".join(f"{c['label']}: {c.get('status', '?')}" for c in parts_of(comparisons)
                     if c.get("status") != "holds")


def delta(results: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]],
          tasks: Sequence[str] | None = None) -> dict:
    """Δt (percent, higher is better) per task and its mean over ``tasks`` (default: every task of ``results``)
    where it is defined.

    A task whose baseline metric is zero or missing (e.g. an accuracy of 0 after a few tiny steps) has no Δt (NaN)
    and is left out of the mean; ``undefined`` names those tasks.
    """
    per, undefined = {}, []
    for task, metrics in results.items():
        try:
            per[task] = delta_t({task: metrics}, {task: baseline[task]})[get_task(task).name]
        except (KeyError, ValueError):
            per[task], undefined = float("nan"), [*undefined, task]
    counted = per if tasks is None else {t: per.get(t, float("nan")) for t in tasks}
    vals = finite(counted.values())
    return {"per_task": per, "mean": statistics.fmean(vals) if vals else float("nan"), "undefined": undefined}


def primary_of(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each task's primary metric."""
    return {t: m.get(get_task(t).primary_metric, float("nan")) for t, m in metrics.items() if m}
