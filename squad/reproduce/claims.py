"""The claims tools/reproduce.py measures: one function per claim, each returning plain data for the report.

Every claim trains (or finds) its runs through a `Context` (`squad.reproduce.runs.Runner`), measures what the paper
measured with squad's own post-training code, and judges the claim by `squad.reproduce.verdicts.verdict` from
paired per-seed comparisons (and, where a fair test needs them, preconditions). Comparisons listed under ``apart``
are reported beside the verdict without counting in it (controls, and tasks the test cannot use):

* ``modsquad-table2`` (Mod-Squad Table 2): STL, MTL, M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad; Δt
  against STL per task and mean, parameters and MACs (`squad.analysis.flops.profile`), seconds per training step and
  peak training memory (`squad.train.cost.measure_cost`). Claim: Δt(Mod-Squad) > Δt(M3ViT) > Δt(MTL) > 0. A
  control, MTL with the per-block task embedding of the Mod-Squad families and no experts, separates the
  embedding's effect from the experts' (reported apart).
* ``pruning`` (Table 2's pruned row, Fig. 3): every task extracted from Mod-Squad (`squad.posttrain.extract`, usage
  from a calibration pass) at each θ and at keep-top 40 %; parameters vs Δt. The parameter share compares like with
  like: the extracted model (backbone + the task's head) against the full model with that task's head only
  (`squad.models.surgery.select_tasks`); the paper's own count (against the full model with every head, the largest
  over tasks as its Table 2) is reported beside. Claim: at θ = 0.01 Δt is not worse than the full model's by more
  than `EQUAL_MARGIN` on any seed, with ≤ 60 % of the parameters for every task.
* ``router-finetune`` (Fig. 4): Mod-Squad pretrained without class_object and class_scene, each learned from a few
  fractions of its data in the router, head, full and linear-probe modes with the same budget and stopping rule
  (`squad.reproduce.finetune`). A task the single-task model (STL, the whole training split) does not learn beyond
  chance is reported apart. Claim: router fine-tuning wins at every fraction.
* ``mi-vs-balance`` (Fig. 5): Mod-Squad with its MI loss and with a per-task switch balance loss instead; from the
  expert selections on the validation split (`squad.models.usage.ExpertUsage`): experts covering 90 % of a task's
  selections, entropy of P(E|T), I(T;E), and Δt. Claim: MI gives sparser, more task-specific expert use at equal or
  better Δt (not worse by more than `EQUAL_MARGIN` on any seed).
* ``amod-table3`` (A-MoD Table 3): a dense ViT of the scale's ``amod_depth`` blocks trained on ``amod_tasks`` to a
  plateau (checked from its training loss: a precondition), turned into MoD at capacity 0.5 on every other block
  (`squad.posttrain.adapt.to_mod`) with attention routing and with a learned router, scored over the whole
  validation split with no training and along a fine-tune of ``amod_steps``. Claim: attention routing keeps far more
  with no training and recovers faster.
* ``mone-budget`` (MoNE Fig. 5): a MoNE model trained with e_c drawn per step from the paper's {0.15, …, 0.95}
  (``model.mone.sample_capacity``) for the training FLOPs of the e_c = 1 model (iso-FLOPs, as the paper's adaptive
  model), evaluated at every fixed-budget model's e_c beside models trained at e_c 0.2, 0.4, 0.6, 0.8 (and 1, the
  baseline of Δt), with the forward time measured per e_c. Claim: one model serves every budget close to the
  fixed-budget models, and time falls with e_c.
* ``pascal-table3`` (Mod-Squad Table 3): on the synthetic PASCAL-Context (its own data, the 5 tasks; the scale's
  `squad.reproduce.scales.pascal_scale`), STL, MTL, Mod-Squad and the pruned Mod-Squad (every task extracted at
  θ = 0.01, the paper's main setting); Δm against STL per seed, parameters (like with like, and the paper's count)
  and MACs, step time and peak memory. Claim: Δm(Mod-Squad) > 0 (better than STL: the paper's +4.72), Δm(Mod-Squad)
  > Δm(MTL), and the pruned models keep Δm with ≤ 60 % of the parameters (the paper: 50 M → 22 M).

The runs come from `squad.reproduce.specs`. Results computed after training are cached beside the runs with the
settings they were made with (`squad.reproduce.specs.cached`), and a cached result made with other settings is
computed again.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from squad.analysis.flops import profile
from squad.data import build_dataset, eval_loader
from squad.eval.evaluate import evaluate
from squad.io import load_extracted, load_model, save_extracted
from squad.models.inference import set_inference
from squad.models.surgery import select_tasks
from squad.models.usage import ExpertUsage
from squad.posttrain.adapt import fidelity, to_mod
from squad.posttrain.extract import collect_usage, extract
from squad.reproduce.finetune import MODES, FairFinetune, finetune_task, load_cached
from squad.reproduce.parallel import Job
from squad.reproduce.runs import (
    FAMILIES,
    RunSpec,
    final_metrics,
    metrics_history,
)
from squad.reproduce.scales import PASCAL_THETA, Scale
from squad.reproduce.specs import (
    PASCAL_METHODS,
    Context,
    amod_dense_spec,
    amod_spec,
    cached,
    held_out,
    method_spec,
    mone_spec,
    pascal_ctx,
    pascal_spec,
    pretrain_spec,
    stl_spec,
    stl_specs,
)
from squad.reproduce.verdicts import RULE, VERDICTS, compare, delta, finite, precondition, primary_of, spread, verdict

__all__ = ["CLAIMS", "RULE", "VERDICTS", "Claim", "compare", "resolve_claims", "spread", "verdict"]

EQUAL_MARGIN = 1.0  # percent of Δt / Δm: "equal" (pruned vs full, MI vs balance) means not worse by more than this
SHARE = 0.6  # the extracted model's parameters / the full model's (like with like), at most


# ------------------------------------------------------------------------------------------------- claims
@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim: what the paper says, where, the runs it needs, the function that measures it, and (optionally) its
    post-training jobs that ``--parallel`` runs in processes of their own before it is measured."""

    name: str
    source: str
    statement: str
    specs: Callable[[Context], list[RunSpec]]
    measure: Callable[[Context], dict]
    jobs: Callable[[Context], list[Job]] | None = None


def _table2_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), *(method_spec(ctx, f, seed)
                                                                       for f in ctx.scale.table2_methods)]]


def _baseline(ctx: Context, seed: int) -> dict[str, dict[str, float]]:
    """Every task's STL metrics for a seed (training the STL runs if needed)."""
    out = {}
    for spec in stl_specs(ctx, seed):
        out[spec.tasks[0]] = final_metrics(ctx.runner.ensure(spec))[spec.tasks[0]]
    return out


def _size(run_dir: Path, tasks: Sequence[str]) -> dict:
    prof = profile(load_model(run_dir), tasks)
    return {"params": prof["params"], "macs": statistics.fmean(prof["tasks"][t]["macs"] for t in tasks)}


def _budget(ctx: Context) -> str:
    return f"{ctx.scale.steps} steps of {ctx.scale.batch} images per run"


def measure_table2(ctx: Context) -> dict:
    """Mod-Squad Table 2 at this scale, with the MTL + task embedding control."""
    methods: dict[str, dict] = {"stl": {"label": "STL (one model per task)", "dt": [], "per_task": [],
                                        "metrics": []}}
    for f in ctx.scale.table2_methods:
        methods[f] = {"label": FAMILIES[f].label, "dt": [], "per_task": [], "metrics": []}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        methods["stl"]["metrics"].append(primary_of(base))
        methods["stl"]["dt"].append(0.0)
        methods["stl"]["per_task"].append({t: 0.0 for t in ctx.tasks})
        for f in ctx.scale.table2_methods:
            metrics = final_metrics(ctx.runner.ensure(method_spec(ctx, f, seed)))
            d = delta(metrics, base)
            methods[f]["dt"].append(d["mean"])
            methods[f]["per_task"].append(d["per_task"])
            methods[f]["metrics"].append(primary_of(metrics))
    seed0 = ctx.seeds[0]
    stl_sizes = [_size(ctx.runner.path(stl_spec(ctx, t, seed0)), [t]) for t in ctx.tasks]
    stl_costs = [ctx.cost(stl_spec(ctx, t, seed0)) for t in ctx.tasks]
    peaks = finite([c["peak_mib"] for c in stl_costs])
    methods["stl"].update(params=sum(s["params"] for s in stl_sizes),
                          params_each=statistics.fmean(s["params"] for s in stl_sizes),
                          macs=statistics.fmean(s["macs"] for s in stl_sizes),
                          step_s=sum(c["step_s"] for c in stl_costs), cpu_s=sum(c.get("cpu_s", float("nan"))
                                                                               for c in stl_costs),
                          peak_mib=max(peaks) if peaks else None)
    for f in ctx.scale.table2_methods:
        spec = method_spec(ctx, f, seed0)
        cost = ctx.cost(spec)
        methods[f].update(**_size(ctx.runner.path(spec), ctx.tasks), step_s=cost["step_s"],
                          cpu_s=cost.get("cpu_s"), peak_mib=cost["peak_mib"])
    for m in methods.values():
        m["dt_summary"] = spread(m["dt"])
    dt = {f: methods[f]["dt"] for f in methods}
    n = len(ctx.seeds)
    comparisons = [compare("Δt(Mod-Squad) > Δt(M3ViT-like)", dt["modsquad"], dt["m3vit"]),
                   compare("Δt(M3ViT-like) > Δt(MTL)", dt["m3vit"], dt["mtl"]),
                   compare("Δt(MTL) > 0", dt["mtl"], [0.0] * n)]
    apart = [compare("control: Δt(MTL + task embedding) > Δt(MTL) (what the embedding alone adds)",
                     dt["mtl_embed"], dt["mtl"]),
             compare("control: Δt(Mod-Squad) > Δt(MTL + task embedding) (what the experts add beyond it)",
                     dt["modsquad"], dt["mtl_embed"])]
    memory = ctx.cost(method_spec(ctx, "mtl", seed0))["memory"]
    return {"tasks": ctx.tasks, "methods": methods, "comparisons": comparisons, "apart": apart, "memory": memory,
            "budget": _budget(ctx),
            "notes": [f"STL parameters are the sum of its {len(ctx.tasks)} models (each "
                      f"{methods['stl']['params_each']:,.0f}); its step time is the sum of one step of each model; "
                      f"its peak memory the largest of them.",
                      "MTL + task embedding is the control of the design: MTL's dense backbone with the learned "
                      "per-task embedding added before every block, as in MoE MLP only, MoE attention only and "
                      "Mod-Squad (M3ViT-like and MTL have none). It separates what the embedding does from what the "
                      "experts do; its comparisons are reported apart, not in the verdict.",
                      f"MACs are per image and task (`squad.profile`); step time (wall, the fastest of "
                      f"{ctx.scale.cost_steps} steps; CPU: this process's CPU seconds) and peak memory come from one "
                      f"batch of {ctx.scale.batch} images with every task, measured in this invocation (peak memory: "
                      f"{memory})."]}


# ------------------------------------------------------------------------------------------------ pruning
def _criteria(scale: Scale) -> list[tuple[str, dict]]:
    return [(f"θ={t:g}", {"theta": t}) for t in scale.thetas] + \
        [(f"top {scale.keep_top:.0%}", {"theta": None, "keep_top": scale.keep_top})]


def _extraction_table(ctx: Context, spec: RunSpec) -> dict:
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


def _shares(table: dict, label: str) -> dict:
    """The parameter shares of one criterion over tasks: like with like (mean, largest) and the paper's count
    (largest over tasks, as its Table 2 reports the pruned model)."""
    rows = [r["extracted"][label] for r in table["tasks"].values()]
    return {"ratio": statistics.fmean(r["ratio"] for r in rows), "ratio_max": max(r["ratio"] for r in rows),
            "paper_ratio": max(r["paper_ratio"] for r in rows),
            "paper_ratio_mean": statistics.fmean(r["paper_ratio"] for r in rows)}


def measure_pruning(ctx: Context) -> dict:
    """Extraction at every θ and at keep-top: parameters vs Δt (Table 2's pruned row, Fig. 3)."""
    points: dict[str, dict[str, list]] = {}
    full = {"dt": [], "ratio": []}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        table = _extraction_table(ctx, method_spec(ctx, "modsquad", seed))
        full["dt"].append(delta({t: r["full"] for t, r in table["tasks"].items()}, base)["mean"])
        full["ratio"].append(1.0)
        for label in table["criteria"]:
            p = points.setdefault(label, {"dt": [], "ratio": [], "ratio_max": [], "paper_ratio": [],
                                          "paper_ratio_mean": [], "params": [], "per_task_ratio": []})
            ext = {t: r["extracted"][label] for t, r in table["tasks"].items()}
            p["dt"].append(delta({t: e["metrics"] for t, e in ext.items()}, base)["mean"])
            for k, v in _shares(table, label).items():
                p[k].append(v)
            p["params"].append(statistics.fmean(e["params"] for e in ext.values()))
            p["per_task_ratio"].append({t: e["ratio"] for t, e in ext.items()})
    key = "θ=0.01" if "θ=0.01" in points else next(iter(points))
    n = len(ctx.seeds)
    comparisons = [compare(f"Δt(extracted, {key}) ≥ Δt(full model) − {EQUAL_MARGIN:g}", points[key]["dt"],
                           full["dt"], "not_worse", EQUAL_MARGIN),
                   compare(f"parameters(extracted, {key}) / parameters(full model with the task's head only) "
                           f"≤ {SHARE:.2f}, largest over tasks", points[key]["ratio_max"], [SHARE] * n, "at_most")]
    return {"criteria": list(points), "points": points, "full": full, "comparisons": comparisons,
            "budget": _budget(ctx),
            "notes": ["Parameters like with like: each extracted single-task model (backbone, its experts, this "
                      "task's router rows, embedding and head) against the full model with this task's head, router "
                      "rows and embedding only (`select_tasks`: the model before any expert is removed); the mean and "
                      f"the largest share over tasks; the bound ({SHARE:.0%}) is tested on the largest. The paper's "
                      "count (Table 2: 116.9 M of 201.3 M) sets the extracted model against the full model with all "
                      "13 heads and reports the largest over tasks; it is shown beside.",
                      f"'Equal' Δt: not worse than the full model's by more than {EQUAL_MARGIN:g} point on any seed. "
                      f"Expert usage for extraction from a calibration pass over {ctx.scale.calib_batches} training "
                      "batches per task; exact routing (the kept experts' original router scores).",
                      "The extracted models are in runs/modsquad-s*/extracted/ (open them with squad.load)."]}


# ---------------------------------------------------------------------------------------------- router-finetune
def finetune_config(ctx: Context, seed: int) -> FairFinetune:
    sc = ctx.scale
    return FairFinetune(fractions=tuple(sc.finetune_fractions), steps=sc.finetune_steps, batch=sc.finetune_batch,
                        lrs=tuple(sc.finetune_lrs), holdout=sc.finetune_holdout, evals=sc.finetune_evals, seed=seed)


def _finetune_target(ctx: Context, seed: int, task: str) -> tuple[Path, dict, FairFinetune, Path]:
    spec = pretrain_spec(ctx, seed)
    cfg = finetune_config(ctx, seed)
    key = {"finetune": cfg.key(), "run": ctx.run_settings(spec), "task": task, "data": str(ctx.data),
           "device": ctx.device}
    run_dir = ctx.runner.path(spec)
    return run_dir, key, cfg, run_dir / "finetune" / f"{task}.json"


def finetune_jobs(ctx: Context) -> list[Job]:
    """router-finetune's fine-tunes still to do, one job per seed and held-out task (for ``--parallel``)."""
    jobs = []
    for seed in ctx.seeds:
        for task in held_out(ctx):
            run_dir, key, cfg, out = _finetune_target(ctx, seed, task)
            if load_cached(out, key) is None:
                jobs.append(Job(f"finetune-{task}-s{seed}", finetune_task,
                                {"run_dir": str(run_dir), "task": task, "data": str(ctx.data), "cfg": cfg,
                                 "out": str(out), "key": key, "device": ctx.device},
                                what=f"{len(cfg.fractions)} fractions × {len(MODES)} modes × {len(cfg.lrs)} lrs"))
    return jobs


def finetune_judgement(tables: dict[str, dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """router-finetune's comparisons, those reported apart, and its precondition, from per-task tables
    (``metric``, ``lower_is_better``, ``stl`` and ``chance`` per seed, ``runs``: each seed's ``table`` mode →
    fraction → metric). A task whose STL metric does not beat chance beyond the seed spread (`compare`'s 'holds')
    is not learnable at this scale: its comparisons go apart; ``learnable`` is set on each table."""
    comparisons, apart, learnable = [], [], {}
    for task, t in tables.items():
        sign = -1.0 if t["lower_is_better"] else 1.0
        if t.get("chance") and all(c is not None for c in t["chance"]):
            check = compare(f"{task}: STL {t['metric']} > chance (the most frequent training class)",
                            [sign * v for v in t["stl"]], [sign * c for c in t["chance"]])
            learnable[task] = check
            apart.append(check)
        ok = task not in learnable or learnable[task]["status"] == "holds"
        t["learnable"] = ok
        sizes = list(t["runs"][0]["table"]["router"])
        for size in sizes:
            router = [sign * r["table"]["router"][size] for r in t["runs"]]
            for mode in MODES:
                if mode == "router":
                    continue
                other = [sign * r["table"][mode][size] for r in t["runs"]]
                c = compare(f"{task} at {float(size):.1%}: router better than {mode}", router, other)
                (comparisons if ok else apart).append(c)
    preconditions = [precondition("a held-out task the single-task model learns beyond chance at this scale",
                                  any(t["learnable"] for t in tables.values()),
                                  ", ".join(f"{k}: {v['status']}" for k, v in learnable.items()))]
    return comparisons, apart, preconditions


def measure_router_finetune(ctx: Context) -> dict:
    """Router / head / full / linear-probe fine-tuning of the held-out tasks on a little data (Fig. 4), every mode
    with the same budget and stopping rule; tasks STL cannot learn at this scale reported apart."""
    held = held_out(ctx)
    tables: dict[str, dict] = {}
    for seed in ctx.seeds:
        ctx.runner.ensure(pretrain_spec(ctx, seed))
        for task in held:
            run_dir, key, cfg, out = _finetune_target(ctx, seed, task)
            result = load_cached(out, key) or finetune_task(run_dir, task, ctx.data, cfg, out, key, ctx.device)
            stl = final_metrics(ctx.runner.ensure(stl_spec(ctx, task, seed)))[task]
            t = tables.setdefault(task, {"runs": [], "metric": result["metric"],
                                         "lower_is_better": result["lower_is_better"], "stl": [], "chance": []})
            t["runs"].append({"table": result["table"], "untrained": result["untrained"], "images": result["images"],
                              "chosen": [{k: r[k] for k in ("mode", "size", "lr", "best_step")}
                                         for r in result["rows"]]})
            t["stl"].append(stl.get(result["metric"]))
            t["chance"].append(result["chance"])
    comparisons, apart, preconditions = finetune_judgement(tables)
    sc = ctx.scale
    return {"tasks": tables, "modes": list(MODES), "fractions": list(sc.finetune_fractions),
            "comparisons": comparisons, "apart": apart, "preconditions": preconditions,
            "budget": (f"pretraining {sc.steps} steps of {sc.batch}; every fine-tune {sc.finetune_steps} AdamW steps "
                       f"of {sc.finetune_batch}"),
            "notes": [f"Pretraining: Mod-Squad on {len(ctx.tasks) - len(held)} tasks (without "
                      f"{' and '.join(held)}), {sc.steps} steps. Every mode (router, head, full, linear probe) learns "
                      f"with the same budget and rule: AdamW at a constant lr, {sc.finetune_steps} steps of "
                      f"{sc.finetune_batch} images; {sc.finetune_holdout:.0%} of a fraction's images are held out, "
                      f"the lr is the best of {', '.join(f'{v:g}' for v in sc.finetune_lrs)} on them and the weights "
                      f"kept are those of the best of {sc.finetune_evals} held-out evaluations along the fine-tune; "
                      "the chosen model is scored on the validation split.",
                      "Fractions of this data's training split (see the images row); the paper's 0.5-5 % of 3.8 M "
                      "images are 19k-190k images, which a small synthetic set does not have, so the fractions are "
                      "chosen for the image counts to differ.",
                      "A task whose single-task model (trained on the whole training split for the scale's steps) "
                      "does not beat always answering the most frequent training class is not learnable at this "
                      "scale: its comparisons are reported apart and do not count in the verdict.",
                      "Fine-tune results: runs/modsquad-without-*/finetune/<task>.json (the lr and step each mode "
                      "chose, the held-out scores per lr)."]}


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


def _usage_of(ctx: Context, spec: RunSpec) -> dict:
    run_dir = ctx.runner.ensure(spec)
    key = {"run": ctx.run_settings(spec), "tasks": ctx.tasks, "data": str(ctx.data), "batch": ctx.scale.batch,
           "device": ctx.device}

    def compute() -> dict:
        model = load_model(run_dir).to(ctx.device)
        usage = ExpertUsage(model.task_names)
        metrics = evaluate(model, ctx.val_loader(ctx.tasks), ctx.tasks, ctx.device, usage=usage)
        return {"metrics": metrics, **usage_statistics(usage, ctx.tasks)}

    return cached(run_dir / "reproduce_usage.json", key, compute)


def measure_mi_vs_balance(ctx: Context) -> dict:
    """The MI loss against a per-task balance loss: expert-use sparsity, I(T;E) and Δt (Fig. 5)."""
    variants = {"modsquad": "MI loss", "modsquad_balance": "balance loss"}
    out: dict[str, dict] = {v: {"label": label, "dt": [], "entropy": [], "experts90": [], "mi": [], "maps": None}
                            for v, label in variants.items()}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        for v in variants:
            stats = _usage_of(ctx, method_spec(ctx, v, seed))
            o = out[v]
            o["dt"].append(delta(stats["metrics"], base)["mean"])
            for k in ("entropy", "experts90", "mi"):
                o[k].append(stats[k])
            if o["maps"] is None:
                o["maps"] = {name: {"kind": layer["kind"], "share": layer["share"]}
                             for name, layer in stats["layers"].items()}
                o["experts"] = {name: layer["experts"] for name, layer in stats["layers"].items()}
    mi, bal = out["modsquad"], out["modsquad_balance"]
    comparisons = [compare("entropy of P(E|T): balance > MI (MI sparser)", bal["entropy"], mi["entropy"]),
                   compare("experts covering 90 %: balance > MI", bal["experts90"], mi["experts90"]),
                   compare("I(T;E): MI > balance (more task-specific)", mi["mi"], bal["mi"]),
                   compare(f"Δt(MI) ≥ Δt(balance) − {EQUAL_MARGIN:g}", mi["dt"], bal["dt"], "not_worse",
                           EQUAL_MARGIN)]
    return {"tasks": ctx.tasks, "variants": out, "comparisons": comparisons, "budget": _budget(ctx),
            "notes": ["Statistics from the hard expert selections of every validation image and task (the trained "
                      "models in eval mode), per routed layer (MoE attention and MoE MLP), averaged over tasks and "
                      "layers; entropy and I(T;E) in bits.",
                      f"'Equal or better' Δt: not worse than the balance loss's by more than {EQUAL_MARGIN:g} point "
                      "on any seed.",
                      "Balance loss: switch-style load balancing per task, weight 0.01, MI weight 0 "
                      "(configs/model/m3vit_vit_b.yaml's loss on the Mod-Squad model)."]}


# ------------------------------------------------------------------------------------------------ amod-table3
PLATEAU_DROP = 0.05  # the dense model is at a plateau when its training loss fell less than this over the last fifth
_LOSS_LINE = re.compile(r"step (\d+)/\d+ loss (\S+)")


def loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, mean training loss since the previous line) from a run's train.log."""
    file = run_dir / "train.log"
    rows = {}
    for line in file.read_text().splitlines() if file.is_file() else []:
        m = _LOSS_LINE.search(line)
        if m:
            try:
                rows[int(m.group(1))] = float(m.group(2))
            except ValueError:
                continue
    return sorted(rows.items())


def plateau(run_dir: Path, steps: int) -> dict:
    """The training loss's relative fall between the 4th and the last fifth of training (`PLATEAU_DROP`)."""
    curve = loss_curve(run_dir)
    late = [v for s, v in curve if s > 0.8 * steps]
    before = [v for s, v in curve if 0.6 * steps < s <= 0.8 * steps]
    if not late or not before or not all(math.isfinite(v) for v in late + before):
        return {"drop": float("nan"), "points": len(curve), "at_plateau": False}
    a, b = statistics.fmean(before), statistics.fmean(late)
    drop = (a - b) / abs(a) if a else float("nan")
    return {"drop": drop, "points": len(curve), "at_plateau": bool(math.isfinite(drop) and drop < PLATEAU_DROP),
            "loss_before": a, "loss_last": b}


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
    out: dict[str, dict] = {r: {"curves": [], "fidelity": []} for r in routings}
    dense_info = []
    for seed in ctx.seeds:
        dense_spec = amod_dense_spec(ctx, seed)
        dense_run = ctx.runner.ensure(dense_spec)
        dense = final_metrics(dense_run)
        info = plateau(dense_run, dense_spec.steps)
        info["metrics"] = primary_of(dense)
        info["curve"] = [(s, primary_of(m)) for s, m in metrics_history(dense_run)]
        dense_info.append(info)
        for r in routings:
            run = ctx.runner.ensure(amod_spec(ctx, seed, r))
            out[r]["curves"].append([(step, delta(m, dense)["mean"]) for step, m in metrics_history(run)])
            out[r]["fidelity"].append(_fidelity(ctx, dense_run, r, seed, dense_spec.tasks))
    attn, learned = out["attention"]["curves"], out["learned"]["curves"]

    def at0(curves):
        return [c[0][1] if c and c[0][0] == 0 else float("nan") for c in curves]

    def after(curves):
        return [statistics.fmean(v for s, v in c if s > 0) if any(s > 0 for s, _ in c) else float("nan")
                for c in curves]

    comparisons = [compare("no training: Δt(attention routing) > Δt(learned router)", at0(attn), at0(learned)),
                   compare("fine-tune: mean Δt over the evaluations, attention > learned", after(attn),
                           after(learned))]
    drops = ", ".join(_pct(d["drop"]) for d in dense_info)
    preconditions = [precondition("the dense model has ≥ 8 blocks", sc.amod_depth >= 8,
                                  f"depth {sc.amod_depth}"),
                     precondition(f"the dense model is at a plateau (training loss fell < {PLATEAU_DROP:.0%} over "
                                  f"the last fifth of its {sc.amod_dense_steps} steps, every seed)",
                                  all(d["at_plateau"] for d in dense_info), f"fall per seed: {drops}"),
                     precondition("the fine-tune runs ≥ 1,000 steps", sc.amod_steps >= 1000,
                                  f"{sc.amod_steps} steps")]
    tasks = ", ".join(sc.amod_tasks)
    return {"routings": out, "capacity": sc.amod_capacity, "steps": sc.amod_steps, "dense": dense_info,
            "tasks": list(sc.amod_tasks), "comparisons": comparisons, "preconditions": preconditions,
            "budget": (f"dense model {sc.amod_dense_steps} steps of {sc.batch}, fine-tune {sc.amod_steps} "
                       f"steps"),
            "notes": [f"The dense model: a ViT of {sc.amod_depth} blocks (width {sc.embed_dim}) trained on {tasks} for "
                      f"{sc.amod_dense_steps} steps of {sc.batch} images (runs/amod-dense-s*); the paper adapts a "
                      "converged ImageNet ViT. Δt against the dense model itself (0 = as good as before the change). "
                      f"MoD on every other block at capacity {sc.amod_capacity}; step 0 is the adapted model with no "
                      f"training, scored over the whole validation split. Fine-tune: {sc.amod_steps} steps at lr "
                      f"{sc.lr / 3:g} from the adapted weights (runs/amod-*-finetune-s*).",
                      "Fidelity: agreement with the dense model over the whole validation split before any training "
                      "(`squad.posttrain.adapt.fidelity`): top-1 agreement of the class head and the cosine of the "
                      "final tokens.",
                      "Preconditions of a fair test (the issue's design): ≥ 8 blocks, a dense model at a plateau, a "
                      "fine-tune of ≥ 1,000 steps; tiny scale meets none of them (plumbing only)."]}


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %" if v is not None and math.isfinite(v) else "–"


# ------------------------------------------------------------------------------------------------ mone-budget
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


CLOSE = 2.0  # percent of Δt: "close to the fixed-budget model" (mone-budget)


def measure_mone(ctx: Context) -> dict:
    """The adaptive MoNE model (e_c drawn per step, iso-FLOPs) vs fixed-e_c models, at every e_c, with forward
    times (Fig. 5)."""
    fixed = list(ctx.scale.mone_fixed)
    if 1.0 not in fixed:
        raise ValueError("mone-budget: the fixed e_c must include 1.0 (the baseline of Δt)")
    sampled = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in fixed}
    fixed_out = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in fixed}
    adaptive_steps = ctx.scale.steps
    for seed in ctx.seeds:
        fixed_eval = {f"{c:g}": _mone_eval(ctx, mone_spec(ctx, seed, c), [c])[f"{c:g}"] for c in fixed}
        base = fixed_eval["1"]["metrics"]
        s_eval = _mone_eval(ctx, mone_spec(ctx, seed, None), fixed)
        for table, evals in ((sampled, s_eval), (fixed_out, fixed_eval)):
            for key, row in table.items():
                row["dt"].append(delta(evals[key]["metrics"], base)["mean"])
                row["forward_s"].append(evals[key]["forward_s"])
                row["macs"].append(evals[key]["macs"])
    comparisons = [compare(f"e_c {k}: Δt(adaptive model) ≥ Δt(fixed e_c {k}) − {CLOSE:g}", sampled[k]["dt"],
                           fixed_out[k]["dt"], "not_worse", CLOSE) for k in fixed_out if k != "1"]
    keys = [f"{c:g}" for c in sorted(fixed)]
    comparisons += [compare(f"forward time at e_c {hi} > at e_c {lo}", sampled[hi]["forward_s"],
                            sampled[lo]["forward_s"]) for lo, hi in zip(keys, keys[1:], strict=False)]
    grid = ", ".join(f"{c:g}" for c in ctx.scale.mone_grid)
    return {"grid": list(ctx.scale.mone_grid), "fixed": fixed, "sampled": sampled, "fixed_models": fixed_out,
            "adaptive_steps": adaptive_steps, "comparisons": comparisons,
            "budget": f"fixed e_c: {ctx.scale.steps} steps, adaptive: {adaptive_steps} (iso-FLOPs)",
            "notes": [f"Δt against the model trained at the fixed e_c 1 (same seed), over the validation split; "
                      f"'close' means not worse by more than {CLOSE:g} points of Δt on any seed. The adaptive model "
                      f"drew e_c from {grid} at every step (the MoNE paper's grid; model.mone.sample_capacity) for "
                      f"{adaptive_steps} steps: the training FLOPs of {ctx.scale.steps} steps at e_c 1 (iso-FLOPs, "
                      "as the paper's adaptive model), from scratch. The fixed-budget models trained "
                      f"{ctx.scale.steps} steps each. At e_c 1 (outside the grid it trained on) the adaptive model "
                      "is shown, not compared.",
                      "Forward time: the fastest of repeated fused passes over one validation batch with every task, "
                      "in eval mode; MACs per image and task at that e_c (`squad.profile`)."]}


# ------------------------------------------------------------------------------------------------ pascal-table3
PASCAL_SHARE = SHARE  # the pruned model's parameters / the full model's (like with like), at most (paper: 22/50 M)


def _pascal_specs(ctx: Context) -> list[RunSpec]:
    pctx = pascal_ctx(ctx)
    return [s for seed in ctx.seeds for s in [*(pascal_spec(pctx, "pascal_stl", seed, t) for t in pctx.tasks),
                                              *(pascal_spec(pctx, f, seed) for f in PASCAL_METHODS)]]


def _extracted_macs(ctx: Context, table: dict, label: str) -> float:
    """MACs per image of the extracted models of ``label`` (mean over tasks)."""
    macs = []
    for row in table["tasks"].values():
        prof = profile(load_extracted(ctx.out / row["extracted"][label]["file"]).model)
        macs.append(statistics.fmean(v["macs"] for v in prof["tasks"].values()))  # its one task
    return statistics.fmean(macs)


def measure_pascal(ctx: Context) -> dict:
    """Mod-Squad Table 3 on the synthetic PASCAL-Context: STL, MTL, Mod-Squad and the pruned Mod-Squad."""
    pctx = pascal_ctx(ctx)
    tasks = pctx.tasks
    theta = f"θ={PASCAL_THETA:g}"
    top = f"top {pctx.scale.keep_top:.0%}"
    labels = {"stl": "STL (one model per task)", "pascal_mtl": "MTL", "pascal_modsquad": "Mod-Squad",
              "pruned": f"Mod-Squad pruned ({theta})", "pruned_top": f"Mod-Squad pruned ({top} of experts)"}
    methods: dict[str, dict] = {k: {"label": v, "dm": [], "per_task": [], "metrics": []} for k, v in labels.items()}
    full_again = []
    shares: dict[str, dict[str, list]] = {"pruned": {}, "pruned_top": {}}
    tables = {}
    for seed in ctx.seeds:
        base = {}
        for t in tasks:
            base[t] = final_metrics(ctx.runner.ensure(pascal_spec(pctx, "pascal_stl", seed, t)))[t]
        methods["stl"]["metrics"].append(primary_of(base))
        methods["stl"]["dm"].append(0.0)
        methods["stl"]["per_task"].append({t: 0.0 for t in tasks})
        for f in PASCAL_METHODS:
            metrics = final_metrics(ctx.runner.ensure(pascal_spec(pctx, f, seed)))
            d = delta(metrics, base)
            methods[f]["dm"].append(d["mean"])
            methods[f]["per_task"].append(d["per_task"])
            methods[f]["metrics"].append(primary_of(metrics))
        table = _extraction_table(pctx, pascal_spec(pctx, "pascal_modsquad", seed))
        tables[seed] = table
        full_again.append(delta({t: r["full"] for t, r in table["tasks"].items()}, base)["mean"])
        for key, label in (("pruned", theta), ("pruned_top", top)):
            ext = {t: r["extracted"][label]["metrics"] for t, r in table["tasks"].items()}
            d = delta(ext, base)
            methods[key]["dm"].append(d["mean"])
            methods[key]["per_task"].append(d["per_task"])
            methods[key]["metrics"].append(primary_of(ext))
            for k, v in _shares(table, label).items():
                shares[key].setdefault(k, []).append(v)
    seed0 = ctx.seeds[0]
    stl_specs_ = [pascal_spec(pctx, "pascal_stl", seed0, t) for t in tasks]
    stl_sizes = [_size(ctx.runner.path(s), s.tasks) for s in stl_specs_]
    stl_costs = [pctx.cost(s) for s in stl_specs_]
    peaks = finite([c["peak_mib"] for c in stl_costs])
    methods["stl"].update(params=sum(s["params"] for s in stl_sizes),
                          params_each=statistics.fmean(s["params"] for s in stl_sizes),
                          macs=statistics.fmean(s["macs"] for s in stl_sizes),
                          step_s=sum(c["step_s"] for c in stl_costs),
                          cpu_s=sum(c.get("cpu_s", float("nan")) for c in stl_costs),
                          peak_mib=max(peaks) if peaks else None)
    for f in PASCAL_METHODS:
        spec = pascal_spec(pctx, f, seed0)
        cost = pctx.cost(spec)
        methods[f].update(**_size(ctx.runner.path(spec), tasks), step_s=cost["step_s"], cpu_s=cost.get("cpu_s"),
                          peak_mib=cost["peak_mib"])
    table0 = tables[seed0]
    for key, label in (("pruned", theta), ("pruned_top", top)):
        methods[key].update(params=statistics.fmean(r["extracted"][label]["params"]
                                                    for r in table0["tasks"].values()),
                            params_per_task={t: r["extracted"][label]["params"] for t, r in table0["tasks"].items()},
                            macs=_extracted_macs(ctx, table0, label), step_s=None, cpu_s=None, peak_mib=None,
                            **shares[key])
    for m in methods.values():
        m["dm_summary"] = spread(m["dm"])
    n = len(ctx.seeds)
    dm = {k: m["dm"] for k, m in methods.items()}
    comparisons = [compare("Δm(Mod-Squad) > 0 (better than STL)", dm["pascal_modsquad"], [0.0] * n),
                   compare("Δm(Mod-Squad) > Δm(MTL)", dm["pascal_modsquad"], dm["pascal_mtl"]),
                   compare(f"Δm(pruned, {theta}) ≥ Δm(Mod-Squad) − {EQUAL_MARGIN:g}", dm["pruned"], full_again,
                           "not_worse", EQUAL_MARGIN),
                   compare(f"parameters(pruned, {theta}) / parameters(Mod-Squad with the task's head only) ≤ "
                           f"{PASCAL_SHARE:.2f}, largest over tasks", shares["pruned"]["ratio_max"],
                           [PASCAL_SHARE] * n, "at_most")]
    memory = pctx.cost(pascal_spec(pctx, "pascal_mtl", seed0))["memory"]
    sc = pctx.scale
    return {"tasks": tasks, "methods": methods, "comparisons": comparisons, "theta": PASCAL_THETA,
            "full_dm": full_again, "memory": memory, "budget": f"{sc.steps} steps of {sc.batch} images per run",
            "scale": {"img_size": sc.img_size, "steps": sc.steps, "batch": sc.batch, "images": sc.images,
                      "data": str(pctx.data)},
            "paper": {"params": 50e6, "macs": 5.2e9, "pruned_params": 22e6, "dm": 4.72,
                      "metrics": {"semseg": 74.1, "human_parts": 62.7, "saliency": 66.9, "normals": 13.7,
                                  "edge": 72.0}},
            "notes": [f"Data: the synthetic PASCAL-Context (squad.data.synthetic.pascal, PASCAL_MT layout read by "
                      f"the real reader), {sc.images} images at {sc.img_size} px (long side; train/val split as "
                      f"PASCAL-Context's, about half each), packed into HDF5 shards ({pctx.data}); every run "
                      f"{sc.steps} steps of {sc.batch} images, the widths of the scale.",
                      "Δm is the multi-task literature's name for Δt: the mean over the 5 tasks of each task's "
                      "relative gain on its primary metric against the STL model of the same seed, in percent, with "
                      "each metric's direction (semseg and human_parts mIoU, saliency maxF, edge odsF: higher is "
                      "better; normals mean angle error: lower is better). A task whose STL metric is 0 or missing "
                      "(e.g. human_parts with no person in the validation images) is left out of the mean. The "
                      "paper's headline is Mod-Squad's Δm of +4.72 against STL (Table 3).",
                      f"Pruned: every task extracted from the trained Mod-Squad at θ = {PASCAL_THETA:g} (experts "
                      "used by less than 1 % of the task's selections removed, the paper's main runs; no "
                      "fine-tuning), usage from a calibration pass over "
                      f"{sc.calib_batches} training batches per task. Parameter share like with like: each task's "
                      "extracted model against the full model with that task's head only (mean and largest over "
                      "tasks; the bound is tested on the largest); the paper's count (against the 5-task model with "
                      "every head, as its 22 M / 50 M) beside. The top-"
                      f"{sc.keep_top:.0%} row keeps that share of the experts per layer instead. The 'full' Δm of the "
                      "pruned comparison is the full model scored by the same evaluation "
                      f"(runs/pascal-modsquad-s*/extracted/); 'equal' means not worse by more than {EQUAL_MARGIN:g} "
                      "point on any seed.",
                      "Paper (real PASCAL-Context, ViT-S at 512 px, M3ViT's decoders): Mod-Squad 50 M parameters, "
                      "5.2 GMACs, 74.1 / 62.7 / 66.9 / 13.7 / 72.0 (semseg / parts / saliency / normals / edge); "
                      "pruned 22 M at the same metrics. The synthetic data's absolute values are not comparable.",
                      f"STL parameters are the sum of its {len(tasks)} models; its step time the sum of one step of "
                      f"each; MACs are per image and task (`squad.profile`); step time (the fastest of "
                      f"{sc.cost_steps} steps) and peak memory ({memory}) from one batch of {sc.batch} images."]}


CLAIMS: dict[str, Claim] = {c.name: c for c in [
    Claim("modsquad-table2", "Mod-Squad (Chen et al., CVPR 2023), Table 2",
          "Δt(Mod-Squad) > Δt(M3ViT) > Δt(MTL) > 0 against single-task models (the cost side is reported beside; "
          "an MTL + task embedding control apart).",
          _table2_specs, measure_table2),
    Claim("pruning", "Mod-Squad, Table 2 (pruned row) and Fig. 3",
          "At θ = 0.01 the extracted single-task models keep the full model's Δt with ≤ 60 % of its parameters "
          "(counted like with like: each with the task's head only).",
          lambda ctx: [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), method_spec(ctx, "modsquad", seed)]],
          measure_pruning),
    Claim("router-finetune", "Mod-Squad, Fig. 4",
          "Learning a new task from little data, fine-tuning only its routers (and head) beats training the head, "
          "the whole model, or a linear probe, at every data fraction (same budget and stopping rule for every "
          "mode).",
          lambda ctx: [s for seed in ctx.seeds for s in [pretrain_spec(ctx, seed),
                                                          *(stl_spec(ctx, t, seed) for t in held_out(ctx))]],
          measure_router_finetune, finetune_jobs),
    Claim("mi-vs-balance", "Mod-Squad, Fig. 5 and §4.4",
          "The mutual-information loss gives sparser, more task-specific expert use than a per-task balance loss, "
          "at equal or better Δt.",
          lambda ctx: [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), method_spec(ctx, "modsquad", seed),
                                                          method_spec(ctx, "modsquad_balance", seed)]],
          measure_mi_vs_balance),
    Claim("amod-table3", "A-MoD (Gadhikar et al., 2024), Table 3",
          "Turning a trained dense model into MoD, attention routing keeps far more of its metric with no training "
          "than a learned router, and recovers faster when fine-tuned.",
          lambda ctx: [s for seed in ctx.seeds for s in [amod_dense_spec(ctx, seed), amod_spec(ctx, seed,
                                                         "attention"), amod_spec(ctx, seed, "learned")]],
          measure_amod),
    Claim("mone-budget", "MoNE (Jain et al., NeurIPS 2024), Fig. 5",
          "One model trained with e_c sampled per step serves every compute budget close to models trained at that "
          "budget, and its forward time falls with e_c.",
          lambda ctx: [s for seed in ctx.seeds for s in [*(mone_spec(ctx, seed, c) for c in ctx.scale.mone_fixed),
                                                          mone_spec(ctx, seed, None)]],
          measure_mone),
    Claim("pascal-table3", "Mod-Squad, Table 3 (PASCAL-Context)",
          "On PASCAL-Context's 5 tasks, Mod-Squad beats single-task models (Δm > 0; the paper: +4.72) and MTL, and "
          "the pruned model (every task extracted at θ = 0.01) keeps its Δm with ≤ 60 % of the parameters "
          "(the paper: 50 M → 22 M at the same metrics).",
          _pascal_specs, measure_pascal),
]}


def resolve_claims(names: Sequence[str]) -> list[str]:
    """Claim names in the order given (``all``: every claim), without repeats.

    Raises:
        ValueError: an unknown name (the claims are listed).
    """
    out: list[str] = []
    for name in names:
        if name == "all":
            out.extend(CLAIMS)
        elif name in CLAIMS:
            out.append(name)
        else:
            raise ValueError(f"unknown claim {name!r}; claims: {', '.join(CLAIMS)}, all")
    return list(dict.fromkeys(out))
