"""``table2-curve``: whether Mod-Squad Table 2's gap to single-task models closes with training, and how fast.

At small budgets both multi-task models sit below STL on this data; the paper measures at convergence. So the same
families (STL per task, MTL, Mod-Squad) are trained to each budget of the scale's ``curve_steps`` (every budget a run of
its own with its own warm-up and cosine schedule, not a point along a longer run; the scale's own ``steps`` reuses
table2's runs), and Δt against the STL models of the same budget and seed is measured over the learnable tasks (the gate
of the scale's own budget, else of the largest). The rate is the per-seed least-squares slope of Δt against log2(steps):
Δt points per doubling of the training. Parts: the slope is positive for Mod-Squad and for MTL (the gap closes);
secondary: Δt at the largest budget above 0, and Mod-Squad above MTL there. Where a slope is positive the report
extrapolates the budget at which Δt would reach 0 (a straight line in log2(steps): a rough guide, not a finding).
"""

from __future__ import annotations

import math
import statistics

from squad.reproduce.measure import stl_gate
from squad.reproduce.runs import FAMILIES, RunSpec, final_metrics
from squad.reproduce.specs import Context, method_spec, stl_spec
from squad.reproduce.verdicts import compare, delta, judge, spread

CURVE_FAMILIES = ("mtl", "modsquad")


def _at(spec: RunSpec, steps: int, own: int) -> RunSpec:
    """``spec`` trained to ``steps`` (the scale's own budget: the run itself, shared with table2)."""
    if steps == own:
        return spec
    return RunSpec(f"{spec.name.rsplit('-s', 1)[0]}-n{steps}-s{spec.seed}", spec.family, spec.seed, spec.tasks,
                   steps)


def curve_specs(ctx: Context) -> list[RunSpec]:
    own = ctx.scale.steps
    return [_at(s, n, own) for seed in ctx.seeds for n in ctx.scale.curve_steps
            for s in [*(stl_spec(ctx, t, seed) for t in ctx.tasks),
                      *(method_spec(ctx, f, seed) for f in CURVE_FAMILIES)]]


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of Δt against log2(steps) (Δt points per doubling); NaN with fewer than 2 points."""
    pts = [(math.log2(s), v) for s, v in points if math.isfinite(v)]
    if len(pts) < 2:
        return float("nan")
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")


def measure_curve(ctx: Context) -> dict:
    """Δt of MTL and Mod-Squad against STL at every budget of ``curve_steps``, its rate per doubling."""
    own = ctx.scale.steps
    budgets = sorted(ctx.scale.curve_steps)
    if not budgets:
        return {"tasks": ctx.tasks, "budgets": [], "comparisons": [], "untestable": "this scale plans no budgets "
                "for the learning curve (``curve_steps``)", "budget": "–"}
    bases = {n: [{t: final_metrics(ctx.runner.ensure(_at(stl_spec(ctx, t, seed), n, own)))[t] for t in ctx.tasks}
                 for seed in ctx.seeds] for n in budgets}
    gate = stl_gate(ctx, bases[own if own in bases else budgets[-1]])  # the tasks counted at every budget
    rows: dict[str, dict[int, list[float]]] = {f: {n: [] for n in budgets} for f in CURVE_FAMILIES}
    for n in budgets:
        for f in CURVE_FAMILIES:
            for seed, base in zip(ctx.seeds, bases[n], strict=True):
                metrics = final_metrics(ctx.runner.ensure(_at(method_spec(ctx, f, seed), n, own)))
                rows[f][n].append(delta(metrics, base, gate["learnable"])["mean"])
    curves = {f: [[(n, rows[f][n][i]) for n in budgets] for i in range(len(ctx.seeds))] for f in CURVE_FAMILIES}
    slopes = {f: [slope(c) for c in curves[f]] for f in CURVE_FAMILIES}
    zero = [0.0] * len(ctx.seeds)
    last = budgets[-1]
    comparisons = [compare(f"rate: Δt({FAMILIES[f].label}) per doubling of the steps > 0 (the gap to STL closes)",
                           slopes[f], zero) for f in ("modsquad", "mtl")]
    comparisons += [compare(f"at {last:,} steps: Δt({FAMILIES[f].label}) > 0", rows[f][last], zero)
                    for f in ("modsquad", "mtl")]
    comparisons.append(compare(f"at {last:,} steps: Δt(Mod-Squad) > Δt(MTL)", rows["modsquad"][last],
                               rows["mtl"][last]))
    judge(comparisons, parts=2, tolerance=ctx.tolerance)
    table = {f: {str(n): spread(rows[f][n]) for n in budgets} for f in CURVE_FAMILIES}
    reach = {}
    for f in CURVE_FAMILIES:
        s = statistics.fmean(slopes[f]) if slopes[f] else float("nan")
        end = spread(rows[f][last])["mean"]
        reach[f] = last * 2 ** (-end / s) if math.isfinite(s) and s > 0 and math.isfinite(end) and end < 0 else None
    return {"tasks": ctx.tasks, "budgets": budgets, "table": table,
            "labels": {f: FAMILIES[f].label for f in table}, "slopes": slopes, "reach_zero": reach,
            "gate": gate, "comparisons": comparisons, "curves": {FAMILIES[f].label: curves[f] for f in CURVE_FAMILIES},
            "curve_label": "Δt vs STL at each training budget",
            "budget": f"runs of {', '.join(f'{n:,}' for n in budgets)} steps of {ctx.scale.batch} images",
            "notes": ["Every budget is a run of its own (its own warm-up and cosine schedule), so a point is what that "
                      "budget gives, not a point along a longer run; the scale's own budget reuses "
                      "modsquad-table2's runs. Δt against the STL models of the same budget and seed, over the tasks "
                      "the gate counts at the scale's own budget.",
                      "Rate: per seed, the least-squares slope of Δt against log2(steps) (Δt points per doubling). "
                      "'Reaches 0 near': the budget where that line (mean slope, from the largest budget) crosses 0 — "
                      "an extrapolation, not a finding."]}
