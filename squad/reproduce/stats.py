"""The statistics behind a verdict: one paired t-test per comparison on its own per-seed differences, Holm's
correction over a claim's parts (and, apart, over its secondary comparisons), 95 % bounds, and the cross-machine
tolerance below which a difference is no finding.

A comparison is one quantity per seed on each side; its per-seed differences d (oriented so that d > 0 is what the
paper claims, see `squad.reproduce.verdicts.compare`) are tested against 0:

* every comparison is tested on its own differences: ``s`` is their sample standard deviation with ``n − 1``
  degrees of freedom (no variance is pooled across comparisons: a claim's comparisons are contrasts of shared
  per-seed series, with unequal variances, and a mean of components is tested on its own per-seed series);
* its one-sided 95 % bounds are ``mean ∓ t(0.95, n − 1) · s / √n``;
* a claim's **parts** (the co-primary comparisons that together make the paper's claim) are tested with Holm's
  step-down correction over them, once for "holds" and once for "reversed", so that the chance of naming any part
  falsely is ≤ 5 % whatever their dependence; the **secondary** comparisons are a Holm family of their own, and so
  are the controls reported apart;
* a tested "holds" or "reversed" whose mean difference is no larger than the comparison's ``tolerance`` (the spread
  the same runs show on another machine or thread count, `squad.reproduce.tolerance`) is **within tolerance**;
* with 2 seeds only the direction is given (``ahead`` / ``behind``), with 1 nothing (``one seed``); the test needs
  `TESTED_SEEDS`, a verdict `MIN_SEEDS` (`squad.reproduce.verdicts.verdict`).

`simulate_null` measures the rule's false findings on null data shaped like the report's own comparisons
(`NULL_SHAPES`: contrasts of shared series, variances 259× apart, correlated components and their mean).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as sps

ALPHA = 0.05  # one-sided: the 95 % bounds; the family-wise level of the parts' Holm correction
TESTED_SEEDS = 3  # paired seeds a test needs; 2 give the direction only
MIN_SEEDS = 5  # paired seeds a verdict needs (fewer: "too few seeds", the tested statuses shown beside)


def t_bounds(mean: float, sd: float, n: int, df: int, alpha: float = ALPHA) -> dict:
    """One-sided ``1 − alpha`` bounds of a mean difference and the p-values of both directions.

    Returns ``{"lower", "upper", "se", "t", "p_greater" (H1: the true difference > 0), "p_less"}``. A zero ``sd``
    (identical differences) gives bounds equal to the mean and p-values of 0 or 1.
    """
    if n < 1 or df < 1 or not math.isfinite(sd):
        return {"lower": float("nan"), "upper": float("nan"), "se": float("nan"), "t": float("nan"),
                "p_greater": float("nan"), "p_less": float("nan")}
    se = sd / math.sqrt(n)
    if se == 0.0:
        return {"lower": mean, "upper": mean, "se": 0.0, "t": math.copysign(math.inf, mean) if mean else 0.0,
                "p_greater": 0.0 if mean > 0 else 1.0, "p_less": 0.0 if mean < 0 else 1.0}
    q = float(sps.t.ppf(1.0 - alpha, df))
    t = mean / se
    return {"lower": mean - q * se, "upper": mean + q * se, "se": se, "t": t,
            "p_greater": float(sps.t.sf(t, df)), "p_less": float(sps.t.cdf(t, df))}


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down test: which hypotheses are rejected at family-wise level ``alpha`` (NaN: never)."""
    order = sorted(range(len(pvalues)), key=lambda i: (math.inf if not math.isfinite(pvalues[i]) else pvalues[i]))
    rejected = [False] * len(pvalues)
    m = len(pvalues)
    for rank, i in enumerate(order):
        p = pvalues[i]
        if not math.isfinite(p) or p > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def judge_family(comparisons: list[dict], apart: list[dict] | None = None, parts: int = 1,
                 alpha: float = ALPHA) -> list[dict]:
    """Fills in each comparison's test, bounds, p-values and status (in place; ``comparisons`` returned).

    The first ``parts`` of ``comparisons`` are the claim's parts (role ``part``: one Holm family), the others are
    secondary (a Holm family), ``apart`` (controls reported beside) a Holm family of its own. Each comparison needs
    ``diffs`` (per seed, oriented: > 0 is what the claim predicts) and may carry ``tolerance`` (≥ 0, its unit's
    cross-machine spread). Each is tested on its own differences (``n − 1`` degrees of freedom).
    """
    apart = apart or []
    parts = max(0, min(parts, len(comparisons)))
    for c in comparisons + apart:
        d = _finite(c["diffs"])
        c["n"] = len(d)
        c["mean"] = statistics.fmean(d) if d else float("nan")
        c["std"] = statistics.stdev(d) if len(d) > 1 else float("nan")
        c["df"] = len(d) - 1
        c.update(t_bounds(c["mean"], c["std"], len(d), c["df"], alpha))
    for i, c in enumerate(comparisons):
        c["role"] = "part" if i < parts else "secondary"
    for c in apart:
        c["role"] = "apart"
    for family in (comparisons[:parts], comparisons[parts:], apart):
        up = holm([c["p_greater"] for c in family], alpha)
        down = holm([c["p_less"] for c in family], alpha)
        for c, u, dn in zip(family, up, down, strict=True):
            tested = "holds" if u else "reversed" if dn else "within noise"
            if tested != "within noise" and abs(c["mean"]) <= float(c.get("tolerance") or 0.0):
                tested = "within tolerance"
            c["status"] = _status(c, tested)
    return comparisons


def _status(c: dict, tested: str) -> str:
    """The tested status with ≥ `TESTED_SEEDS` seeds; the direction with 2; "one seed" below."""
    if c["n"] < 2:
        return "one seed"
    if c["n"] < TESTED_SEEDS:
        return "ahead" if c["mean"] > 0 else "behind" if c["mean"] < 0 else "tied"
    return tested


# ------------------------------------------------------------------------------------------------ simulation
def judge_arrays(d: np.ndarray, parts: int = 1, alpha: float = ALPHA) -> np.ndarray:
    """`judge_family` for many claims at once: ``d`` [trials, comparisons, seeds] (the first ``parts`` comparisons
    are the parts, the rest secondary); returns [trials, comparisons] of 1 (holds), −1 (reversed) or 0 (within
    noise). Needs ≥ `TESTED_SEEDS` seeds; no tolerance."""
    trials, m, n = d.shape
    sd = d.std(axis=2, ddof=1)  # [trials, m]: each comparison's own noise
    with np.errstate(divide="ignore", invalid="ignore"):
        t = d.mean(axis=2) / (sd / math.sqrt(n))
    p_greater, p_less = sps.t.sf(t, n - 1), sps.t.cdf(t, n - 1)
    status = np.zeros((trials, m), dtype=np.int8)
    for lo, hi in ((0, parts), (parts, m)):
        if hi > lo:
            status[:, lo:hi] = np.where(_holm_arrays(p_greater[:, lo:hi], alpha), 1,
                                        np.where(_holm_arrays(p_less[:, lo:hi], alpha), -1, 0))
    return status


def _holm_arrays(p: np.ndarray, alpha: float) -> np.ndarray:
    """`holm` on every row of ``p`` [trials, m]."""
    m = p.shape[1]
    order = np.argsort(p, axis=1)
    ranked = np.take_along_axis(p, order, axis=1)
    passes = np.cumprod(ranked <= alpha / (m - np.arange(m)), axis=1).astype(bool)  # step-down: stop at the first miss
    out = np.zeros_like(passes)
    np.put_along_axis(out, order, passes, axis=1)
    return out


def _correlated(rng: np.random.Generator, shape: tuple[int, int, int], sds: Sequence[float], rho: float) -> np.ndarray:
    """Gaussian series [trials, k, seeds] with standard deviations ``sds`` and correlation ``rho`` between them."""
    trials, k, n = shape
    common = rng.normal(size=(trials, 1, n))
    own = rng.normal(size=(trials, k, n))
    return (math.sqrt(rho) * common + math.sqrt(1 - rho) * own) * np.asarray(sds)[None, :, None]


def _table2(rng: np.random.Generator, trials: int, n: int) -> tuple[np.ndarray, int]:
    """modsquad-table2: Δt of MTL, M3ViT-like and Mod-Squad per seed share the seed's STL baseline (a common
    component) and differ in noise (the cpu report's seed sds 2.2-4.1); parts: Mod-Squad > MTL, MTL > 0,
    Mod-Squad > 0; secondary: Mod-Squad > M3ViT-like, M3ViT-like > MTL (contrasts of the same three series)."""
    mtl, m3vit, msq = np.moveaxis(_correlated(rng, (trials, 3, n), (4.1, 3.0, 2.2), 0.6), 1, 0)
    return np.stack([msq - mtl, mtl, msq, msq - m3vit, m3vit - mtl], axis=1), 3


def _amod(rng: np.random.Generator, trials: int, n: int) -> tuple[np.ndarray, int]:
    """amod-table3: two parts whose variances are 259× apart (the cpu report's Bartlett p = 0.01)."""
    return rng.normal(size=(trials, 2, n)) * np.array([1.0, math.sqrt(259.0)])[None, :, None], 2


def _mone(rng: np.random.Generator, trials: int, n: int) -> tuple[np.ndarray, int]:
    """mone-budget: four per-budget gaps, correlated (one adaptive model in all of them) with sds 0.17-1.77; parts:
    their mean (tested on its own per-seed series) and the forward time falling with e_c; secondary: each gap."""
    gaps = _correlated(rng, (trials, 4, n), (0.17, 0.6, 1.1, 1.77), 0.8)
    time = rng.normal(size=(trials, 1, n)) * 0.003
    return np.concatenate([gaps.mean(axis=1, keepdims=True), time, gaps], axis=1), 2


def _pruning(rng: np.random.Generator, trials: int, n: int) -> tuple[np.ndarray, int]:
    """pruning: Δt not worse than the full model's by the margin (null: exactly the margin short), the parameter
    share at its bound, at θ = 0.01 and at the θ that keeps ≤ 60 % (correlated Δt: the same full model)."""
    dt = _correlated(rng, (trials, 2, n), (1.5, 3.0), 0.5)
    share = rng.normal(size=(trials, 2, n)) * np.array([0.002, 0.05])[None, :, None]
    return np.concatenate([dt[:, :1], share[:, :1], dt[:, 1:], share[:, 1:]], axis=1), 4


NULL_SHAPES: dict[str, Callable[[np.random.Generator, int, int], tuple[np.ndarray, int]]] = {
    "table2": _table2, "amod": _amod, "mone": _mone, "pruning": _pruning}


def simulate_null(shape: str = "table2", seeds: int = MIN_SEEDS, trials: int = 20000, rng_seed: int = 0,
                  true_parts: int = 0, alpha: float = ALPHA) -> dict:
    """Rates of false findings under no effect on null data shaped like one of the report's claims
    (`NULL_SHAPES`), judged by the rule of `judge_family` (the same arithmetic on arrays, all trials at once).

    Returns the verdict-level rates ``reproduced`` (every part holds), ``any_part_holds`` (a part named as holding:
    "partly reproduced"), ``any_part_reversed`` (a part named as reversed), the secondary family's
    ``any_secondary_holds`` and ``any_secondary_reversed``, the first part's ``holds`` and ``reversed``, and
    ``trials``. ``true_parts``: the first of the parts carry a large true effect (ten standard errors), so that
    ``reproduced`` is the rate of a false conjunction when only the remaining parts are null.
    """
    if seeds < TESTED_SEEDS:
        raise ValueError(f"a test needs >= {TESTED_SEEDS} seeds, got {seeds}")
    d, parts = NULL_SHAPES[shape](np.random.default_rng(rng_seed), trials, seeds)
    if true_parts:
        k = min(true_parts, parts)
        d[:, :k] += 10.0 * d[:, :k].std(axis=(0, 2), keepdims=True)
    status = judge_arrays(d, parts, alpha)
    p, s = status[:, :parts], status[:, parts:]
    return {"reproduced": float((p == 1).all(1).mean()), "any_part_holds": float((p == 1).any(1).mean()),
            "any_part_reversed": float((p == -1).any(1).mean()),
            "any_secondary_holds": float((s == 1).any(1).mean()) if s.shape[1] else 0.0,
            "any_secondary_reversed": float((s == -1).any(1).mean()) if s.shape[1] else 0.0,
            "holds": float((p[:, 0] == 1).mean()), "reversed": float((p[:, 0] == -1).mean()), "trials": trials}


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]
