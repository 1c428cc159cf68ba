"""The statistics behind a verdict: paired differences over seeds, a one-sided t-test with the seed variance pooled
across a claim's comparisons, 95 % bounds, and Holm's correction for the secondary comparisons.

A comparison is one quantity per seed on each side; its per-seed differences d (oriented so that d > 0 is what the
paper claims, see `squad.reproduce.verdicts.compare`) are tested against 0:

* the seed variance is pooled over the comparisons of a claim that share a unit (``pool``: Δt points, bits, seconds
  ...): ``s² = Σ (n_i − 1) s_i² / Σ (n_i − 1)`` with ``Σ (n_i − 1)`` degrees of freedom, so three seeds of several
  comparisons estimate the noise together instead of each from two degrees of freedom;
* the standard error of a comparison's mean difference is ``s / √n_i``; its one-sided 95 % bounds are
  ``mean ∓ t(0.95, df) · se``;
* the primary comparison (the first) decides the claim at α = 0.05: it **holds** when its lower bound clears 0, is
  **reversed** when its upper bound is below 0, and is **within noise** otherwise;
* the secondary comparisons are judged with Holm's step-down correction over them (α = 0.05 for the family, once
  for "holds" and once for "reversed"), so that reporting many of them does not multiply false findings;
* with 2 seeds only the direction is given (``ahead`` / ``behind``), with 1 seed nothing (``one seed``).

Under no effect (differences centred on 0, or on the margin of a non-inferiority comparison) the primary's false
"holds" and false "reversed" rates are 5 % each, whatever the noise (`simulate_null` measures it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

ALPHA = 0.05  # one-sided: the 95 % bounds
MIN_SEEDS = 3  # paired seeds a verdict needs; 2 give the direction only


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """The pooled sample standard deviation of several groups of differences and its degrees of freedom.

    Groups with fewer than 2 values add nothing. Returns ``(nan, 0)`` when no group has 2 values.
    """
    ss, df = 0.0, 0
    for g in groups:
        if len(g) > 1:
            ss += statistics.variance(g) * (len(g) - 1)
            df += len(g) - 1
    return (math.sqrt(ss / df), df) if df else (float("nan"), 0)


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


def judge_family(comparisons: list[dict], apart: list[dict] | None = None, alpha: float = ALPHA) -> list[dict]:
    """Fills in each comparison's pooled noise, bounds, p-values and status (in place; ``comparisons`` returned).

    The first of ``comparisons`` is the primary (tested at ``alpha``), the others are secondary (Holm over them);
    ``apart`` (controls reported beside) is a Holm family of its own. Each comparison needs ``diffs`` (per seed,
    oriented: > 0 is what the claim predicts) and ``pool`` (its unit): comparisons sharing a unit, in both lists,
    pool their seed variance.
    """
    apart = apart or []
    every = comparisons + apart
    pools: dict[str, list[list[float]]] = {}
    for c in every:
        pools.setdefault(c.get("pool", ""), []).append(_finite(c["diffs"]))
    pooled = {k: pooled_sd(v) for k, v in pools.items()}
    for c in every:
        d = _finite(c["diffs"])
        sd, df = pooled[c.get("pool", "")]
        c["n"] = len(d)
        c["mean"] = statistics.fmean(d) if d else float("nan")
        c["std"] = statistics.stdev(d) if len(d) > 1 else float("nan")
        c["pooled_sd"], c["df"] = sd, df
        c.update(t_bounds(c["mean"], sd, len(d), df, alpha))
    for i, c in enumerate(comparisons):
        c["role"] = "primary" if i == 0 else "secondary"
    for c in apart:
        c["role"] = "apart"
    families = [comparisons[1:], apart]
    for family in families:
        up = holm([c["p_greater"] for c in family], alpha)
        down = holm([c["p_less"] for c in family], alpha)
        for c, u, dn in zip(family, up, down, strict=True):
            c["status"] = _status(c, "holds" if u else "reversed" if dn else "within noise")
    if comparisons:
        c = comparisons[0]
        c["status"] = _status(c, "holds" if c["lower"] > 0 else "reversed" if c["upper"] < 0 else "within noise")
    return comparisons


def _status(c: dict, tested: str) -> str:
    """The tested status with ≥ `MIN_SEEDS` seeds; the direction with 2; "one seed" below."""
    if c["n"] < 2:
        return "one seed"
    if c["n"] < MIN_SEEDS:
        return "ahead" if c["mean"] > 0 else "behind" if c["mean"] < 0 else "tied"
    return tested


def simulate_null(seeds: int = 3, comparisons: int = 3, trials: int = 20000, rng_seed: int = 0,
                  sd: float = 1.0, alpha: float = ALPHA) -> dict:
    """Rates of false findings under no effect: ``trials`` claims of ``comparisons`` comparisons over ``seeds``
    seeds whose differences are Gaussian around 0 with standard deviation ``sd`` (for a non-inferiority comparison
    'A ≥ B − m', d = A − B + m: A falling short of B by exactly the margin), judged by the rule of `judge_family` (the
    same arithmetic on arrays, all trials at once; `judge_family` itself is checked against it on a sample).

    Returns the primary's rates ``holds`` and ``reversed``, the family-wise rates over the secondaries
    ``any_secondary_holds`` and ``any_secondary_reversed``, and ``trials``.
    """
    if seeds < MIN_SEEDS:
        raise ValueError(f"a verdict needs >= {MIN_SEEDS} seeds, got {seeds}")
    d = np.random.default_rng(rng_seed).normal(0.0, sd, size=(trials, comparisons, seeds))
    status = judge_arrays(d, alpha)
    return {"holds": float((status[:, 0] == 1).mean()), "reversed": float((status[:, 0] == -1).mean()),
            "any_secondary_holds": float((status[:, 1:] == 1).any(1).mean()) if comparisons > 1 else 0.0,
            "any_secondary_reversed": float((status[:, 1:] == -1).any(1).mean()) if comparisons > 1 else 0.0,
            "trials": trials}


def judge_arrays(d: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """`judge_family` for many claims at once: ``d`` [trials, comparisons, seeds] of differences sharing one pool;
    returns [trials, comparisons] of 1 (holds), −1 (reversed) or 0 (within noise). Needs ≥ `MIN_SEEDS` seeds."""
    trials, m, n = d.shape
    df = m * (n - 1)
    sd = np.sqrt(d.var(axis=2, ddof=1).mean(axis=1, keepdims=True))  # [trials, 1]: pooled over the comparisons
    t = d.mean(axis=2) / (sd / math.sqrt(n))  # [trials, m]
    p_greater, p_less = sps.t.sf(t, df), sps.t.cdf(t, df)
    status = np.zeros((trials, m), dtype=np.int8)
    status[:, 0] = np.where(p_greater[:, 0] < alpha, 1, np.where(p_less[:, 0] < alpha, -1, 0))
    if m > 1:
        status[:, 1:] = np.where(_holm_arrays(p_greater[:, 1:], alpha), 1,
                                 np.where(_holm_arrays(p_less[:, 1:], alpha), -1, 0))
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


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]
