"""The claims tools/reproduce.py measures: one function per claim, each returning plain data for the report.

Every claim trains (or finds) its runs through a `Context` (`squad.reproduce.runs.Runner`), measures what the paper
measured with squad's own post-training code, and judges the claim by `squad.reproduce.verdicts.verdict` from
paired per-seed comparisons:

* ``modsquad-table2`` (Mod-Squad Table 2): STL, MTL, M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad; Δt
  against STL per task and mean, parameters and MACs (`squad.analysis.flops.profile`), seconds per training step and
  peak training memory (`squad.reproduce.runs.measure_cost`). Claim: Δt(Mod-Squad) > Δt(M3ViT) > Δt(MTL) > 0.
* ``pruning`` (Table 2's pruned row, Fig. 3): every task extracted from Mod-Squad (`squad.posttrain.extract`, usage
  from a calibration pass) at each θ and at keep-top 40 %; parameters vs Δt. Claim: at θ = 0.01 Δt stays within
  noise of the full model with ≤ 60 % of its parameters.
* ``router-finetune`` (Fig. 4): Mod-Squad pretrained without class_object and class_scene, each learned from 0.5,
  1, 2, 5 % of its data in the router, head, full and linear-probe modes (`squad.posttrain.finetune.finetune_table`).
  Claim: router fine-tuning wins at every fraction.
* ``mi-vs-balance`` (Fig. 5): Mod-Squad with its MI loss and with a per-task switch balance loss instead; from the
  expert selections on the validation split (`squad.models.usage.ExpertUsage`): experts covering 90 % of a task's
  selections, entropy of P(E|T), I(T;E), and Δt. Claim: MI gives sparser, more task-specific expert use at equal or
  better Δt.
* ``amod-table3`` (A-MoD Table 3): the trained MTL model turned into MoD at capacity 0.5 on every other block
  (`squad.posttrain.adapt.to_mod`) with attention routing and with a learned router, scored with no training and
  along a short fine-tune. Claim: attention routing keeps far more with no training and recovers faster.
* ``mone-budget`` (MoNE Fig. 5): a MoNE model trained with e_c sampled per step (``model.mone.sample_capacity``)
  evaluated at e_c 0.2 … 1.0 beside models trained at a fixed e_c, with the forward time measured per e_c. Claim:
  one model serves every budget close to the fixed-budget models, and time falls with e_c.
* ``pascal-table3`` (Mod-Squad Table 3): on the synthetic PASCAL-Context (its own data, the 5 tasks; the scale's
  `squad.reproduce.scales.pascal_scale`), STL, MTL, Mod-Squad and the pruned Mod-Squad (every task extracted at
  θ = 0.01, the paper's main setting); Δm against STL per seed, parameters and MACs (full vs pruned), step time and
  peak memory. Claim: Δm(Mod-Squad) > Δm(MTL), and the pruned models stay within noise of the full one with ≤ 60 % of
  its parameters (the paper: 50 M → 22 M at the same metrics).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from squad.analysis.flops import profile
from squad.config.base import to_dict
from squad.data import build_dataset, eval_loader
from squad.eval.evaluate import evaluate
from squad.io import load_extracted, load_model, save_extracted
from squad.models.inference import set_inference
from squad.models.usage import ExpertUsage
from squad.posttrain.adapt import fidelity, to_mod
from squad.posttrain.extract import collect_usage, extract
from squad.posttrain.finetune import MODES, FinetuneConfig, finetune_table
from squad.reproduce.runs import FAMILIES, Runner, RunSpec, final_metrics, measure_cost, metrics_history, run_config
from squad.reproduce.scales import HELD_OUT, PASCAL_THETA, Scale, pascal_scale
from squad.reproduce.verdicts import RULE, VERDICTS, compare, delta, finite, primary_of, spread, verdict
from squad.tasks import get_task

__all__ = ["CLAIMS", "RULE", "VERDICTS", "Claim", "Context", "compare", "resolve_claims", "spread", "verdict"]

# ---------------------------------------------------------------------------------------------- context
@dataclasses.dataclass
class Context:
    """What every claim shares: the scale, the seeds, the data, the output folder and the runner."""

    scale: Scale
    seeds: list[int]
    data: Path
    out: Path
    runner: Runner
    device: str = "cpu"
    _warm: bool = False
    pascal: Scale | None = None  # pascal-table3's scale (default: `pascal_scale` of ``scale``)
    pascal_data: Path | None = None  # pascal-table3's PASCAL-Context root (default: OUT/data/pascal_shards)

    @property
    def tasks(self) -> list[str]:
        return list(self.scale.tasks)

    def cache_file(self, name: str) -> Path:
        return self.out / "cache" / name

    def cost(self, spec: RunSpec) -> dict:
        """`measure_cost` of a run's model, kept in ``cache/cost.json`` (measured once per output folder)."""
        file = self.cache_file("cost.json")
        table = json.loads(file.read_text()) if file.is_file() else {}
        key = f"{spec.family}:{','.join(spec.train_tasks or spec.tasks)}:{json.dumps(spec.model, sort_keys=True)}"
        if key not in table:
            cfg = run_config(spec, self.scale, self.data)
            if not self._warm:  # the process's first training step allocates for good: not counted
                measure_cost(cfg, 1, self.device)
                self._warm = True
            table[key] = measure_cost(cfg, self.scale.cost_steps, self.device)
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps(table, indent=2) + "\n")
        return table[key]

    def val_loader(self, tasks: Sequence[str], split: str = "val", batch: int | None = None):
        ds = build_dataset(self.data, list(tasks), split, image_size=self.scale.img_size, augment=False)
        return eval_loader(ds, batch or self.scale.batch)


# ------------------------------------------------------------------------------------------------- specs
def _slug(family: str) -> str:
    return family.replace("_", "-")


def method_spec(ctx: Context, family: str, seed: int, **kw) -> RunSpec:
    return RunSpec(f"{_slug(family)}-s{seed}", family, seed, ctx.tasks, ctx.scale.steps, **kw)


def stl_spec(ctx: Context, task: str, seed: int) -> RunSpec:
    return RunSpec(f"stl-{task}-s{seed}", "stl", seed, [task], ctx.scale.steps)


def stl_specs(ctx: Context, seed: int) -> list[RunSpec]:
    return [stl_spec(ctx, t, seed) for t in ctx.tasks]


def pretrain_spec(ctx: Context, seed: int) -> RunSpec:
    held = [t for t in HELD_OUT if t in ctx.tasks]
    return RunSpec(f"modsquad-without-{'-'.join(h.replace('class_', '') for h in held)}-s{seed}", "modsquad", seed,
                   ctx.tasks, ctx.scale.steps, train_tasks=[t for t in ctx.tasks if t not in held])


def mone_spec(ctx: Context, seed: int, e_c: float | None) -> RunSpec:
    """The MoNE run with e_c sampled per step from the grid (``e_c=None``) or trained at a fixed e_c."""
    grid = list(ctx.scale.mone_grid)
    if e_c is None:
        return RunSpec(f"mone-sampled-s{seed}", "mone", seed, ctx.tasks, ctx.scale.steps,
                       model={"mone": {"capacity": statistics.median(grid), "sample_capacity": grid}})
    return RunSpec(f"mone-ec{e_c:g}-s{seed}", "mone", seed, ctx.tasks, ctx.scale.steps,
                   model={"mone": {"capacity": e_c}})


def amod_spec(ctx: Context, seed: int, routing: str) -> RunSpec:
    """The fine-tune of the MTL model turned into MoD (``routing`` attention or learned), from the adapted weights."""
    dense_run = ctx.runner.path(method_spec(ctx, "mtl", seed))
    scale = ctx.scale

    def init() -> tuple[dict, dict]:

        dense = load_model(dense_run)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a learned router's fresh initialisation
            adapted = to_mod(dense, scale.amod_capacity, routing, every=2)
        return to_dict(adapted.cfg), {k: v.detach().clone() for k, v in adapted.state_dict().items()}

    return RunSpec(f"amod-{routing}-finetune-s{seed}", "mod", seed, ctx.tasks, scale.amod_steps,
                   evals=scale.amod_evals, init=init, lr=scale.lr / 3, warmup=0)


# ------------------------------------------------------------------------------------------------- claims
@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim: what the paper says, where, the runs it needs, and the function that measures it."""

    name: str
    source: str
    statement: str
    specs: Callable[[Context], list[RunSpec]]
    measure: Callable[[Context], dict]


TABLE2_METHODS = ("mtl", "m3vit", "moe_mlp", "moe_attn", "modsquad")


def _table2_specs(ctx: Context) -> list[RunSpec]:
    return [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), *(method_spec(ctx, f, seed)
                                                                       for f in TABLE2_METHODS)]]


def _baseline(ctx: Context, seed: int) -> dict[str, dict[str, float]]:
    """Every task's STL metrics for a seed (training the STL runs if needed)."""
    out = {}
    for spec in stl_specs(ctx, seed):
        out[spec.tasks[0]] = final_metrics(ctx.runner.ensure(spec))[spec.tasks[0]]
    return out


def _size(run_dir: Path, tasks: Sequence[str]) -> dict:

    prof = profile(load_model(run_dir), tasks)
    return {"params": prof["params"], "macs": statistics.fmean(prof["tasks"][t]["macs"] for t in tasks)}


def measure_table2(ctx: Context) -> dict:
    """Mod-Squad Table 2 at this scale."""
    methods: dict[str, dict] = {"stl": {"label": "STL (one model per task)", "dt": [], "per_task": [],
                                        "metrics": []}}
    for f in TABLE2_METHODS:
        methods[f] = {"label": FAMILIES[f].label, "dt": [], "per_task": [], "metrics": []}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        methods["stl"]["metrics"].append(primary_of(base))
        methods["stl"]["dt"].append(0.0)
        methods["stl"]["per_task"].append({t: 0.0 for t in ctx.tasks})
        for f in TABLE2_METHODS:
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
    for f in TABLE2_METHODS:
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
    memory = ctx.cost(method_spec(ctx, "mtl", seed0))["memory"]
    return {"tasks": ctx.tasks, "methods": methods, "comparisons": comparisons, "memory": memory,
            "notes": [f"STL parameters are the sum of its {len(ctx.tasks)} models (each "
                      f"{methods['stl']['params_each']:,.0f}); its step time is the sum of one step of each model; "
                      f"its peak memory the largest of them.",
                      f"MACs are per image and task (`squad.profile`); step time (wall, the fastest of "
                      f"{ctx.scale.cost_steps} steps; CPU: this process's CPU seconds) and peak memory come from one "
                      f"batch of {ctx.scale.batch} images with every task, measured in this invocation (peak memory: "
                      f"{memory})."]}


def _extraction_table(ctx: Context, run_dir: Path) -> dict:
    """Every task extracted at every criterion, scored on the validation split (cached in the run folder)."""

    criteria = [(f"θ={t:g}", {"theta": t}) for t in ctx.scale.thetas] + \
               [(f"top {ctx.scale.keep_top:.0%}", {"theta": None, "keep_top": ctx.scale.keep_top})]
    file = run_dir / "extracted" / "pruning.json"
    if file.is_file():
        cached = json.loads(file.read_text())
        if cached.get("criteria") == [c[0] for c in criteria] and set(cached["tasks"]) == set(ctx.tasks):
            return cached
    model = load_model(run_dir).to(ctx.device)
    full_params = profile(model)["params"]
    table: dict = {"criteria": [c[0] for c in criteria], "full_params": full_params, "tasks": {}}
    for task in ctx.tasks:
        calib = build_dataset(ctx.data, [task], "train", image_size=ctx.scale.img_size, augment=False)
        usage = collect_usage(model, task, eval_loader(calib, ctx.scale.batch), ctx.scale.calib_batches, ctx.device)
        loader = ctx.val_loader([task])
        row = {"full": evaluate(model, loader, [task], ctx.device)[task], "extracted": {}}
        for label, kw in criteria:
            ext = extract(model, task, usage, **kw)
            metrics = evaluate(ext.model, loader, [task], ctx.device)[task]
            params = profile(ext.model)["params"]
            path = run_dir / "extracted" / f"{task}_{label.replace('θ=', 'theta').replace(' ', '').replace('%', '')}.pt"
            save_extracted(path, ext, {"task": task, "criterion": kw, "metrics": {"split": "val", "extracted":
                                                                                   metrics}})
            row["extracted"][label] = {"metrics": metrics, "params": params, "ratio": params / full_params,
                                       "file": str(path.relative_to(ctx.out))}
        table["tasks"][task] = row
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(table, indent=2) + "\n")
    return table


def measure_pruning(ctx: Context) -> dict:
    """Extraction at every θ and at keep-top: parameters vs Δt (Table 2's pruned row, Fig. 3)."""
    points: dict[str, dict[str, list]] = {}
    full = {"dt": [], "ratio": []}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        table = _extraction_table(ctx, ctx.runner.ensure(method_spec(ctx, "modsquad", seed)))
        full["dt"].append(delta({t: r["full"] for t, r in table["tasks"].items()}, base)["mean"])
        full["ratio"].append(1.0)
        for label in table["criteria"]:
            p = points.setdefault(label, {"dt": [], "ratio": [], "params": [], "per_task_ratio": []})
            ext = {t: r["extracted"][label] for t, r in table["tasks"].items()}
            p["dt"].append(delta({t: e["metrics"] for t, e in ext.items()}, base)["mean"])
            p["ratio"].append(statistics.fmean(e["ratio"] for e in ext.values()))
            p["params"].append(statistics.fmean(e["params"] for e in ext.values()))
            p["per_task_ratio"].append({t: e["ratio"] for t, e in ext.items()})
    key = "θ=0.01" if "θ=0.01" in points else next(iter(points))
    n = len(ctx.seeds)
    comparisons = [compare(f"Δt(extracted, {key}) ≥ Δt(full model)", points[key]["dt"], full["dt"], "not_worse"),
                   compare(f"parameters(extracted, {key}) / parameters(full) ≤ 0.60", points[key]["ratio"],
                           [0.6] * n, "at_most")]
    return {"criteria": list(points), "points": points, "full": full, "comparisons": comparisons,
            "notes": ["Parameters: each extracted single-task model against the full multi-task model, mean over "
                      "tasks. Expert usage for extraction from a calibration pass over "
                      f"{ctx.scale.calib_batches} training batches per task; exact routing (the kept experts' "
                      "original router scores).",
                      "The extracted models are in runs/modsquad-s*/extracted/ (open them with squad.load)."]}


def measure_router_finetune(ctx: Context) -> dict:
    """Router / head / full / linear-probe fine-tuning of the held-out tasks on little data (Fig. 4)."""

    held = [t for t in HELD_OUT if t in ctx.tasks]
    tables: dict[str, dict] = {t: {"runs": [], "metric": get_task(t).primary_metric,
                                   "lower_is_better": get_task(t).lower_is_better} for t in held}
    for seed in ctx.seeds:
        run_dir = ctx.runner.ensure(pretrain_spec(ctx, seed))
        for task in held:
            out = run_dir / "finetune" / f"{task}.json"
            fractions = list(ctx.scale.finetune_fractions)
            result = json.loads(out.read_text()) if out.is_file() else None
            if result is None or sorted({r["fraction"] for r in result["runs"]}) != sorted(fractions):
                cfg = FinetuneConfig(steps=ctx.scale.finetune_steps, batch_size=ctx.scale.finetune_batch,
                                     lr=ctx.scale.finetune_lr, seed=seed, device=ctx.device)
                result = finetune_table(load_model(run_dir), task, ctx.data, modes=MODES, fractions=fractions, cfg=cfg,
                                        save_dir=run_dir / "finetune", out=out)
            tables[task]["runs"].append({"table": result["table"], "untrained": result["untrained"],
                                         "images": {r["size"]: r["train_images"] for r in result["runs"]}})
    comparisons = []
    for task, t in tables.items():
        sign = -1.0 if t["lower_is_better"] else 1.0
        sizes = list(t["runs"][0]["table"]["router"])
        for size in sizes:
            router = [sign * r["table"]["router"][size] for r in t["runs"]]
            for mode in MODES:
                if mode == "router":
                    continue
                other = [sign * r["table"][mode][size] for r in t["runs"]]
                comparisons.append(compare(f"{task} at {float(size):.1%}: router better than {mode}", router, other))
    return {"tasks": tables, "modes": list(MODES), "fractions": list(ctx.scale.finetune_fractions),
            "comparisons": comparisons,
            "notes": [f"Pretraining: Mod-Squad on {len(ctx.tasks) - len(held)} tasks (without "
                      f"{' and '.join(held)}); each fine-tune {ctx.scale.finetune_steps} steps of "
                      f"{ctx.scale.finetune_batch} images (linear probe: L-BFGS), scored on the validation split. "
                      "Fine-tuned models: runs/modsquad-without-*/finetune/."]}


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


def _usage_of(ctx: Context, run_dir: Path) -> dict:
    file = run_dir / "reproduce_usage.json"
    if file.is_file():
        return json.loads(file.read_text())

    model = load_model(run_dir).to(ctx.device)
    usage = ExpertUsage(model.task_names)
    metrics = evaluate(model, ctx.val_loader(ctx.tasks), ctx.tasks, ctx.device, usage=usage)
    out = {"metrics": metrics, **usage_statistics(usage, ctx.tasks)}
    file.write_text(json.dumps(out) + "\n")
    return out


def measure_mi_vs_balance(ctx: Context) -> dict:
    """The MI loss against a per-task balance loss: expert-use sparsity, I(T;E) and Δt (Fig. 5)."""
    variants = {"modsquad": "MI loss", "modsquad_balance": "balance loss"}
    out: dict[str, dict] = {v: {"label": label, "dt": [], "entropy": [], "experts90": [], "mi": [], "maps": None}
                            for v, label in variants.items()}
    for seed in ctx.seeds:
        base = _baseline(ctx, seed)
        for v in variants:
            stats = _usage_of(ctx, ctx.runner.ensure(method_spec(ctx, v, seed)))
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
                   compare("Δt(MI) ≥ Δt(balance)", mi["dt"], bal["dt"], "not_worse")]
    return {"tasks": ctx.tasks, "variants": out, "comparisons": comparisons,
            "notes": ["Statistics from the hard expert selections of every validation image and task (the trained "
                      "models in eval mode), per routed layer (MoE attention and MoE MLP), averaged over tasks and "
                      "layers; entropy and I(T;E) in bits.",
                      "Balance loss: switch-style load balancing per task, weight 0.01, MI weight 0 "
                      "(configs/model/m3vit_vit_b.yaml's loss on the Mod-Squad model)."]}


@torch.no_grad()
def _fidelity(ctx: Context, dense_run: Path, routing: str, seed: int) -> dict:

    dense = load_model(dense_run)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = to_mod(dense, ctx.scale.amod_capacity, routing, every=2).eval()
    batch = next(iter(ctx.val_loader(ctx.tasks)))
    task = "class_object" if "class_object" in ctx.tasks else ctx.tasks[0]
    f = fidelity(adapted, dense, batch["rgb"], task)
    return {"task": task, "top1_agreement": f.top1_agreement, "feature_cosine": f.feature_cosine}


def measure_amod(ctx: Context) -> dict:
    """Dense → MoD with attention routing and a learned router: no training, then a short fine-tune (Table 3)."""
    routings = ("attention", "learned")
    out: dict[str, dict] = {r: {"curves": [], "fidelity": []} for r in routings}
    for seed in ctx.seeds:
        dense_run = ctx.runner.ensure(method_spec(ctx, "mtl", seed))
        dense = final_metrics(dense_run)
        for r in routings:
            run = ctx.runner.ensure(amod_spec(ctx, seed, r))
            out[r]["curves"].append([(step, delta(m, dense)["mean"]) for step, m in metrics_history(run)])
            out[r]["fidelity"].append(_fidelity(ctx, dense_run, r, seed))
    attn, learned = out["attention"]["curves"], out["learned"]["curves"]

    def at0(curves):
        return [c[0][1] if c and c[0][0] == 0 else float("nan") for c in curves]

    def after(curves):
        return [statistics.fmean(v for s, v in c if s > 0) if any(s > 0 for s, _ in c) else float("nan")
                for c in curves]

    comparisons = [compare("no training: Δt(attention routing) > Δt(learned router)", at0(attn), at0(learned)),
                   compare("fine-tune: mean Δt over the evaluations, attention > learned", after(attn),
                           after(learned))]
    return {"routings": out, "capacity": ctx.scale.amod_capacity, "steps": ctx.scale.amod_steps,
            "comparisons": comparisons,
            "notes": [f"Δt against the trained dense MTL model itself (0 = as good as before the change). MoD on "
                      f"every other block at capacity {ctx.scale.amod_capacity}; step 0 is the adapted model with no "
                      f"training. Fine-tune: {ctx.scale.amod_steps} steps at lr {ctx.scale.lr / 3:g} from the "
                      "adapted weights (runs/amod-*-finetune-s*).",
                      "Fidelity: agreement with the dense model on one validation batch before any training "
                      "(`squad.posttrain.adapt.fidelity`)."]}


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


def _mone_eval(ctx: Context, run_dir: Path, capacities: Sequence[float]) -> dict:
    """Metrics, MACs and forward time of a MoNE run at each e_c (cached in the run folder)."""
    file = run_dir / "reproduce_mone.json"
    keys = [f"{c:g}" for c in capacities]
    cached = json.loads(file.read_text()) if file.is_file() else {}
    if all(k in cached for k in keys):
        return cached

    model = load_model(run_dir).to(ctx.device)
    loader = ctx.val_loader(ctx.tasks)
    images = next(iter(loader))["rgb"].to(ctx.device)
    for c, key in zip(capacities, keys, strict=True):
        if key in cached:
            continue
        set_inference(model, mone_capacity=c)
        prof = profile(model, ctx.tasks, mone_capacity=c)
        cached[key] = {"metrics": evaluate(model, loader, ctx.tasks, ctx.device),
                       "macs": statistics.fmean(prof["tasks"][t]["macs"] for t in ctx.tasks),
                       "forward_s": _forward_seconds(model, images, ctx.tasks, ctx.scale.time_repeats),
                       "images": int(images.shape[0])}
    file.write_text(json.dumps(cached, indent=2) + "\n")
    return cached


CLOSE = 2.0  # percent of Δt: "close to the fixed-budget model" (mone-budget)


def measure_mone(ctx: Context) -> dict:
    """One MoNE model with e_c sampled per step vs fixed-e_c models, at every e_c, with forward times (Fig. 5)."""
    grid = list(ctx.scale.mone_grid)
    fixed = list(ctx.scale.mone_fixed)
    if 1.0 not in fixed:
        raise ValueError("mone-budget: the fixed e_c must include 1.0 (the baseline of Δt)")
    sampled = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in grid}
    fixed_out = {f"{c:g}": {"dt": [], "forward_s": [], "macs": []} for c in fixed}
    for seed in ctx.seeds:
        fixed_eval = {f"{c:g}": _mone_eval(ctx, ctx.runner.ensure(mone_spec(ctx, seed, c)), [c])[f"{c:g}"]
                      for c in fixed}
        base = fixed_eval["1"]["metrics"]
        s_eval = _mone_eval(ctx, ctx.runner.ensure(mone_spec(ctx, seed, None)), grid)
        for key, row in sampled.items():
            row["dt"].append(delta(s_eval[key]["metrics"], base)["mean"])
            row["forward_s"].append(s_eval[key]["forward_s"])
            row["macs"].append(s_eval[key]["macs"])
        for key, row in fixed_out.items():
            row["dt"].append(delta(fixed_eval[key]["metrics"], base)["mean"])
            row["forward_s"].append(fixed_eval[key]["forward_s"])
            row["macs"].append(fixed_eval[key]["macs"])
    comparisons = [compare(f"e_c {k}: Δt(sampled model) ≥ Δt(fixed e_c {k}) − {CLOSE:g}", sampled[k]["dt"],
                           fixed_out[k]["dt"], "not_worse", CLOSE) for k in fixed_out if k in sampled]
    keys = [f"{c:g}" for c in sorted(grid)]
    comparisons += [compare(f"forward time at e_c {hi} > at e_c {lo}", sampled[hi]["forward_s"],
                            sampled[lo]["forward_s"]) for lo, hi in zip(keys, keys[1:], strict=False)]
    return {"grid": grid, "fixed": fixed, "sampled": sampled, "fixed_models": fixed_out, "comparisons": comparisons,
            "notes": [f"Δt against the model trained at the fixed e_c 1.0 (same seed), over the validation split; "
                      f"'close' means within {CLOSE:g} % of Δt. The sampled model drew e_c from "
                      f"{', '.join(f'{c:g}' for c in grid)} at every step (model.mone.sample_capacity).",
                      "Forward time: the fastest of repeated fused passes over one validation batch with every task, "
                      "in eval mode; MACs per image and task at that e_c (`squad.profile`)."]}


# ------------------------------------------------------------------------------------------------ pascal-table3
PASCAL_METHODS = ("pascal_mtl", "pascal_modsquad")
PASCAL_SHARE = 0.6  # the pruned model's parameters / the full model's, at most (the paper: 22 M / 50 M = 0.44)


def pascal_ctx(ctx: Context) -> Context:
    """``ctx`` on pascal-table3's data and scale (same output folder, runner and device)."""
    return dataclasses.replace(ctx, scale=ctx.pascal or pascal_scale(ctx.scale),
                               data=ctx.pascal_data or ctx.out / "data" / "pascal_shards")


def pascal_spec(pctx: Context, family: str, seed: int, task: str | None = None) -> RunSpec:
    """A pascal-table3 run (``pctx`` from `pascal_ctx`): STL of ``task``, or a multi-task family on the 5 tasks."""
    if family == "pascal_stl":
        return RunSpec(f"pascal-stl-{task}-s{seed}", family, seed, [task], pctx.scale.steps, scale=pctx.scale,
                       data=pctx.data)
    return RunSpec(f"{_slug(family)}-s{seed}", family, seed, pctx.tasks, pctx.scale.steps, scale=pctx.scale,
                   data=pctx.data)


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
    full_again, ratio, ratio_top = [], [], []
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
        table = _extraction_table(pctx, ctx.runner.path(pascal_spec(pctx, "pascal_modsquad", seed)))
        tables[seed] = table
        full_again.append(delta({t: r["full"] for t, r in table["tasks"].items()}, base)["mean"])
        for key, label, shares in (("pruned", theta, ratio), ("pruned_top", top, ratio_top)):
            ext = {t: r["extracted"][label]["metrics"] for t, r in table["tasks"].items()}
            d = delta(ext, base)
            methods[key]["dm"].append(d["mean"])
            methods[key]["per_task"].append(d["per_task"])
            methods[key]["metrics"].append(primary_of(ext))
            shares.append(statistics.fmean(r["extracted"][label]["ratio"] for r in table["tasks"].values()))
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
    for key, label, shares in (("pruned", theta, ratio), ("pruned_top", top, ratio_top)):
        methods[key].update(params=statistics.fmean(r["extracted"][label]["params"]
                                                    for r in table0["tasks"].values()),
                            params_per_task={t: r["extracted"][label]["params"] for t, r in table0["tasks"].items()},
                            macs=_extracted_macs(ctx, table0, label), ratio=shares,
                            step_s=None, cpu_s=None, peak_mib=None)
    for m in methods.values():
        m["dm_summary"] = spread(m["dm"])
    n = len(ctx.seeds)
    dm = {k: m["dm"] for k, m in methods.items()}
    comparisons = [compare("Δm(Mod-Squad) > Δm(MTL)", dm["pascal_modsquad"], dm["pascal_mtl"]),
                   compare(f"Δm(pruned, {theta}) ≥ Δm(Mod-Squad)", dm["pruned"], full_again, "not_worse"),
                   compare(f"parameters(pruned, {theta}) / parameters(Mod-Squad) ≤ {PASCAL_SHARE:.2f}", ratio,
                           [PASCAL_SHARE] * n, "at_most")]
    memory = pctx.cost(pascal_spec(pctx, "pascal_mtl", seed0))["memory"]
    sc = pctx.scale
    return {"tasks": tasks, "methods": methods, "comparisons": comparisons, "theta": PASCAL_THETA,
            "full_dm": full_again, "memory": memory,
            "scale": {"img_size": sc.img_size, "steps": sc.steps, "batch": sc.batch, "images": sc.images,
                      "data": str(pctx.data)},
            "paper": {"params": 50e6, "macs": 5.2e9, "pruned_params": 22e6,
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
                      "(e.g. human_parts with no person in the validation images) is left out of the mean.",
                      f"Pruned: every task extracted from the trained Mod-Squad at θ = {PASCAL_THETA:g} (experts "
                      "used by less than 1 % of the task's selections removed, the paper's main runs; no "
                      "fine-tuning), usage from a calibration pass over "
                      f"{sc.calib_batches} training batches per task; its parameters are one task's model (mean over "
                      f"tasks, as the paper's 22 M), against the full 5-task model. The top-{sc.keep_top:.0%} row "
                      "keeps that share of the experts per layer instead. The 'full' Δm of the pruned comparison is "
                      "the full model scored by the same evaluation (runs/pascal-modsquad-s*/extracted/).",
                      "Paper (real PASCAL-Context, ViT-S at 512 px, M3ViT's decoders): Mod-Squad 50 M parameters, "
                      "5.2 GMACs, 74.1 / 62.7 / 66.9 / 13.7 / 72.0 (semseg / parts / saliency / normals / edge); "
                      "pruned 22 M at the same metrics. The synthetic data's absolute values are not comparable.",
                      f"STL parameters are the sum of its {len(tasks)} models; its step time the sum of one step of "
                      f"each; MACs are per image and task (`squad.profile`); step time (the fastest of "
                      f"{sc.cost_steps} steps) and peak memory ({memory}) from one batch of {sc.batch} images."]}


CLAIMS: dict[str, Claim] = {c.name: c for c in [
    Claim("modsquad-table2", "Mod-Squad (Chen et al., CVPR 2023), Table 2",
          "Δt(Mod-Squad) > Δt(M3ViT) > Δt(MTL) > 0 against single-task models (the cost side is reported beside).",
          _table2_specs, measure_table2),
    Claim("pruning", "Mod-Squad, Table 2 (pruned row) and Fig. 3",
          "At θ = 0.01 the extracted single-task models keep Δt within noise of the full model with ≤ 60 % of its "
          "parameters.",
          lambda ctx: [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), method_spec(ctx, "modsquad", seed)]],
          measure_pruning),
    Claim("router-finetune", "Mod-Squad, Fig. 4",
          "Learning a new task from little data, fine-tuning only its routers (and head) beats training the head, "
          "the whole model, or a linear probe, at every data fraction.",
          lambda ctx: [pretrain_spec(ctx, seed) for seed in ctx.seeds], measure_router_finetune),
    Claim("mi-vs-balance", "Mod-Squad, Fig. 5 and §4.4",
          "The mutual-information loss gives sparser, more task-specific expert use than a per-task balance loss, "
          "at equal or better Δt.",
          lambda ctx: [s for seed in ctx.seeds for s in [*stl_specs(ctx, seed), method_spec(ctx, "modsquad", seed),
                                                          method_spec(ctx, "modsquad_balance", seed)]],
          measure_mi_vs_balance),
    Claim("amod-table3", "A-MoD (Gadhikar et al., 2024), Table 3",
          "Turning a trained dense model into MoD, attention routing keeps far more of its metric with no training "
          "than a learned router, and recovers faster when fine-tuned.",
          lambda ctx: [s for seed in ctx.seeds for s in [method_spec(ctx, "mtl", seed), amod_spec(ctx, seed,
                                                         "attention"), amod_spec(ctx, seed, "learned")]],
          measure_amod),
    Claim("mone-budget", "MoNE (Jain et al., NeurIPS 2024), Fig. 5",
          "One model trained with e_c sampled per step serves every compute budget close to models trained at that "
          "budget, and its forward time falls with e_c.",
          lambda ctx: [s for seed in ctx.seeds for s in [*(mone_spec(ctx, seed, c) for c in ctx.scale.mone_fixed),
                                                          mone_spec(ctx, seed, None)]],
          measure_mone),
    Claim("pascal-table3", "Mod-Squad, Table 3 (PASCAL-Context)",
          "On PASCAL-Context's 5 tasks, Δm(Mod-Squad) > Δm(MTL) against single-task models, and the pruned model "
          "(every task extracted at θ = 0.01) keeps Δm within noise of the full model with ≤ 60 % of its parameters "
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
