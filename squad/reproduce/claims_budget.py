"""The compute-budget claims: A-MoD's adaptation of a trained dense model (Table 3) and MoNE's one model for every
budget (Fig. 5). Plain data for the report, comparisons judged (the first is the primary), Δt over the tasks the
learnability gate lets count against the claim's own reference model.

* ``amod-table3``: a dense ViT of the scale's ``amod_depth`` blocks trained on ``amod_tasks`` to a plateau (its
  validation curve's last evaluation gains < `squad.reproduce.measure.PLATEAU_GAIN` % over the one before: a
  precondition), turned into MoD at capacity 0.5 on every other block (`squad.posttrain.adapt.to_mod`) with attention
  routing and with a learned router, scored over the whole validation split with no training and along a fine-tune
  of ``amod_steps``, beside the dense model trained on for the same steps (the plateau's control: it must gain
  < `CONTINUED_GAIN` %); Δt against the dense model. Parts: after the same fine-tune, attention routing ahead of the
  learned router (trained those steps), and ahead on the mean over the fine-tune's evaluations (recovery);
  secondary: with no training, ahead of the learned router at its random initialisation (named so), and as good as
  the dense control after the fine-tune.
* ``mone-budget``: a MoNE model trained with e_c drawn per step from the paper's {0.15, …, 0.95}
  (``model.mone.sample_capacity``), evaluated at every fixed-budget model's e_c beside models trained at e_c 0.2,
  0.4, 0.6, 0.8 (and 1, the baseline of Δt) — every model for the same steps; their training compute in MACs and
  the forward time per e_c are reported. Parts: averaged over the budgets (one per-seed series, tested on its own),
  the adaptive model is not worse than the model trained at each budget by more than `CLOSE` points of Δt, and its
  forward time at the lowest e_c is below that at e_c 1; secondary: the same per budget, and each step of e_c.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from squad.analysis.flops import profile
from squad.eval.evaluate import evaluate
from squad.io import load_model
from squad.models.inference import set_inference
from squad.posttrain.adapt import fidelity, to_mod
from squad.reproduce.gate import learnability, predictors
from squad.reproduce.measure import PLATEAU_GAIN, delta_curve, plateau
from squad.reproduce.runs import RunSpec, final_metrics, metrics_history
from squad.reproduce.specs import (
    Context,
    amod_continued_spec,
    amod_dense_spec,
    amod_spec,
    cached,
    mone_spec,
    training_macs,
)
from squad.reproduce.verdicts import compare, delta, judge, precondition, primary_of

CLOSE = 2.0  # percent of Δt: "close to the fixed-budget model" (mone-budget), "as good as the dense control" (amod)
CONTINUED_GAIN = 2.0  # percent of Δt: the most the dense model may gain from training on (A-MoD's plateau control)


def amod_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [amod_dense_spec(ctx, seed), amod_spec(ctx, seed, "attention"),
                                              amod_spec(ctx, seed, "learned"), amod_continued_spec(ctx, seed)]]


@torch.no_grad()
def _fidelity(ctx: Context, dense_run: Path, routing: str, seed: int, tasks: Sequence[str]) -> dict:
    """Agreement of the adapted model (no training) with the dense model over the whole validation split."""
    dense = load_model(dense_run).to(ctx.device).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = to_mod(dense, ctx.scale.amod_capacity, routing, every=2).eval()
    task = next((t for t in tasks if t.startswith("class_")), tasks[0])
    agree, cosine, n = 0.0, 0.0, 0
    for batch in ctx.val_loader([task]):
        images = batch["rgb"].to(ctx.device)
        f = fidelity(adapted, dense, images, task)
        m = images.shape[0]
        agree += (f.top1_agreement if math.isfinite(f.top1_agreement) else 0.0) * m
        cosine += f.feature_cosine * m
        n += m
    is_class = task.startswith("class_")
    return {"task": task, "top1_agreement": agree / n if n and is_class else float("nan"),
            "feature_cosine": cosine / n if n else float("nan"), "images": n}


def measure_amod(ctx: Context) -> dict:
    """Dense → MoD with attention routing and a learned router: no training, then a fine-tune (Table 3)."""
    routings = ("attention", "learned")
    sc = ctx.scale
    tasks = list(sc.amod_tasks)
    out: dict[str, dict] = {r: {"curves": [], "fidelity": []} for r in routings}
    dense_info, dense_metrics = [], []
    for seed in ctx.seeds:
        dense_spec = amod_dense_spec(ctx, seed)
        dense_run = ctx.runner.ensure(dense_spec)
        dense_metrics.append(final_metrics(dense_run))
        history = metrics_history(dense_run)
        info = plateau(history, tasks)
        info["metrics"] = primary_of(dense_metrics[-1])
        info["curve"] = [(s, primary_of(m)) for s, m in history]
        dense_info.append(info)
    gate = learnability(predictors(ctx, tasks), dense_metrics, tasks)
    for seed, dense in zip(ctx.seeds, dense_metrics, strict=True):
        dense_run = ctx.runner.path(amod_dense_spec(ctx, seed))
        for r in routings:
            run = ctx.runner.ensure(amod_spec(ctx, seed, r))
            out[r]["curves"].append([(step, delta(m, dense, gate["learnable"])["mean"])
                                     for step, m in metrics_history(run)])
            out[r]["fidelity"].append(_fidelity(ctx, dense_run, r, seed, tasks))
    continued = []
    for seed, dense in zip(ctx.seeds, dense_metrics, strict=True):
        run = ctx.runner.ensure(amod_continued_spec(ctx, seed))
        continued.append([(step, delta(m, dense, gate["learnable"])["mean"]) for step, m in metrics_history(run)])
    attn, learned = out["attention"]["curves"], out["learned"]["curves"]

    def at0(curves):
        return [c[0][1] if c and c[0][0] == 0 else float("nan") for c in curves]

    def after(curves):
        return [statistics.fmean(v for s, v in c if s > 0) if any(s > 0 for s, _ in c) else float("nan")
                for c in curves]

    def last(curves):
        return [c[-1][1] if c and c[-1][0] > 0 else float("nan") for c in curves]

    # parts: the learned router is trained (fine-tuned the same steps) before it is compared; its untrained form
    # (a fresh initialisation) is a secondary, named as such
    comparisons = [compare(f"after the same {sc.amod_steps} fine-tune steps: Δt(attention routing) > Δt(learned "
                           "router, trained)", last(attn), last(learned)),
                   compare("recovery: mean Δt over the fine-tune's evaluations, attention routing > learned router",
                           after(attn), after(learned)),
                   compare("no training: Δt(attention routing) > Δt(learned router at its random initialisation)",
                           at0(attn), at0(learned)),
                   compare(f"after the fine-tune: Δt(attention routing) ≥ Δt(dense model trained on the same steps) "
                           f"− {CLOSE:g}", last(attn), last(continued), "not_worse", CLOSE)]
    judge(comparisons, parts=2, tolerance=ctx.tolerance)
    gains = ", ".join(_num(d["gain"]) for d in dense_info)
    kept = last(continued)
    still = [v for v in kept if math.isfinite(v)]
    preconditions = [precondition("the dense model has ≥ 8 blocks", sc.amod_depth >= 8, f"depth {sc.amod_depth}"),
                     precondition(f"the dense model is at a plateau: its last validation gains < {PLATEAU_GAIN:g} % "
                                  "over the one before (every seed)", all(d["at_plateau"] for d in dense_info),
                                  f"gain per seed (%): {gains}"),
                     precondition(f"the dense model is at a plateau: trained on for the fine-tune's {sc.amod_steps} "
                                  f"steps it gains < {CONTINUED_GAIN:g} % Δt (mean over seeds)",
                                  bool(still) and statistics.fmean(still) < CONTINUED_GAIN,
                                  "Δt per seed (%): " + ", ".join(_num(v) for v in kept)),
                     precondition("the fine-tune runs ≥ 1,000 steps", sc.amod_steps >= 1000, f"{sc.amod_steps} steps")]
    names = ", ".join(tasks)
    return {"routings": out, "capacity": sc.amod_capacity, "steps": sc.amod_steps, "dense": dense_info,
            "tasks": tasks, "gate": gate, "comparisons": comparisons, "preconditions": preconditions,
            "continued": continued,
            "curves": {**{f"{r} routing": out[r]["curves"] for r in routings},
                       "dense, trained on (control)": continued}, "curve_label": "Δt vs the dense model",
            "budget": f"dense model {sc.amod_dense_steps} steps of {sc.batch}, fine-tune {sc.amod_steps} steps",
            "notes": [f"The dense model: a ViT of {sc.amod_depth} blocks (width {sc.embed_dim}) trained on {names} "
                      f"for {sc.amod_dense_steps} steps of {sc.batch} images (runs/amod-dense-s*), validated along "
                      "the way; the paper adapts a converged ImageNet ViT. Δt against the dense model itself (0 = as "
                      f"good as before the change). MoD on every other block at capacity {sc.amod_capacity}; step 0 "
                      f"is the adapted model with no training, scored over the whole validation split. Fine-tune: "
                      f"{sc.amod_steps} steps at lr {sc.lr / 3:g} from the adapted weights (runs/amod-*-finetune-s*).",
                      "Plateau: the relative gain (%) of the dense model's last validation over the one before it "
                      "(its validation curve, not its training loss, which a cosine schedule decaying to 1e-6 always "
                      "lowers).",
                      "Fidelity: agreement with the dense model over the whole validation split before any training "
                      "(`squad.posttrain.adapt.fidelity`): top-1 agreement of the class head and the cosine of the "
                      "final tokens."]}


def _num(v) -> str:
    return f"{v:+.1f}" if isinstance(v, float) and math.isfinite(v) else "–"


# ------------------------------------------------------------------------------------------------ mone-budget
def mone_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [*(mone_spec(ctx, seed, c) for c in ctx.scale.mone_fixed),
                                              mone_spec(ctx, seed, None)]]


@torch.no_grad()
def _forward_seconds(model, images: torch.Tensor, tasks: Sequence[str], repeats: int) -> float:
    model.eval()
    model(images, list(tasks))
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        model(images, list(tasks))
        if images.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed by other processes


def _mone_eval(ctx: Context, spec: RunSpec, capacities: Sequence[float]) -> dict:
    """Metrics, MACs and forward time of a MoNE run at each e_c (cached in the run folder)."""
    run_dir = ctx.runner.ensure(spec)
    key = {"run": ctx.run_settings(spec), "capacities": [f"{c:g}" for c in capacities], "tasks": ctx.tasks,
           "data": str(ctx.data), "batch": ctx.scale.batch, "repeats": ctx.scale.time_repeats, "device": ctx.device}

    def compute() -> dict:
        model = load_model(run_dir).to(ctx.device)
        loader = ctx.val_loader(ctx.tasks)
        images = next(iter(loader))["rgb"].to(ctx.device)
        out = {}
        for c in capacities:
            set_inference(model, mone_capacity=c)
            prof = profile(model, ctx.tasks, mone_capacity=c)
            out[f"{c:g}"] = {"metrics": evaluate(model, loader, ctx.tasks, ctx.device),
                             "macs": statistics.fmean(prof["tasks"][t]["macs"] for t in ctx.tasks),
                             "forward_s": _forward_seconds(model, images, ctx.tasks, ctx.scale.time_repeats),
                             "images": int(images.shape[0])}
        return out

    return cached(run_dir / "reproduce_mone.json", key, compute)


def measure_mone(ctx: Context) -> dict:
    """The adaptive MoNE model (e_c drawn per step) vs fixed-e_c models, every one for the same steps, at every
    e_c, with training MACs and forward times (Fig. 5)."""
    fixed = list(ctx.scale.mone_fixed)
    if 1.0 not in fixed:
        raise ValueError("mone-budget: the fixed e_c must include 1.0 (the baseline of Δt)")
    sampled = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in fixed}
    fixed_out = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in fixed}
    evals = []
    for seed in ctx.seeds:
        fixed_eval = {f"{c:g}": _mone_eval(ctx, mone_spec(ctx, seed, c), [c])[f"{c:g}"] for c in fixed}
        evals.append((fixed_eval, _mone_eval(ctx, mone_spec(ctx, seed, None), fixed)))
    gate = learnability(predictors(ctx, ctx.tasks), [f["1"]["metrics"] for f, _ in evals], ctx.tasks)
    for fixed_eval, s_eval in evals:
        base = fixed_eval["1"]["metrics"]
        for table, ev in ((sampled, s_eval), (fixed_out, fixed_eval)):
            for key, row in table.items():
                row["dt"].append(delta(ev[key]["metrics"], base, gate["learnable"])["mean"])
                row["forward_s"].append(ev[key]["forward_s"])
                row["macs"].append(ev[key]["macs"])
    budgets = [k for k in fixed_out if k != "1"]
    n = len(ctx.seeds)
    mean_gap = [statistics.fmean(sampled[k]["dt"][i] - fixed_out[k]["dt"][i] for k in budgets) for i in range(n)]
    comparisons = [compare(f"mean over e_c {', '.join(budgets)}: Δt(adaptive) ≥ Δt(fixed) − {CLOSE:g}", mean_gap,
                           [0.0] * n, "not_worse", CLOSE)]
    comparisons += [compare(f"e_c {k}: Δt(adaptive model) ≥ Δt(fixed e_c {k}) − {CLOSE:g}", sampled[k]["dt"],
                            fixed_out[k]["dt"], "not_worse", CLOSE) for k in budgets]
    keys = [f"{c:g}" for c in sorted(fixed)]
    # parts: the mean over the budgets (tested on its own per-seed series) and the forward time falling from e_c 1
    # to the lowest budget; secondary: each budget, each step of the forward time
    comparisons.insert(1, compare(f"forward time at e_c {keys[-1]} > at e_c {keys[0]}", sampled[keys[-1]]["forward_s"],
                                  sampled[keys[0]]["forward_s"], pool="seconds"))
    comparisons += [compare(f"forward time at e_c {hi} > at e_c {lo}", sampled[hi]["forward_s"],
                            sampled[lo]["forward_s"], pool="seconds") for lo, hi in zip(keys, keys[1:], strict=False)]
    judge(comparisons, parts=2, tolerance=ctx.tolerance)
    train_macs = {"adaptive": training_macs(ctx, None), **{f"{c:g}": training_macs(ctx, c) for c in fixed}}
    seeds = ctx.seeds
    curves = {f"trained at e_c {c:g}": [delta_curve(metrics_history(ctx.runner.path(mone_spec(ctx, s, c))),
                                                    metrics_history(ctx.runner.path(mone_spec(ctx, s, 1.0))),
                                                    gate["learnable"]) for s in seeds] for c in fixed if c != 1.0}
    curves["adaptive (validated at its median e_c)"] = [
        delta_curve(metrics_history(ctx.runner.path(mone_spec(ctx, s, None))),
                    metrics_history(ctx.runner.path(mone_spec(ctx, s, 1.0))), gate["learnable"]) for s in seeds]
    grid = ", ".join(f"{c:g}" for c in ctx.scale.mone_grid)
    return {"grid": list(ctx.scale.mone_grid), "fixed": fixed, "sampled": sampled, "fixed_models": fixed_out,
            "steps": ctx.scale.steps, "train_macs": train_macs, "gate": gate, "comparisons": comparisons,
            "curves": curves, "curve_label": "Δt vs the model trained at e_c 1",
            "budget": f"every model {ctx.scale.steps} steps of {ctx.scale.batch} images",
            "notes": [f"Δt against the model trained at the fixed e_c 1 (same seed), over the validation split; "
                      f"'close' means not worse by more than {CLOSE:g} points of Δt (the 95 % lower bound of the "
                      f"difference above −{CLOSE:g}). The adaptive model drew e_c from {grid} at every step (the "
                      "MoNE paper's grid; model.mone.sample_capacity); every model trained the same "
                      f"{ctx.scale.steps} steps from scratch, so the adaptive one used the mean of its grid's compute "
                      "per step (training MACs in the table: steps × images × tasks × backbone MACs per image × 3 for "
                      "forward and backward). At e_c 1 (outside the grid it trained on) the adaptive model is shown, "
                      "not compared.",
                      "Forward time: the fastest of repeated fused passes over one validation batch with every task, "
                      "in eval mode; MACs per image and task at that e_c (`squad.profile`)."]}
