"""The runs the claims need and what every claim shares: `Context` (scale, seeds, data, output folder, runner),
`cached` results keyed by their settings, and one function per kind of run (`RunSpec`s named as they appear in
OUT/runs). `squad.reproduce.claims` measures from these runs; `squad.reproduce.paper` writes their configs at paper
scale."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from squad.analysis.flops import backbone_macs
from squad.config.base import to_dict
from squad.config.loading import load_config
from squad.data import build_dataset, eval_loader
from squad.io import load_model
from squad.models.vit import build_model
from squad.posttrain.adapt import to_mod
from squad.reproduce.runs import Runner, RunSpec, model_section, run_config, settings_of
from squad.reproduce.scales import HELD_OUT, Scale, pascal_scale
from squad.train.cost import measure_cost

PASCAL_METHODS = ("pascal_mtl", "pascal_modsquad")  # pascal-table3's multi-task families (beside one STL per task)


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
    parallel: int = 1  # --parallel: runs (and router-finetune's fine-tunes) at once
    tolerance: dict[str, float] | None = None  # unit → cross-machine spread (`squad.reproduce.tolerance`)

    @property
    def tasks(self) -> list[str]:
        return list(self.scale.tasks)

    def cache_file(self, name: str) -> Path:
        return self.out / "cache" / name

    def cost_key(self, spec: RunSpec) -> str:
        """What a run's step time and memory depend on: its model, loss, batch, tasks and the device (a run
        starting from another's weights: that run's)."""
        spec = spec.base if spec.init is not None and spec.base is not None else spec
        cfg = self.runner.config(spec)
        what = {"model": cfg["model"], "loss": cfg["loss"], "batch": cfg["optim"]["batch_per_rank"],
                "tasks": cfg["data"].get("tasks"), "dataset": cfg["data"].get("dataset"), "device": self.device,
                "steps": self.scale.cost_steps}
        digest = hashlib.sha1(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return f"{spec.family}:{len(spec.train_tasks or spec.tasks)}:{digest}"

    def cost(self, spec: RunSpec) -> dict:
        """`measure_cost` of a run's model, kept in ``cache/cost.json`` under `cost_key` (measured once)."""
        file = self.cache_file("cost.json")
        table = json.loads(file.read_text()) if file.is_file() else {}
        key = self.cost_key(spec)
        if key not in table:
            spec = spec.base if spec.init is not None and spec.base is not None else spec
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

    def run_settings(self, spec: RunSpec) -> dict:
        """The settings a run was (or will be) trained with: part of every cache key of results computed from it."""
        return settings_of(self.runner.config(spec), self.out)


def cached(file: Path, key: dict, compute: Callable[[], dict]) -> dict:
    """``compute()``, kept in ``file`` with ``key`` (every setting it depends on); a file made with another key is
    computed again."""
    key = json.loads(json.dumps(key, default=str))
    if file.is_file():
        try:
            data = json.loads(file.read_text())
        except ValueError:
            data = {}
        if isinstance(data, dict) and data.get("key") == key and "value" in data:
            return data["value"]
    value = compute()
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"key": key, "value": value}, indent=1) + "\n")
    return value


# ------------------------------------------------------------------------------------------------- specs
def _slug(family: str) -> str:
    return family.replace("_", "-")


def method_spec(ctx: Context, family: str, seed: int, **kw) -> RunSpec:
    kw.setdefault("evals", ctx.scale.curve_evals)
    return RunSpec(f"{_slug(family)}-s{seed}", family, seed, ctx.tasks, ctx.scale.steps, **kw)


def stl_spec(ctx: Context, task: str, seed: int) -> RunSpec:
    return RunSpec(f"stl-{task}-s{seed}", "stl", seed, [task], ctx.scale.steps, evals=ctx.scale.curve_evals)


def stl_specs(ctx: Context, seed: int) -> list[RunSpec]:
    return [stl_spec(ctx, t, seed) for t in ctx.tasks]


def held_out(ctx: Context) -> list[str]:
    return [t for t in HELD_OUT if t in ctx.tasks]


def pretrain_spec(ctx: Context, seed: int) -> RunSpec:
    held = held_out(ctx)
    return RunSpec(f"modsquad-without-{'-'.join(h.replace('class_', '') for h in held)}-s{seed}", "modsquad", seed,
                   ctx.tasks, ctx.scale.steps, train_tasks=[t for t in ctx.tasks if t not in held],
                   evals=max(1, ctx.scale.curve_evals))  # its validation curve: the convergence check


@functools.lru_cache(maxsize=16)
def _mone_macs(model_json: str, capacities: tuple[float, ...]) -> tuple[float, ...]:
    cfg = load_config({"model": json.loads(model_json)}).model
    model = build_model(cfg)
    return tuple(float(backbone_macs(model, c)) for c in capacities)


def mone_macs(ctx: Context, capacities: Sequence[float]) -> dict[str, float]:
    """Backbone MACs per image of the scale's MoNE model at each e_c (`squad.analysis.flops.backbone_macs`)."""
    model, _ = model_section("mone", ctx.scale, ctx.tasks, {"mone": {"capacity": 1.0}})
    macs = _mone_macs(json.dumps(model, sort_keys=True), tuple(capacities))
    return {f"{c:g}": m for c, m in zip(capacities, macs, strict=True)}


def training_macs(ctx: Context, e_c: float | None) -> float:
    """The training compute of a MoNE run in MACs: steps × images × tasks × backbone MACs per image (× 3: forward
    and backward), at its fixed e_c, or for the adaptive model (``None``) at the mean over the grid it draws from."""
    grid = tuple(ctx.scale.mone_grid)
    per = mone_macs(ctx, grid if e_c is None else (e_c,))
    return 3.0 * ctx.scale.steps * ctx.scale.batch * len(ctx.tasks) * statistics.fmean(per.values())


def mone_spec(ctx: Context, seed: int, e_c: float | None) -> RunSpec:
    """The adaptive MoNE run (``e_c=None``: e_c drawn per step from the grid) or one trained at a fixed e_c; every
    one of them for the scale's steps (the same steps: their training compute in MACs is reported beside)."""
    grid = list(ctx.scale.mone_grid)
    if e_c is None:
        return RunSpec(f"mone-adaptive-s{seed}", "mone", seed, ctx.tasks, ctx.scale.steps,
                       model={"mone": {"capacity": statistics.median(grid), "sample_capacity": grid}},
                       evals=ctx.scale.curve_evals)
    return RunSpec(f"mone-ec{e_c:g}-s{seed}", "mone", seed, ctx.tasks, ctx.scale.steps,
                   model={"mone": {"capacity": e_c}}, evals=ctx.scale.curve_evals)


def amod_dense_spec(ctx: Context, seed: int) -> RunSpec:
    """The dense model A-MoD adapts: ``amod_depth`` blocks on ``amod_tasks`` for ``amod_dense_steps`` (to a
    plateau), validated along the way."""
    tasks = [t for t in ctx.scale.amod_tasks]
    family = "stl" if len(tasks) == 1 else "mtl"
    return RunSpec(f"amod-dense-s{seed}", family, seed, tasks, ctx.scale.amod_dense_steps,
                   model={"depth": ctx.scale.amod_depth}, evals=4)


def amod_spec(ctx: Context, seed: int, routing: str) -> RunSpec:
    """The fine-tune of the dense model turned into MoD (``routing`` attention or learned), from the adapted
    weights; its validation at step 0 is the adapted model with no training."""
    dense = amod_dense_spec(ctx, seed)
    dense_run = ctx.runner.path(dense)
    scale = ctx.scale

    def init() -> tuple[dict, dict]:
        model = load_model(dense_run)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # a learned router's fresh initialisation
            adapted = to_mod(model, scale.amod_capacity, routing, every=2)
        return to_dict(adapted.cfg), {k: v.detach().clone() for k, v in adapted.state_dict().items()}

    family = "mod_stl" if dense.family == "stl" else "mod"
    return RunSpec(f"amod-{routing}-finetune-s{seed}", family, seed, dense.tasks, scale.amod_steps,
                   evals=scale.amod_evals, init=init, lr=scale.lr / 3, warmup=0, base=dense)


def amod_continued_spec(ctx: Context, seed: int) -> RunSpec:
    """The plateau's control: the dense model A-MoD adapts, trained on from its weights for the fine-tune's steps at
    the fine-tune's lr (no MoD): what the same steps give a model that keeps training."""
    dense = amod_dense_spec(ctx, seed)
    dense_run = ctx.runner.path(dense)

    def init() -> tuple[dict, dict]:
        model = load_model(dense_run)
        return to_dict(model.cfg), {k: v.detach().clone() for k, v in model.state_dict().items()}

    return RunSpec(f"amod-dense-continued-s{seed}", dense.family, seed, dense.tasks, ctx.scale.amod_steps,
                   evals=ctx.scale.amod_evals, init=init, lr=ctx.scale.lr / 3, warmup=0, base=dense)


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
