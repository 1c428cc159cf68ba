"""Mod-Squad's Taskonomy claims on the synthetic data: Table 2, its pruned row (Fig. 3) and the MI loss against a
balance loss (Fig. 5). Each function returns plain data for the report, its comparisons judged (the first is the
primary, `squad.reproduce.verdicts`), Δt over the tasks the learnability gate lets count (`squad.reproduce.gate`).

* ``modsquad-table2``: STL against the scale's multi-task families (MTL, an MTL + task embedding control,
  M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad); Δt per task and mean, parameters and MACs
  (`squad.analysis.flops.profile`), seconds per training step and peak training memory
  (`squad.train.cost.measure_cost`). Parts (the paper's Mean row: MTL +2.8, Mod-Squad +5.6 over STL): Δt(Mod-Squad)
  > Δt(MTL), Δt(MTL) > 0, Δt(Mod-Squad) > 0; secondary: Mod-Squad > M3ViT-like, M3ViT-like > MTL. The embedding
  control is reported apart.
* ``pruning``: every task extracted from Mod-Squad (`squad.posttrain.extract`, usage from a calibration pass) at
  each θ and at keep-top 40 %; parameters (like with like: the extracted model against the full model with that
  task's head only; the paper's count beside) vs Δt along a θ curve. Parts: at the paper's θ = 0.01, Δt not worse
  than the full model's by more than `EQUAL_MARGIN` and ≤ 60 % of the parameters for every task; at the first θ of
  the curve that keeps ≤ 60 % on every seed (`lean_setting`), the same two.
* ``mi-vs-balance``: Mod-Squad with its MI loss, with a switch balance loss over all tasks instead (the paper's modified
  MoE, ``balance_scope: all``), with a per-task one (secondary), and the same model untrained (a reference: routers at
  their initialisation already prefer some experts); from the hard expert selections on the validation split
  (`squad.models.usage.ExpertUsage`): experts covering 90 % of a task's selections, entropy of P(E|T), I(T;E), and Δt.
  Parts: I(T;E)(MI) > I(T;E)(balance over all tasks) and Δt not worse than its by more than `EQUAL_MARGIN`; secondary:
  sparser than it, against the per-task balance, and against the untrained model.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from squad.analysis.flops import profile
from squad.data import build_dataset, eval_loader
from squad.eval.evaluate import evaluate
from squad.io import load_model, save_extracted
from squad.models.surgery import select_tasks
from squad.models.usage import ExpertUsage
from squad.models.vit import build_model
from squad.posttrain.extract import collect_usage, extract
from squad.reproduce.measure import (
    baseline,
    baseline_histories,
    budget,
    delta_curve,
    size,
    stl_gate,
    stl_summary,
)
from squad.reproduce.runs import FAMILIES, RunSpec, final_metrics, metrics_history, run_config
from squad.reproduce.scales import Scale
from squad.reproduce.specs import Context, cached, method_spec, stl_spec
from squad.reproduce.verdicts import compare, delta, judge, primary_of, spread

EQUAL_MARGIN = 1.0  # percent of Δt / Δm: "equal" (pruned vs full, MI vs balance) means not worse by more than this
SHARE = 0.6  # the extracted model's parameters / the full model's (like with like), at most


SECOND_SPLIT = "test"  # the second validation split: other buildings, as many images as the validation split


def split_metrics(ctx: Context, spec: RunSpec, split: str = SECOND_SPLIT) -> dict[str, dict[str, float]]:
    """A finished run's metrics on another split than the one it validated on (cached in its folder)."""
    run_dir = ctx.runner.ensure(spec)
    key = {"run": ctx.run_settings(spec), "split": split, "tasks": list(spec.tasks), "data": str(ctx.data),
           "batch": ctx.scale.batch, "device": ctx.device}
    return cached(run_dir / f"reproduce_{split}.json", key, lambda: evaluate(
        load_model(run_dir).to(ctx.device), ctx.val_loader(list(spec.tasks), split), list(spec.tasks), ctx.device))


def second_split_dt(ctx: Context, families: Sequence[str], learnable: Sequence[str]) -> dict[str, list[float]]:
    """Per family and seed, Δt against STL over ``learnable`` on the second validation split (`SECOND_SPLIT`)."""
    out: dict[str, list[float]] = {f: [] for f in families}
    for seed in ctx.seeds:
        base = {t: split_metrics(ctx, stl_spec(ctx, t, seed))[t] for t in ctx.tasks}
        for f in families:
            out[f].append(delta(split_metrics(ctx, method_spec(ctx, f, seed)), base, learnable)["mean"])
    return out


def table2_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [*(stl_spec(ctx, t, seed) for t in ctx.tasks),
                                              *(method_spec(ctx, f, seed) for f in ctx.scale.table2_methods)]]


def _curves(ctx: Context, family: str, gate: dict) -> list[list[tuple[int, float]]]:
    """Per seed, Δt against STL over the learnable tasks at every validation step of ``family``'s runs."""
    return [delta_curve(metrics_history(ctx.runner.ensure(method_spec(ctx, family, seed))),
                        baseline_histories(ctx, seed), gate["learnable"]) for seed in ctx.seeds]


def measure_table2(ctx: Context) -> dict:
    """Mod-Squad Table 2 at this scale, with the MTL + task embedding control."""
    families = list(ctx.scale.table2_methods)
    methods: dict[str, dict] = {"stl": {"label": "STL (one model per task)", "dt": [], "per_task": [],
                                        "metrics": []}}
    for f in families:
        methods[f] = {"label": FAMILIES[f].label, "dt": [], "per_task": [], "metrics": []}
    bases = [baseline(ctx, seed) for seed in ctx.seeds]
    gate = stl_gate(ctx, bases)
    for seed, base in zip(ctx.seeds, bases, strict=True):
        methods["stl"]["metrics"].append(primary_of(base))
        methods["stl"]["dt"].append(0.0)
        methods["stl"]["per_task"].append({t: 0.0 for t in ctx.tasks})
        for f in families:
            metrics = final_metrics(ctx.runner.ensure(method_spec(ctx, f, seed)))
            d = delta(metrics, base, gate["learnable"])
            methods[f]["dt"].append(d["mean"])
            methods[f]["per_task"].append(d["per_task"])
            methods[f]["metrics"].append(primary_of(metrics))
    seed0 = ctx.seeds[0]
    methods["stl"].update(stl_summary(ctx, [stl_spec(ctx, t, seed0) for t in ctx.tasks]))
    for f in families:
        spec = method_spec(ctx, f, seed0)
        cost = ctx.cost(spec)
        methods[f].update(**size(ctx.runner.path(spec), ctx.tasks), step_s=cost["step_s"], cpu_s=cost.get("cpu_s"),
                          peak_mib=cost["peak_mib"])
        methods[f]["curves"] = _curves(ctx, f, gate)
    for m in methods.values():
        m["dt_summary"] = spread(m["dt"])
    dt = {f: methods[f]["dt"] for f in methods}
    zero = [0.0] * len(ctx.seeds)
    parts = [("modsquad", "mtl"), ("mtl", None), ("modsquad", None)]  # the paper: Mod-Squad > MTL > STL (Δt 0)
    secondary = [("modsquad", "m3vit"), ("m3vit", "mtl")]

    def pair(a: str, b: str | None) -> dict:
        return compare(f"Δt({methods[a]['label']}) > " + (f"Δt({methods[b]['label']})" if b else "0 (STL)"), dt[a],
                       dt[b] if b else zero)

    comparisons = [pair(a, b) for a, b in parts + secondary if a in dt and (b is None or b in dt)]
    # the parts again on the second validation split (other buildings): the split's share of the noise
    dt2 = second_split_dt(ctx, ["mtl", "modsquad"], gate["learnable"])
    for m in ("mtl", "modsquad"):
        methods[m]["dt_second_split"] = dt2[m]
    comparisons += [compare(f"second validation split ({SECOND_SPLIT} buildings): Δt({methods[a]['label']}) > "
                            + (f"Δt({methods[b]['label']})" if b else "0 (STL)"), dt2[a], dt2[b] if b else zero)
                    for a, b in parts]
    apart = []
    if "mtl_embed" in dt:
        apart = [compare("control: Δt(MTL + task embedding) > Δt(MTL) (what the embedding alone adds)",
                         dt["mtl_embed"], dt["mtl"]),
                 compare("control: Δt(Mod-Squad) > Δt(MTL + task embedding) (what the experts add beyond it)",
                         dt["modsquad"], dt["mtl_embed"])]
    judge(comparisons, apart, parts=len(parts), tolerance=ctx.tolerance)
    memory = ctx.cost(method_spec(ctx, families[0], seed0))["memory"]
    return {"tasks": ctx.tasks, "methods": methods, "gate": gate, "comparisons": comparisons, "apart": apart,
            "memory": memory, "budget": budget(ctx),
            "notes": [f"STL parameters are the sum of its {len(ctx.tasks)} models (each "
                      f"{methods['stl']['params_each']:,.0f}); its step time is the sum of one step of each model; "
                      f"its peak memory the largest of them.",
                      f"The parts are also measured on a second validation split (the {SECOND_SPLIT} buildings, "
                      "as many images as the validation split; secondary comparisons): how much of a finding is the "
                      "particular validation buildings.",
                      "MTL + task embedding is the control of the design: MTL's dense backbone with the learned "
                      "per-task embedding added before every block, as in MoE MLP only, MoE attention only and "
                      "Mod-Squad (M3ViT-like and MTL have none). It separates what the embedding does from what the "
                      "experts do; its comparisons are reported apart, not in the verdict.",
                      f"MACs are per image and task (`squad.profile`); step time (wall, the fastest of "
                      f"{ctx.scale.cost_steps} steps; CPU: this process's CPU seconds, median) and peak memory come "
                      f"from one batch of {ctx.scale.batch} images with every task, measured in this invocation "
                      f"(peak memory: {memory})."]}


# ------------------------------------------------------------------------------------------------ pruning
def _criteria(scale: Scale) -> list[tuple[str, dict]]:
    return [(f"θ={t:g}", {"theta": t}) for t in scale.thetas] + \
        [(f"top {scale.keep_top:.0%}", {"theta": None, "keep_top": scale.keep_top})]


def extraction_table(ctx: Context, spec: RunSpec) -> dict:
    """Every task extracted at every criterion, scored on the validation split, with the parameters of the extracted
    model, of the full model with that task's head only and of the full model (cached in the run folder)."""
    run_dir = ctx.runner.ensure(spec)
    criteria = _criteria(ctx.scale)
    key = {"run": ctx.run_settings(spec), "criteria": [c[0] for c in criteria], "tasks": ctx.tasks,
           "calib_batches": ctx.scale.calib_batches, "batch": ctx.scale.batch, "data": str(ctx.data),
           "device": ctx.device}

    def compute() -> dict:
        model = load_model(run_dir).to(ctx.device)
        full_params = profile(model)["params"]
        table: dict = {"criteria": [c[0] for c in criteria], "full_params": full_params, "tasks": {}}
        for task in ctx.tasks:
            calib = build_dataset(ctx.data, [task], "train", image_size=ctx.scale.img_size, augment=False)
            usage = collect_usage(model, task, eval_loader(calib, ctx.scale.batch), ctx.scale.calib_batches,
                                  ctx.device)
            loader = ctx.val_loader([task])
            single = profile(select_tasks(model, [task]))["params"]  # the full model, this task's head only
            row = {"full": evaluate(model, loader, [task], ctx.device)[task], "single_params": single,
                   "extracted": {}}
            for label, kw in criteria:
                ext = extract(model, task, usage, **kw)
                metrics = evaluate(ext.model, loader, [task], ctx.device)[task]
                params = profile(ext.model)["params"]
                name = label.replace("θ=", "theta").replace(" ", "").replace("%", "")
                path = run_dir / "extracted" / f"{task}_{name}.pt"
                save_extracted(path, ext, {"task": task, "criterion": kw,
                                           "metrics": {"split": "val", "extracted": metrics}})
                row["extracted"][label] = {"metrics": metrics, "params": params, "ratio": params / single,
                                           "paper_ratio": params / full_params,
                                           "file": str(path.relative_to(ctx.out))}
            table["tasks"][task] = row
        return table

    return cached(run_dir / "extracted" / "pruning.json", key, compute)


def shares(table: dict, label: str, tasks: Sequence[str] | None = None) -> dict:
    """The parameter shares of one criterion over ``tasks`` (default: all): like with like (mean, largest) and the
    paper's count (largest over tasks, as its Table 2 reports the pruned model)."""
    rows = [r["extracted"][label] for t, r in table["tasks"].items() if tasks is None or t in tasks]
    return {"ratio": statistics.fmean(r["ratio"] for r in rows), "ratio_max": max(r["ratio"] for r in rows),
            "paper_ratio": max(r["paper_ratio"] for r in rows),
            "paper_ratio_mean": statistics.fmean(r["paper_ratio"] for r in rows)}


def lean_setting(points: dict[str, dict]) -> str:
    """The θ on the curve (``points``: criterion → per-seed figures, θ in increasing order) that a claim of "≤ 60 %
    of the parameters" is judged at: the first whose largest share is ≤ `SHARE` on every seed, else the leanest θ."""
    thetas = [k for k in points if k.startswith("θ=")]
    for label in thetas:
        if all(r <= SHARE for r in points[label]["ratio_max"]):
            return label
    return min(thetas, key=lambda k: statistics.fmean(points[k]["ratio_max"])) if thetas else next(iter(points))



def pruning_parts(points: dict, full: dict, label: str, n: int) -> list[dict]:
    """The pruning claim's two parts at one setting ``label`` of the θ curve: the extracted models keep Δt (within
    `EQUAL_MARGIN` of the full model's) and the largest task keeps at most `SHARE` of the parameters (``n`` seeds)."""
    return [compare(f"Δt(extracted, {label}) ≥ Δt(full model) − {EQUAL_MARGIN:g}", points[label]["dt"],
                    full["dt"], "not_worse", EQUAL_MARGIN),
            compare(f"parameters(extracted, {label}) / parameters(full model with the task's head only) "
                    f"≤ {SHARE:.2f}, largest over tasks", points[label]["ratio_max"], [SHARE] * n, "at_most",
                    pool="share")]

def measure_pruning(ctx: Context) -> dict:
    """Extraction at every θ and at keep-top: parameters vs Δt (Table 2's pruned row, Fig. 3)."""
    points: dict[str, dict[str, list]] = {}
    full: dict[str, list] = {"dt": [], "ratio": []}
    bases = [baseline(ctx, seed) for seed in ctx.seeds]
    gate = stl_gate(ctx, bases)
    for seed, base in zip(ctx.seeds, bases, strict=True):
        table = extraction_table(ctx, method_spec(ctx, "modsquad", seed))
        full["dt"].append(delta({t: r["full"] for t, r in table["tasks"].items()}, base, gate["learnable"])["mean"])
        full["ratio"].append(1.0)
        for label in table["criteria"]:
            p = points.setdefault(label, {"dt": [], "ratio": [], "ratio_max": [], "paper_ratio": [],
                                          "paper_ratio_mean": [], "params": [], "per_task_ratio": []})
            ext = {t: r["extracted"][label] for t, r in table["tasks"].items()}
            p["dt"].append(delta({t: e["metrics"] for t, e in ext.items()}, base, gate["learnable"])["mean"])
            for k, v in shares(table, label).items():
                p[k].append(v)
            p["params"].append(statistics.fmean(e["params"] for e in ext.values()))
            p["per_task_ratio"].append({t: e["ratio"] for t, e in ext.items()})
    key = "θ=0.01" if "θ=0.01" in points else next(iter(points))
    lean = lean_setting(points)
    n = len(ctx.seeds)

    # parts: the paper's θ keeps Δt and ≤ 60 % of the parameters; and along the θ curve, the first setting that
    # keeps ≤ 60 % on every seed keeps Δt (where no θ gets there: the leanest, whose share then fails its part)
    comparisons = pruning_parts(points, full, key, n) + (pruning_parts(points, full, lean, n) if lean != key else [])
    judge(comparisons, parts=len(comparisons), tolerance=ctx.tolerance)
    curves = _curves(ctx, "modsquad", gate)
    return {"criteria": list(points), "points": points, "full": full, "gate": gate, "comparisons": comparisons,
            "lean": lean, "budget": budget(ctx), "curves": {"Mod-Squad (full model)": curves},
            "notes": ["Parameters like with like: each extracted single-task model (backbone, its experts, this "
                      "task's router rows, embedding and head) against the full model with this task's head, router "
                      "rows and embedding only (`select_tasks`: the model before any expert is removed); the mean and "
                      f"the largest share over tasks; the bound ({SHARE:.0%}) is tested on the largest. The paper's "
                      "count (Table 2: 116.9 M of 201.3 M) sets the extracted model against the full model with all "
                      "13 heads and reports the largest over tasks; it is shown beside.",
                      f"'Equal' Δt: not worse than the full model's by more than {EQUAL_MARGIN:g} point (the 95 % "
                      f"lower bound of the difference above −{EQUAL_MARGIN:g}). Expert usage for extraction from a "
                      f"calibration pass over {ctx.scale.calib_batches} training batches per task; exact routing "
                      "(the kept experts' original router scores).",
                      "The extracted models are in runs/modsquad-s*/extracted/ (open them with squad.load)."]}


# ------------------------------------------------------------------------------------------------ mi-vs-balance
def usage_statistics(usage, tasks: Sequence[str]) -> dict:
    """Sparsity and task-specificity of expert selection per routed layer, from hard selection counts.

    For each layer, P(E|t) is task t's share of selections per expert; per task: the entropy of P(E|t) in bits and
    the number of experts covering 90 % of its selections; per layer: I(T;E) = H(E) − Σ_t P(t) H(E|t) in bits, with
    P(t) the task's share of the selections. Means are over tasks and layers.
    """
    layers = {}
    for name, counts in usage.counts.items():
        if usage.kinds[name] not in ("moe", "moa"):
            continue
        c = counts.double()
        rows = c.sum(1, keepdim=True)
        p = c / rows.clamp_min(1e-12)
        h = -(p * p.clamp_min(1e-12).log2()).sum(1)
        srt = p.sort(1, descending=True).values.cumsum(1)
        n90 = (srt < 0.9 - 1e-9).sum(1) + 1
        pt = rows.squeeze(1) / rows.sum().clamp_min(1e-12)
        pe = (pt[:, None] * p).sum(0)
        mi = float(-(pe * pe.clamp_min(1e-12).log2()).sum() - (pt * h).sum())
        layers[name] = {"kind": usage.kinds[name], "experts": int(c.shape[1]), "entropy": h.tolist(),
                        "experts90": n90.tolist(), "mi": mi, "share": p.tolist()}
    if not layers:
        raise ValueError("no MoE attention / MoE MLP layer recorded any selection")
    idx = [usage.tasks.index(t) for t in tasks]
    return {"layers": layers,
            "entropy": statistics.fmean(v["entropy"][i] for v in layers.values() for i in idx),
            "experts90": statistics.fmean(v["experts90"][i] for v in layers.values() for i in idx),
            "mi": statistics.fmean(v["mi"] for v in layers.values())}


def _usage(ctx: Context, model, tasks: Sequence[str]) -> dict:
    usage = ExpertUsage(model.task_names)
    metrics = evaluate(model.to(ctx.device), ctx.val_loader(tasks), tasks, ctx.device, usage=usage)
    return {"metrics": metrics, **usage_statistics(usage, tasks)}


def usage_of(ctx: Context, spec: RunSpec) -> dict:
    """Validation metrics and expert-use statistics of a trained run (cached in its folder)."""
    run_dir = ctx.runner.ensure(spec)
    key = {"run": ctx.run_settings(spec), "tasks": ctx.tasks, "data": str(ctx.data), "batch": ctx.scale.batch,
           "device": ctx.device}
    return cached(run_dir / "reproduce_usage.json", key, lambda: _usage(ctx, load_model(run_dir), ctx.tasks))


def untrained_usage(ctx: Context, spec: RunSpec) -> dict:
    """The same statistics of ``spec``'s model as built before its first step (the seed's initialisation, as the
    engine builds it), cached in ``OUT/cache``."""
    key = {"run": ctx.run_settings(spec), "tasks": ctx.tasks, "data": str(ctx.data), "batch": ctx.scale.batch,
           "device": ctx.device, "untrained": True}

    def compute() -> dict:
        cfg = run_config(spec, ctx.scale, ctx.data)
        torch.manual_seed(cfg.train.seed)
        return _usage(ctx, build_model(cfg.model).eval(), ctx.tasks)

    return cached(ctx.cache_file(f"untrained-{spec.name}.json"), key, compute)


def mi_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [*(stl_spec(ctx, t, seed) for t in ctx.tasks),
                                              method_spec(ctx, "modsquad", seed),
                                              method_spec(ctx, "modsquad_balance_all", seed),
                                              method_spec(ctx, "modsquad_balance", seed)]]


def measure_mi_vs_balance(ctx: Context) -> dict:
    """The MI loss against a balance loss over all tasks (the paper's "modified MoE"), a per-task balance loss and
    the untrained model beside: expert-use sparsity, I(T;E), Δt."""
    variants = {"modsquad": "MI loss", "modsquad_balance_all": "balance loss over all tasks",
                "modsquad_balance": "balance loss per task", "untrained": "untrained (reference)"}
    out: dict[str, dict] = {v: {"label": label, "dt": [], "entropy": [], "experts90": [], "mi": [], "maps": None}
                            for v, label in variants.items()}
    bases = [baseline(ctx, seed) for seed in ctx.seeds]
    gate = stl_gate(ctx, bases)
    for seed, base in zip(ctx.seeds, bases, strict=True):
        for v in variants:
            spec = method_spec(ctx, "modsquad" if v == "untrained" else v, seed)
            stats = untrained_usage(ctx, spec) if v == "untrained" else usage_of(ctx, spec)
            o = out[v]
            o["dt"].append(delta(stats["metrics"], base, gate["learnable"])["mean"])
            for k in ("entropy", "experts90", "mi"):
                o[k].append(stats[k])
            if o["maps"] is None:
                o["maps"] = {name: {"kind": layer["kind"], "share": layer["share"]}
                             for name, layer in stats["layers"].items()}
                o["experts"] = {name: layer["experts"] for name, layer in stats["layers"].items()}
    mi, bal, per, init = out["modsquad"], out["modsquad_balance_all"], out["modsquad_balance"], out["untrained"]
    # parts: against the balance loss over all tasks, more task-specific routing at an equal or better Δt
    comparisons = [compare("I(T;E): MI > balance over all tasks (more task-specific)", mi["mi"], bal["mi"],
                           pool="bits"),
                   compare(f"Δt(MI) ≥ Δt(balance over all tasks) − {EQUAL_MARGIN:g}", mi["dt"], bal["dt"],
                           "not_worse", EQUAL_MARGIN),
                   compare("experts covering 90 %: balance over all tasks > MI (MI sparser)", bal["experts90"],
                           mi["experts90"], pool="experts"),
                   compare("entropy of P(E|T): balance over all tasks > MI", bal["entropy"], mi["entropy"],
                           pool="bits"),
                   compare("I(T;E): MI > per-task balance (which lowers I(T;E) by construction)", mi["mi"],
                           per["mi"], pool="bits"),
                   compare(f"Δt(MI) ≥ Δt(per-task balance) − {EQUAL_MARGIN:g}", mi["dt"], per["dt"], "not_worse",
                           EQUAL_MARGIN),
                   compare("I(T;E): MI > untrained (the MI loss made routing more task-specific)", mi["mi"],
                           init["mi"], pool="bits"),
                   compare("experts covering 90 %: untrained > MI (sparser than at initialisation)",
                           init["experts90"], mi["experts90"], pool="experts")]
    judge(comparisons, parts=2, tolerance=ctx.tolerance)
    return {"tasks": ctx.tasks, "variants": out, "gate": gate, "comparisons": comparisons, "budget": budget(ctx),
            "curves": {"MI loss": _curves(ctx, "modsquad", gate),
                       "balance loss over all tasks": _curves(ctx, "modsquad_balance_all", gate),
                       "balance loss per task": _curves(ctx, "modsquad_balance", gate)},
            "notes": ["Statistics from the hard expert selections of every validation image and task (the models in "
                      "eval mode), per routed layer (MoE attention and MoE MLP), averaged over tasks and layers; "
                      "entropy and I(T;E) in bits. The untrained model is Mod-Squad as built from the same seed "
                      "before its first step: routers at initialisation already select unevenly, so 'sparse' is "
                      "judged against it as well as against the balance loss.",
                      f"'Equal or better' Δt: not worse than the balance loss's by more than {EQUAL_MARGIN:g} point "
                      "(the 95 % lower bound of the difference above the margin).",
                      "Balance losses: switch-style load balancing, weight 0.01, MI weight 0 "
                      "(configs/model/m3vit_vit_b.yaml's loss on the Mod-Squad model), over all tasks' tokens "
                      "together (`balance_scope: all`, the paper's modified MoE: the parts) and per task (a "
                      "balance within each task, which drives I(T;E) down by construction: secondary)."]}
