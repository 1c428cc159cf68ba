"""The runs of tools/reproduce.py: each an ordinary run folder trained by squad's own engine, skipped when done.

A run is a `RunSpec` (a method family from configs/model/, a seed, the tasks it trains, the step budget, a few
keys of its own); `run_config` turns it into the `RunConfig` that `squad.train.engine` trains, at a scale's widths
(`squad.reproduce.scales.width_overrides`). `Runner.ensure` trains it into ``OUT/runs/<name>`` in this process and
prints one progress line; a folder that already holds ``model.pt`` and ``metrics.jsonl`` is done and skipped, and a
folder with a checkpoint but no ``model.pt`` resumes from it (the engine's ``--resume auto``). Every run folder opens
with ``squad.load`` and the other tools.

A run may start from given weights (``RunSpec.init``: the A-MoD fine-tune of an adapted dense model); those are
loaded into the model before the engine looks for a checkpoint to resume, so a resumed run continues its own.

Every finished run records its settings in ``reproduce.json`` (`settings_of`: the run config without the paths and
the logging keys), and a later invocation that plans the same run name with other settings (steps, lr, widths,
tasks, seed, data ...) is refused instead of reusing it. `Runner.train_all` trains an invocation's runs before the
claims look at them, N at once in processes of their own with ``--parallel N`` (`squad.reproduce.parallel`); the
runs that start from another run's weights wait for the first wave.

`measure_cost` (`squad.train.cost`) gives the cost side of Mod-Squad's Table 2: seconds per training step and peak
training memory of a run's model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from squad.config.base import config_root, to_dict
from squad.config.loading import load_config
from squad.config.run import RunConfig
from squad.reproduce.parallel import Job, run_jobs
from squad.reproduce.scales import Scale, format_duration, width_overrides
from squad.train.engine import train

log = logging.getLogger("squad.reproduce")
CHECKPOINTED_STEPS = 400  # runs this long checkpoint every quarter (an interrupted invocation resumes them there)


@dataclasses.dataclass(frozen=True)
class Family:
    """A method: the paper config it comes from, its label in the report, loss keys of its own."""

    config: str  # a registered model config (configs/model/<config>.yaml)
    label: str
    loss: tuple[tuple[str, object], ...] = ()
    dataset: str = "taskonomy"  # data.dataset of its runs
    paper_run: str | None = None  # its real-data run config under configs/ (paper scale; default: Taskonomy's)
    model: tuple[tuple[str, object], ...] = ()  # model keys of its own on top of the paper config


FAMILIES: dict[str, Family] = {
    "stl": Family("stl_vit_b", "STL"),
    "mtl": Family("mtl_vit_b", "MTL"),
    # table2's control: MTL with the per-block task embedding the Mod-Squad families have (no experts)
    "mtl_embed": Family("mtl_vit_b", "MTL + task embedding", model=(("task_embed", "every_block"),)),
    "m3vit": Family("m3vit_vit_b", "M3ViT-like"),
    "moe_mlp": Family("moe_mlp_only_vit_b", "MoE MLP only"),
    "moe_attn": Family("moe_attn_only_vit_b", "MoE attention only"),
    "modsquad": Family("modsquad_vit_b", "Mod-Squad"),
    # the same model with a switch balance loss over all tasks instead of the MI loss (mi-vs-balance: the paper's
    # "modified MoE"), and with a per-task one (a secondary: it lowers I(T;E) by construction)
    "modsquad_balance_all": Family("modsquad_vit_b", "Mod-Squad, balance loss over all tasks",
                                   (("w_mi", 0.0), ("balance", "switch"), ("balance_scope", "all"),
                                    ("w_balance", 0.01))),
    "modsquad_balance": Family("modsquad_vit_b", "Mod-Squad, balance loss per task",
                               (("w_mi", 0.0), ("balance", "switch"), ("balance_scope", "per_task"),
                                ("w_balance", 0.01))),
    "mone": Family("mone_vit_s", "MoNE"),
    "mod": Family("mtl_vit_b", "MoD (adapted)"),  # the adapted dense model's fine-tune (its plan comes from init)
    "mod_stl": Family("stl_vit_b", "MoD (adapted)"),  # the same from a single-task dense model
    # pascal-table3: Mod-Squad Table 3's ViT-S models on PASCAL-Context
    "pascal_stl": Family("stl_vit_s_pascal", "STL", dataset="pascal_context",
                         paper_run="pascal_context/stl_vit_s.yaml"),
    "pascal_mtl": Family("mtl_vit_s_pascal", "MTL", dataset="pascal_context",
                         paper_run="pascal_context/mtl_vit_s.yaml"),
    "pascal_modsquad": Family("modsquad_vit_s_pascal", "Mod-Squad", dataset="pascal_context",
                              paper_run="pascal_context/modsquad_vit_s.yaml"),
}


@dataclasses.dataclass
class RunSpec:
    """One training run.

    Attributes:
        name: the run folder's name (unique in an output folder; carries the seed).
        family: a key of `FAMILIES`.
        seed: ``train.seed`` (initialisation, data order, augmentation, router noise).
        tasks: the model's heads.
        steps: optimiser steps.
        train_tasks: the tasks trained (``data.tasks``; default: every head).
        model: more model keys (nested dict), e.g. MoNE's capacity.
        evals: validations during training besides the first and the last (a curve in ``metrics.jsonl``).
        init: returns the model config (as a dict) and weights the run starts from (A-MoD: the adapted model).
        lr: the peak learning rate (default: the scale's).
        warmup: warm-up steps (default: the scale's).
        scale: the scale this run trains at instead of the invocation's (pascal-table3's own scale).
        data: the dataset root instead of the invocation's (pascal-table3's PASCAL-Context).
        base: the run whose weights ``init`` starts from (trained first; its step time stands in for this run's
            in the time plan).
    """

    name: str
    family: str
    seed: int
    tasks: Sequence[str]
    steps: int
    train_tasks: Sequence[str] | None = None
    model: dict = dataclasses.field(default_factory=dict)
    evals: int = 0
    init: Callable[[], tuple[dict, dict[str, torch.Tensor]]] | None = None
    lr: float | None = None
    warmup: int | None = None
    scale: Scale | None = None
    data: Path | None = None
    base: RunSpec | None = None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def model_section(family: str, scale: Scale, tasks: Sequence[str], extra: dict | None = None) -> tuple[dict, dict]:
    """The ``model`` and ``loss`` sections of a family at a scale (paper scale: the paper config's widths).

    Raises:
        ValueError: an unknown family.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown method family {family!r}; families: {', '.join(FAMILIES)}")
    fam = FAMILIES[family]
    paper = load_config(fam.config)
    model = to_dict(paper.model)
    if not scale.paper:
        model = _merge(model, width_overrides(scale, paper.model.head_dim,
                                              (paper.model.embed_dim, paper.model.num_heads)))
    model["heads"] = list(tasks)
    model = _merge(model, dict(fam.model))
    model = _merge(model, extra or {})
    loss = to_dict(paper.loss)
    loss.update(dict(fam.loss))
    return model, loss


def run_config_dict(spec: RunSpec, scale: Scale, data_root: str | Path) -> dict:
    """The run config of ``spec`` as a plain dict (what `run_config` loads and the paper scale writes)."""
    if spec.init is not None:
        model, _ = spec.init()
        loss = to_dict(load_config(FAMILIES[spec.family].config).loss)
    else:
        model, loss = model_section(spec.family, scale, spec.tasks, spec.model)
    every = spec.steps // (spec.evals + 1) if spec.evals and spec.steps > spec.evals else 0
    data = {"root": str(data_root), "workers": scale.workers, "val_batches": 0}
    if FAMILIES[spec.family].dataset != "taskonomy":
        data["dataset"] = FAMILIES[spec.family].dataset
    if spec.train_tasks is not None:
        data["tasks"] = list(spec.train_tasks)
    optim = {"lr": spec.lr or scale.lr, "weight_decay": 0.05, "steps": spec.steps, "batch_per_rank": scale.batch,
             "clip": 1.0, "min_lr": min(1e-6, spec.lr or scale.lr),
             "warmup_steps": min(spec.warmup if spec.warmup is not None else scale.warmup, max(0, spec.steps - 1))}
    train = {"seed": spec.seed, "log_every": max(1, min(25, spec.steps)), "eval_every": every,
             "ckpt_every": spec.steps // 4 if spec.steps >= CHECKPOINTED_STEPS else 0,  # a killed long run resumes
             "keep_checkpoints": 1, "progress": False}
    if spec.init is not None:
        train["precision"] = "fp32"  # the initial weights go into the fp32 module DeepSpeed trains (see RunSpec)
    return {"model": model, "loss": loss, "data": data, "optim": optim, "train": train}


def run_config(spec: RunSpec, scale: Scale, data_root: str | Path) -> RunConfig:
    """The `RunConfig` that trains ``spec`` at ``scale`` on ``data_root`` (the spec's own scale and data first)."""
    return load_config(run_config_dict(spec, spec.scale or scale, spec.data or data_root), cls=RunConfig)


def paper_config_dict(spec: RunSpec, scale: Scale, data_root: str) -> dict:
    """The real-Taskonomy run config of ``spec``: the paper widths and the schedule of
    configs/taskonomy/modsquad_vit_b.yaml (100 epochs, 10 of warm-up, AdamW 2e-4, 12 images × 8 GPUs × 15 nodes)."""
    fam = FAMILIES[spec.family]
    if fam.paper_run is not None:  # a family with its own real-data run config (pascal-table3: PASCAL-Context)
        return benchmark_paper_config_dict(spec, data_root)
    base = load_config(Path(config_root()) / "taskonomy" / "modsquad_vit_b.yaml", cls=RunConfig)
    out = run_config_dict(spec, scale, data_root)
    out["data"] = {**to_dict(base.data), "root": data_root, **({"tasks": list(spec.train_tasks)}
                                                               if spec.train_tasks is not None else {})}
    out["optim"] = to_dict(base.optim)
    out["train"] = {**to_dict(base.train), "seed": spec.seed}
    return out


def benchmark_paper_config_dict(spec: RunSpec, data_root: str) -> dict:
    """The real-data run config of a family with its own (``Family.paper_run``, e.g.
    configs/pascal_context/stl_vit_s.yaml: Table 3's ViT-S at 512 px, batch 8, 100 epochs, ``data.dataset``
    pascal_context) with the run's heads, tasks, seed and ``data_root``.

    Raises:
        ValueError: a family without a run config of its own.
    """
    fam = FAMILIES[spec.family]
    if fam.paper_run is None:
        raise ValueError(f"family {spec.family} has no real-data run config of its own")
    out = to_dict(load_config(Path(config_root()) / fam.paper_run, cls=RunConfig))
    out["model"]["heads"] = list(spec.tasks)
    out["loss"].update(dict(fam.loss))
    out["data"]["root"] = data_root
    if spec.train_tasks is not None:
        out["data"]["tasks"] = list(spec.train_tasks)
    out["train"]["seed"] = spec.seed
    return out


# ------------------------------------------------------------------------------------------------ run folders
def is_done(run_dir: Path) -> bool:
    """A finished run: its exported model and its validation metrics are there."""
    return (run_dir / "model.pt").is_file() and (run_dir / "metrics.jsonl").is_file()


def metrics_history(run_dir: Path) -> list[tuple[int, dict]]:
    """(step, task → metric → value) of every validation ``metrics.jsonl`` holds, by step."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row and isinstance(row.get("metrics"), dict):
            rows[int(row["step"])] = row["metrics"]
    return sorted(rows.items())


def final_metrics(run_dir: Path) -> dict[str, dict[str, float]]:
    """The validation metrics of a finished run at its last step."""
    history = metrics_history(run_dir)
    if not history:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no validation")
    return history[-1][1]


_UNSETTLED = {"data": ("root", "workers"), "train": ("log_every", "ckpt_every", "keep_checkpoints", "progress")}


def settings_of(cfg: dict, out: Path) -> dict:
    """What a run's results depend on: its run config dict without the keys that change nothing but where files go
    or what is logged. The data root is kept relative to ``out`` when it lies inside it (the folder may move)."""
    settings = json.loads(json.dumps(cfg, default=str))
    root = Path(settings["data"]["root"])
    try:
        settings["data"]["root_key"] = str(root.resolve().relative_to(Path(out).resolve()))
    except ValueError:
        settings["data"]["root_key"] = str(root)
    for section, keys in _UNSETTLED.items():
        for k in keys:
            settings[section].pop(k, None)
    return settings


_ABSENT = object()


def config_default(key: str):
    """The `RunConfig` default of a dotted config key (``model.moe.expert_parallel`` → 1), or a marker object when
    the defaults have no such key.

    A config key is added with the default that does what runs did before it existed, so a finished run whose
    record lacks a key is the same run as a plan that has the key's default.
    """
    value = _run_defaults()
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


@functools.cache
def _run_defaults() -> dict:
    return to_dict(RunConfig())


def _differences(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b))
                for d in _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}{k}.")]
    key = prefix.rstrip(".")
    if a is _ABSENT and b is not _ABSENT and b == config_default(key):  # a key added since the run was recorded
        return []
    if a == b:
        return []
    return [f"{key}: {None if a is _ABSENT else a!r} (trained) vs {None if b is _ABSENT else b!r} (planned)"]


def train_run(cfg: dict, run_dir: str, init_state: dict | None, record: dict) -> None:
    """Trains one run into ``run_dir`` and writes its ``reproduce.json`` (``record`` and the training seconds); the
    body of `Runner.ensure` and of a `--parallel` child process."""
    t0 = time.perf_counter()
    train(load_config(cfg, cls=RunConfig), run_dir, "auto", init_state=init_state)
    record = {**record, "train_seconds": time.perf_counter() - t0}
    (Path(run_dir) / "reproduce.json").write_text(json.dumps(record, indent=2) + "\n")


class Runner:
    """Trains the runs of an invocation into ``out/runs``, skipping finished ones, with a progress line per run."""

    def __init__(self, out: Path, scale: Scale, data_root: Path, total: int = 0, stream=None):
        self.out = Path(out)
        self.scale = scale
        self.data_root = Path(data_root)
        self.total = total
        self.count = 0
        self.trained = 0
        self.skipped = 0
        self.stream = stream or sys.stdout
        self.seen: dict[str, Path] = {}  # runs ensured in this invocation (claims share runs)

    def path(self, spec: RunSpec) -> Path:
        return self.out / "runs" / spec.name

    def say(self, text: str) -> None:
        print(f"[reproduce] {text}", file=self.stream, flush=True)

    def config(self, spec: RunSpec) -> dict:
        """The run config dict of ``spec`` at its scale and data (an ``init`` run: the model config it starts from)."""
        return run_config_dict(spec, spec.scale or self.scale, spec.data or self.data_root)

    def record(self, spec: RunSpec, cfg: dict) -> dict:
        return {"family": spec.family, "seed": spec.seed, "steps": spec.steps, "settings": settings_of(cfg, self.out)}

    def check_done(self, spec: RunSpec, cfg: dict | None = None) -> None:
        """Refuses a finished run trained with other settings than ``spec`` plans (naming the differences)."""
        run_dir = self.path(spec)
        file = run_dir / "reproduce.json"
        done = json.loads(file.read_text()) if file.is_file() else {}
        steps = done.get("steps")
        if steps is not None and steps != spec.steps:
            raise ValueError(f"{run_dir} was trained for {steps} steps, this invocation plans {spec.steps}: use "
                             f"another --out (or the same --steps) so that every run of a report has the same budget")
        if "settings" in done:
            planned = settings_of(cfg or self.config(spec), self.out)
            diff = _differences(done["settings"], planned)
            if diff:
                raise ValueError(f"{run_dir} was trained with other settings than this invocation plans "
                                 f"({'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}): use another --out")

    def _where(self) -> str:
        self.count += 1
        return f"run {self.count}/{self.total}" if self.total else f"run {self.count}"

    def ensure(self, spec: RunSpec) -> Path:
        """The finished run folder of ``spec``, trained now unless it is done already."""
        run_dir = self.path(spec)
        if spec.name in self.seen:
            return run_dir
        self.seen[spec.name] = run_dir
        if is_done(run_dir):
            self.check_done(spec)
            self.skipped += 1
            self.say(f"{self._where()} {spec.name}: done already, skipped")
            return run_dir
        cfg = self.config(spec)
        init = spec.init()[1] if spec.init is not None else None
        t0 = time.perf_counter()
        train_run(cfg, str(run_dir), init, self.record(spec, cfg))
        seconds = time.perf_counter() - t0
        self.trained += 1
        self.say(f"{self._where()} {spec.name}: trained {spec.steps} steps in {format_duration(seconds)} "
                 f"({seconds / max(1, spec.steps):.2f} s/step with set-up and validation)")
        return run_dir

    def train_all(self, specs: Sequence[RunSpec], parallel: int, gpus: int = 0) -> None:
        """Trains every unfinished run of ``specs``, ``parallel`` at once in processes of their own
        (`squad.reproduce.parallel`); the runs that start from another run's weights (``init``) go in a second wave.
        The claims then find them done (`ensure`)."""
        waves = ([s for s in specs if s.init is None], [s for s in specs if s.init is not None])
        for wave in waves:
            jobs, names = [], {}
            for spec in wave:
                run_dir = self.path(spec)
                if spec.name in self.seen or is_done(run_dir):
                    continue
                cfg = self.config(spec)
                init = spec.init()[1] if spec.init is not None else None
                jobs.append(Job(spec.name, train_run, {"cfg": cfg, "run_dir": str(run_dir), "init_state": init,
                                                       "record": self.record(spec, cfg)},
                                what=f"trained {spec.steps} steps"))
                names[spec.name] = run_dir
            if not jobs:
                continue
            for name in run_jobs(jobs, parallel, self.say, gpus, label=lambda job: f"{self._where()} {job.name}"):
                self.seen[name] = names[name]
                self.trained += 1
