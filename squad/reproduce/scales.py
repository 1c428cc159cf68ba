"""The three scales of tools/reproduce.py: widths, images, step budgets and seeds, and the time plan of each.

* ``tiny``: the plumbing, in a few minutes (the tests run it): 4 tasks, 32 px, width 32, a handful of steps.
* ``small``: the claims measured on the synthetic Taskonomy on a 2-core CPU in at most 90 minutes with 2 seeds:
  all 13 tasks at 64 px, the demo's widths (ViT of width 96, depth 4, 4 heads), 200 steps of 16 images per run.
* ``paper``: ViT-B/16 (ViT-S/16 for MoNE) at 224 px on the real Taskonomy with the paper's schedule (100 epochs,
  batch 1440); nothing runs: the run configs and the ``deepspeed --hostfile`` commands are written.

pascal-table3 runs beside each scale on its own synthetic PASCAL-Context (`pascal_scale`, `PASCAL_SETTINGS`: the 5
tasks; tiny 16 images at 32 px, 3 steps of 4; small 320 images at 64 px, 100 steps of 16 — estimated 11 min at 2 seeds
from step times measured beside another reproduction on the 2-core machine; paper: configs/pascal_context/'s ViT-S
at 512 px).

Every method family keeps its paper config's structure (the layer plan, which layers are routed, the losses, the
top-k share of the experts); `width_overrides` shrinks the widths to a scale's.

`estimate_seconds` is the time plan printed before a run starts. Its step times are the ones the run measured a
moment before (`squad.reproduce.runs.measure_cost`), so the estimate follows the machine it runs on; the constants
below are the small-scale figures measured on the 2-core development machine, used where nothing is measured yet.
"""

from __future__ import annotations

import dataclasses
import math

from squad.tasks import TASK_NAMES

HELD_OUT = ("class_object", "class_scene")  # router-finetune learns these onto a model pretrained without them
PASCAL_TASKS = ("semseg", "human_parts", "saliency", "normals", "edge")  # pascal-table3 (squad.data.pascal)


@dataclasses.dataclass(frozen=True)
class Scale:
    """One scale: widths, data, step budgets, seeds, and the post-training settings of every claim."""

    name: str
    tasks: tuple[str, ...]  # the tasks every claim uses (Δt is over these)
    img_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    moa_experts: int  # MoE attention: experts, top-k (top_k · head_dim = embed_dim, as ViT-B's 12 of 24 × 64)
    moa_top_k: int
    moa_head_dim: int
    moe_experts: int  # MoE MLP: experts, top-k (a quarter of the experts, as the paper's 4 of 16)
    moe_top_k: int
    images: int  # synthetic images rendered when --data is not given (6:1:1 train/val/test buildings)
    buildings: int | None
    batch: int  # images per step
    steps: int  # optimiser steps of every training run (STL, multi-task, MoNE)
    lr: float
    warmup: int
    seeds: int  # default --seeds
    workers: int  # data loader workers per run
    calib_batches: int  # calibration batches for extraction (pruning)
    thetas: tuple[float, ...]  # pruning thresholds
    keep_top: float  # pruning by share of experts kept per layer
    finetune_fractions: tuple[float, ...]  # router-finetune training-set shares
    finetune_steps: int
    finetune_batch: int
    finetune_lr: float
    amod_capacity: float
    amod_steps: int  # fine-tune of the adapted models (A-MoD)
    amod_evals: int  # validations during that fine-tune (the recovery curve)
    mone_grid: tuple[float, ...]  # e_c at which MoNE models are evaluated
    mone_fixed: tuple[float, ...]  # e_c of the fixed-budget MoNE models (1.0 is the baseline of the curve)
    mone_experts: int
    cost_steps: int  # measured training steps per method (step time and peak memory)
    time_repeats: int  # forward passes timed per MoNE e_c

    @property
    def paper(self) -> bool:
        return self.name == "paper"


_COMMON = dict(thetas=(0.0, 0.001, 0.01, 0.03), keep_top=0.4, finetune_fractions=(0.005, 0.01, 0.02, 0.05),
               amod_capacity=0.5, mone_grid=(0.2, 0.4, 0.6, 0.8, 1.0), mone_experts=4)

SCALES: dict[str, Scale] = {
    "tiny": Scale(name="tiny", tasks=("class_object", "class_scene", "depth_euclidean", "normal"), img_size=32,
                  patch_size=8, embed_dim=32, depth=2, num_heads=2, moa_experts=4, moa_top_k=2, moa_head_dim=16,
                  moe_experts=4, moe_top_k=2, images=32, buildings=8, batch=4, steps=3, lr=1e-3, warmup=1, seeds=1,
                  workers=0, calib_batches=1, finetune_steps=2, finetune_batch=4, finetune_lr=1e-3, amod_steps=2,
                  amod_evals=1, mone_fixed=(0.2, 1.0), cost_steps=2, time_repeats=2,
                  **_COMMON),
    "small": Scale(name="small", tasks=TASK_NAMES, img_size=64, patch_size=8, embed_dim=96, depth=4, num_heads=4,
                   moa_experts=8, moa_top_k=4, moa_head_dim=24, moe_experts=8, moe_top_k=2, images=2000,
                   buildings=16, batch=16, steps=200, lr=1e-3, warmup=20, seeds=2, workers=1, calib_batches=8,
                   finetune_steps=60, finetune_batch=8, finetune_lr=1e-3, amod_steps=60, amod_evals=3,
                   mone_fixed=(0.2, 0.6, 1.0), cost_steps=6, time_repeats=5, **_COMMON),
    "paper": Scale(name="paper", tasks=TASK_NAMES, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                   moa_experts=24, moa_top_k=12, moa_head_dim=64, moe_experts=16, moe_top_k=4, images=0,
                   buildings=None, batch=12, steps=0, lr=2e-4, warmup=0, seeds=1, workers=8, calib_batches=64,
                   finetune_steps=200, finetune_batch=8, finetune_lr=1e-3, amod_steps=0, amod_evals=0,
                   mone_fixed=(0.2, 0.4, 0.6, 0.8, 1.0), cost_steps=0, time_repeats=20, **_COMMON),
}

# Seconds per training step at small scale (batch 16, 64 px, width 96, depth 4, fp32, one process, all 13 tasks;
# STL: one single-task model): the CPU seconds of one thread measured on the 2-core development machine
# (`measure_cost`'s ``cpu_s`` with torch.set_num_threads(1)) divided by 1.7, the speed-up of two threads. Used by
# `estimate_seconds` only for the families this invocation did not measure.
SMALL_STEP_SECONDS: dict[str, float] = {
    "stl": 0.076 / 1.7, "mtl": 0.72 / 1.7, "m3vit": 0.92 / 1.7, "moe_mlp": 0.88 / 1.7, "moe_attn": 0.72 / 1.7,
    "modsquad": 0.99 / 1.7, "modsquad_balance": 1.1 / 1.7, "mone": 0.62 / 1.7,
}
DATA_SHARE = 0.2  # reading and augmenting the batches (HDF5 shards, one loader worker) beside a measured step
# Per training run at small scale with 13 tasks: DeepSpeed set-up, the validations at step 0 and at the end (250
# images, every task), the checkpoint and model.pt; a single-task (STL) run costs about a tenth of it.
RUN_OVERHEAD_S = 20.0
# Post-training work per claim and seed at small scale (extraction, fine-tuning, evaluations), seconds, measured
# with `--steps 2 --seeds 1` on the development machine while other jobs shared it (load ~5).
SMALL_EXTRA_SECONDS: dict[str, float] = {
    "modsquad-table2": 60.0, "pruning": 100.0, "router-finetune": 110.0, "mi-vs-balance": 20.0, "amod-table3": 40.0,
    "mone-budget": 30.0, "pascal-table3": 70.0,
}


# pascal-table3 runs on its own data (the synthetic PASCAL-Context, squad.data.synthetic.pascal) with the 5 PASCAL
# tasks: per scale, the keys of `Scale` that differ from the Taskonomy scale (the ViT widths stay the scale's). The
# synthetic render's long side is the model's img_size (the reader pads it to a square); its train/val split is
# PASCAL-Context's (4,998 / 5,105, so about half of the images validate). Paper: Table 3's ViT-S at the 512 px,
# batch 8 of configs/pascal_context/modsquad_vit_s.yaml.
PASCAL_SETTINGS: dict[str, dict] = {
    "tiny": dict(images=16, img_size=32, batch=4, steps=3, thetas=(0.01,), calib_batches=1),
    "small": dict(images=320, img_size=64, batch=16, steps=100, thetas=(0.01,), calib_batches=4),
    "paper": dict(images=0, img_size=512, batch=8, thetas=(0.01,)),  # widths: configs/pascal_context/ (ViT-S)
}
PASCAL_THETA = 0.01  # the pruned model of Table 3: every task extracted at θ = 1 % (the paper's main runs)
# Small-scale pascal-table3 figures (batch 16, 64 px, width 96, depth 4, 5 tasks; STL: one single-task model),
# measured on the 2-core development machine while a `reproduce.py all --scale small` shared it (wall seconds, the
# fastest of 6 steps); used by `estimate_seconds` for the families not measured at the start.
PASCAL_SMALL_STEP_SECONDS: dict[str, float] = {"pascal_stl": 0.10, "pascal_mtl": 0.42, "pascal_modsquad": 0.57}
# Per 5-task run: set-up, the validations at step 0 and at the end (the whole val split, odsF in Python), model.pt
# (measured: MTL 15 s, Mod-Squad 26 s); an STL run about 0.3 of it (the edge model's odsF most).
PASCAL_RUN_OVERHEAD_S = 20.0


def pascal_scale(scale: Scale, steps: int | None = None) -> Scale:
    """The scale pascal-table3 runs at beside ``scale``: the 5 PASCAL-Context tasks, `PASCAL_SETTINGS`, and
    ``steps`` when given (``--steps``) instead of the settings' own budget."""
    out = dataclasses.replace(scale, name=scale.name, tasks=PASCAL_TASKS, buildings=None,
                              **PASCAL_SETTINGS[scale.name])
    return dataclasses.replace(out, steps=steps) if steps is not None else out


def get_scale(name: str) -> Scale:
    """The scale called ``name`` (tiny, small or paper).

    Raises:
        ValueError: an unknown name (the scales are listed).
    """
    if name not in SCALES:
        raise ValueError(f"unknown scale {name!r}; scales: {', '.join(SCALES)}")
    return SCALES[name]


def width_overrides(scale: Scale, paper_head_dim: int | None, paper_width: tuple[int, int]) -> dict:
    """The model keys that shrink a paper config to ``scale``'s widths, keeping its structure.

    Args:
        scale: the scale.
        paper_head_dim: the paper config's ``model.head_dim`` (e.g. Mod-Squad's 128-wide dense heads) or None.
        paper_width: the paper config's (embed_dim, num_heads), to scale ``head_dim`` by the same factor.

    Returns:
        A nested dict of ``model`` keys (merged into the config's model section).
    """
    out = {"img_size": scale.img_size, "patch_size": scale.patch_size, "embed_dim": scale.embed_dim,
           "depth": scale.depth, "num_heads": scale.num_heads,
           "moa": {"num_experts": scale.moa_experts, "top_k": scale.moa_top_k, "head_dim": scale.moa_head_dim},
           "moe": {"num_experts": scale.moe_experts, "top_k": scale.moe_top_k},
           "mone": {"num_experts": scale.mone_experts}}
    if paper_head_dim is not None:  # wider dense heads than D / heads: keep the ratio
        ratio = paper_head_dim / (paper_width[0] / paper_width[1])
        out["head_dim"] = max(1, round(ratio * scale.embed_dim / scale.num_heads))
    else:
        out["head_dim"] = None
    return out


def _size(scale: Scale) -> float:
    """Relative compute of a step (tokens² · width² · depth · batch, as a ViT's matmuls grow)."""
    tokens = (scale.img_size / scale.patch_size) ** 2 + 1
    return tokens * scale.embed_dim**2 * scale.depth * scale.batch


def estimate_seconds(plan: list[tuple[str, int, int]], step_seconds: dict[str, float], scale: Scale,
                     claims: list[str] | None = None, seeds: int = 1) -> float:
    """The planned wall time of an invocation: the training runs still to do, and the claims' other work.

    Args:
        plan: (family, steps, tasks) of every run still to train.
        step_seconds: seconds per step per family measured just before (STL: per single-task model).
        scale: the scale (small-scale constants, scaled by the relative compute of a step, fill in the rest).
        claims: the claims measured (their post-training work is added).
        seeds: seeds per run.
    """
    ratio = _size(scale) / _size(SCALES["small"])
    pratio = _size(pascal_scale(scale)) / _size(pascal_scale(SCALES["small"])) if scale.name in PASCAL_SETTINGS else 1
    total = sum(max(5.0, SMALL_EXTRA_SECONDS.get(c, 0.0) * (pratio if c == "pascal-table3" else ratio))
                for c in claims or []) * seeds
    for family, steps, tasks in plan:
        if family.startswith("pascal_"):  # pascal-table3's runs: 5 tasks on the synthetic PASCAL-Context
            per = step_seconds.get(family, PASCAL_SMALL_STEP_SECONDS.get(family, 0.45) * pratio)
            share = 0.3 if family == "pascal_stl" else 1.0
            total += steps * per * (1 + DATA_SHARE) + 1.0 + PASCAL_RUN_OVERHEAD_S * share * min(1.0, pratio)
            continue
        if family in step_seconds:
            per = step_seconds[family]
        else:
            per = SMALL_STEP_SECONDS.get(family, max(SMALL_STEP_SECONDS.values())) * ratio
            per *= 1.0 if family == "stl" else tasks / len(TASK_NAMES)
        share = 0.1 if family == "stl" else tasks / len(TASK_NAMES)
        total += steps * per * (1 + DATA_SHARE) + 1.0 + RUN_OVERHEAD_S * share * min(1.0, ratio)
    return total


def format_duration(seconds: float) -> str:
    """``1 h 05 min``, ``12 min``, ``40 s``, ``0.3 s``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"
