"""The scales of tools/reproduce.py: widths, images, step budgets and seeds, and the time plan of each.

* ``tiny``: the plumbing, in a few minutes (the tests run it): 4 tasks, 32 px, width 32, a handful of steps. No
  verdict means anything at this scale.
* ``small``: the pilot on a 2-core CPU: all 13 tasks at 64 px, the demo's widths (ViT of width 96, depth 4, 4
  heads), 200 steps of 16 images per run, 2 seeds (direction only: a verdict needs 3). Most of the 13 tasks do not
  learn beyond an image-independent predictor in so few steps (the learnability gate leaves them out).
* ``cpu``: the claims at convergence on the CPU: the 4 tasks this data makes learnable (`LEARNABLE`: class_scene,
  class_object, keypoints2d, depth_zbuffer) at 64 px, width 96, depth 4, 1,000 steps of 16 images per run, 5 seeds
  (`squad.reproduce.stats.MIN_SEEDS`, what a verdict needs), one thread per run, validated 4 times along every run
  (the curves of the figures), resumable (checkpoints every 250 steps); table2 trains STL, MTL, MTL + task embedding
  and Mod-Squad; table2-curve adds 250, 500 and 2,000 steps (``curve_steps``); the first seed's STL, MTL and
  Mod-Squad runs are trained again with 2 threads for the cross-machine tolerance (``tolerance_threads``). Hours on
  one core (``tools/reproduce.py ... --dry-run`` prints the plan).
* ``gpu``: the same 4 tasks at 64 px with a ViT of width 192, depth 6, 6 heads, 64 images per step, 3 seeds, the
  data rendered on the machine itself (4,000 images: tens of seconds on 16 cores; the shards of a larger render do
  not fit what can be carried to a lent GPU). Its steps are chosen so that ``modsquad-table2`` fits one command of
  ≤ 8 minutes on one H100 with ``--parallel`` `GPU_PARALLEL` (`GPU_TABLE2_MINUTES`), planned from the step times of
  MEASURED.md (unmeasured at these widths); the other claims are planned longer than a lent GPU gives (`plan_table`).
* ``paper``: ViT-B/16 (ViT-S/16 for MoNE) at 224 px on the real Taskonomy with the paper's schedule (100 epochs,
  batch 1440); nothing runs: the run configs and the ``deepspeed --hostfile`` commands are written.

Every scale but tiny validates on ≥ 500 images (`MIN_VAL_IMAGES`: 2 of 16 buildings of 4,000 rendered images).

Claims with budgets of their own (the same at every ``--steps``):

* amod-table3 adapts a dense model of ``amod_depth`` blocks on ``amod_tasks`` trained for ``amod_dense_steps`` (to a
  plateau of its validation curve: the claim checks it), then fine-tunes each adapted model ``amod_steps`` steps —
  small, cpu and gpu: depth 8, at least 1,000 fine-tune steps; tiny: depth 2, a few steps (plumbing only).
* router-finetune learns each held-out task from ``finetune_fractions`` of the training split, every mode with the same
  AdamW budget (``finetune_steps`` of ``finetune_batch``), its lr picked from ``finetune_lrs`` and its stopping point
  from ``finetune_evals`` evaluations on a held-out ``finetune_holdout`` share of those images — only on a pretrained
  model whose validation curve has converged (else the claim is untestable at that scale).
* mone-budget trains every model for the same ``steps``: the adaptive one (e_c drawn per step from ``mone_grid``, the
  paper's 0.15 … 0.95) beside models trained at each e_c of ``mone_fixed``; the training compute of each is
  reported in MACs.

pascal-table3 runs beside each scale on its own synthetic PASCAL-Context (`pascal_scale`, `PASCAL_SETTINGS`: the 5
tasks; tiny 16 images at 32 px, 3 steps of 4; small and cpu 320 images at 64 px, 100 steps of 16; gpu 2,000 images,
1,500 steps of 64; paper: configs/pascal_context/'s ViT-S at 512 px): plumbing only, no verdict on synthetic data.

Every method family keeps its paper config's structure (the layer plan, which layers are routed, the losses, the
top-k share of the experts); `width_overrides` shrinks the widths to a scale's.

`estimate_seconds` is the time plan printed before a run starts. Its step times are the ones the run measured a
moment before (`squad.train.cost.measure_cost`), so the estimate follows the machine it runs on; the constants
below fill in the rest: on a CPU the small-scale figures measured on the 2-core development machine, on a GPU the
one-H100 figures of MEASURED.md (`GPU_DEMO_STEP_SECONDS`). `plan_table` gives every claim's planned time.
"""

from __future__ import annotations

import dataclasses
import math

from squad.tasks import TASK_NAMES

HELD_OUT = ("class_object", "class_scene")  # router-finetune learns these onto a model pretrained without them
# The tasks the synthetic Taskonomy makes learnable in ~1,000 steps at 64 px (issue 30: the others do not beat an
# image-independent predictor; the learnability gate checks it on every run of the cpu and gpu scales)
LEARNABLE = ("class_scene", "class_object", "keypoints2d", "depth_zbuffer")
MIN_VAL_IMAGES = 500  # validation images of every scale but tiny
ALL_TABLE2 = ("mtl", "mtl_embed", "m3vit", "moe_mlp", "moe_attn", "modsquad")
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
    steps: int  # optimiser steps of every training run (STL, multi-task, MoNE at a fixed e_c)
    lr: float
    warmup: int
    seeds: int  # default --seeds
    workers: int  # data loader workers per run
    calib_batches: int  # calibration batches for extraction (pruning)
    thetas: tuple[float, ...]  # pruning thresholds
    keep_top: float  # pruning by share of experts kept per layer
    finetune_fractions: tuple[float, ...]  # router-finetune training-set shares
    finetune_steps: int  # AdamW steps of every mode (the linear probe too)
    finetune_batch: int
    finetune_lrs: tuple[float, ...]  # the lr grid each mode picks from on the held-out images
    finetune_holdout: float  # share of each fraction's images held out to pick the lr and the stopping step
    finetune_evals: int  # held-out evaluations along each fine-tune (the best one is kept: the stopping rule)
    amod_capacity: float
    amod_depth: int  # blocks of the dense model A-MoD adapts
    amod_tasks: tuple[str, ...]  # its tasks (the paper: ImageNet classification; here the scene class)
    amod_dense_steps: int  # its training, to a plateau
    amod_steps: int  # fine-tune of the adapted models
    amod_evals: int  # validations during that fine-tune (the recovery curve)
    mone_grid: tuple[float, ...]  # e_c the adaptive MoNE model draws from at every training step
    mone_fixed: tuple[float, ...]  # e_c of the fixed-budget MoNE models (1.0 is the baseline of Δt)
    mone_experts: int
    cost_steps: int  # measured training steps per method (step time and peak memory)
    time_repeats: int  # forward passes timed per MoNE e_c
    table2_methods: tuple[str, ...] = ALL_TABLE2  # modsquad-table2's multi-task families (beside STL)
    curve_evals: int = 0  # validations along every run besides the first and the last (the figures' curves)
    curve_steps: tuple[int, ...] = ()  # table2-curve's budgets (each a run of its own; ``steps`` reuses table2's)
    tolerance_threads: int = 0  # the cross-machine tolerance: a sample of runs again with this many threads (0: no)
    plumbing: bool = False  # tiny: every step of every claim runs, no verdict is meant

    @property
    def paper(self) -> bool:
        return self.name == "paper"


GPU_STEPS = 600  # the gpu scale's steps: modsquad-table2 planned at <= 8 min on one H100 (GPU_TABLE2_MINUTES)
GPU_TABLE2_MINUTES = 8.0  # one command on a lent GPU (15 minutes of device time a session, start-up included)
GPU_PARALLEL = 10  # --parallel the gpu scale is planned with (one GPU, runs sharing it)
MONE_GRID = tuple(round(0.15 + 0.1 * i, 2) for i in range(9))  # the MoNE paper's {0.15, 0.25, …, 0.95}
# pruning's θ curve: the paper's 0.01 and on to settings that remove most experts of a task (≤ 60 % of the parameters)
_COMMON = dict(thetas=(0.0, 0.001, 0.01, 0.03, 0.06, 0.1, 0.15, 0.2), keep_top=0.4, amod_capacity=0.5,
               mone_grid=MONE_GRID, mone_experts=4, amod_tasks=("class_scene",))

_LEAN_TABLE2 = ("mtl", "mtl_embed", "m3vit", "modsquad")  # gpu: STL, MTL, its embedding control, M3ViT-like
# cpu: 5 seeds and the learning curve within ~8 h of one core: M3ViT-like (a secondary comparison only) is left out
_CPU_TABLE2 = ("mtl", "mtl_embed", "modsquad")
SCALES: dict[str, Scale] = {
    "tiny": Scale(name="tiny", tasks=("class_object", "class_scene", "depth_euclidean", "normal"), img_size=32,
                  patch_size=8, embed_dim=32, depth=2, num_heads=2, moa_experts=4, moa_top_k=2, moa_head_dim=16,
                  moe_experts=4, moe_top_k=2, images=32, buildings=8, batch=4, steps=3, lr=1e-3, warmup=1, seeds=1,
                  workers=0, calib_batches=1, finetune_fractions=(0.25, 0.5), finetune_steps=2, finetune_batch=4,
                  finetune_lrs=(1e-3, 1e-2), finetune_holdout=0.25, finetune_evals=1, amod_depth=2,
                  amod_dense_steps=4, amod_steps=2, amod_evals=1, mone_fixed=(0.2, 1.0), cost_steps=2,
                  time_repeats=2, curve_evals=1, curve_steps=(2, 3), plumbing=True,
                  **dict(_COMMON, thetas=(0.0, 0.01, 0.2))),
    # fractions: the paper's 0.5-5 % of 3.8 M images are 19k-190k images; 0.5 % of this data's 3,000 training
    # images would be 15, so small and cpu learn from 150 to 1,500 images (5-50 %)
    "small": Scale(name="small", tasks=TASK_NAMES, img_size=64, patch_size=8, embed_dim=96, depth=4, num_heads=4,
                   moa_experts=8, moa_top_k=4, moa_head_dim=24, moe_experts=8, moe_top_k=2, images=4000,
                   buildings=16, batch=16, steps=200, lr=1e-3, warmup=20, seeds=2, workers=1, calib_batches=8,
                   finetune_fractions=(0.05, 0.1, 0.2, 0.5), finetune_steps=150, finetune_batch=16,
                   finetune_lrs=(1e-4, 1e-3, 1e-2), finetune_holdout=0.2, finetune_evals=5, amod_depth=8,
                   amod_dense_steps=1500, amod_steps=1000, amod_evals=4, mone_fixed=(0.2, 0.4, 0.6, 0.8, 1.0),
                   cost_steps=6, time_repeats=5, curve_evals=1, **_COMMON),
    "cpu": Scale(name="cpu", tasks=LEARNABLE, img_size=64, patch_size=8, embed_dim=96, depth=4, num_heads=4,
                 moa_experts=8, moa_top_k=4, moa_head_dim=24, moe_experts=8, moe_top_k=2, images=4000, buildings=16,
                 batch=16, steps=1000, lr=1e-3, warmup=50, seeds=5, workers=0, calib_batches=8,
                 finetune_fractions=(0.05, 0.1, 0.2, 0.5), finetune_steps=150, finetune_batch=16,
                 finetune_lrs=(1e-4, 1e-3, 1e-2), finetune_holdout=0.2, finetune_evals=5, amod_depth=8,
                 amod_dense_steps=1500, amod_steps=1000, amod_evals=4, mone_fixed=(0.2, 0.6, 1.0),
                 cost_steps=6, time_repeats=5, table2_methods=_CPU_TABLE2, curve_evals=2,
                 curve_steps=(250, 500, 1000, 2000), tolerance_threads=2, **_COMMON),
    "gpu": Scale(name="gpu", tasks=LEARNABLE, img_size=64, patch_size=8, embed_dim=192, depth=6, num_heads=6,
                 moa_experts=12, moa_top_k=6, moa_head_dim=32, moe_experts=8, moe_top_k=2, images=4000, buildings=16,
                 batch=64, steps=GPU_STEPS, lr=1e-3, warmup=50, seeds=3, workers=2, calib_batches=8,
                 finetune_fractions=(0.05, 0.1, 0.2, 0.5), finetune_steps=300, finetune_batch=32,
                 finetune_lrs=(1e-4, 1e-3, 1e-2), finetune_holdout=0.2, finetune_evals=6, amod_depth=8,
                 amod_dense_steps=2000, amod_steps=1000, amod_evals=4, mone_fixed=(0.2, 0.4, 0.6, 0.8, 1.0),
                 cost_steps=10, time_repeats=20, table2_methods=_LEAN_TABLE2, curve_evals=4, **_COMMON),
    "paper": Scale(name="paper", tasks=TASK_NAMES, img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                   moa_experts=24, moa_top_k=12, moa_head_dim=64, moe_experts=16, moe_top_k=4, images=0,
                   buildings=None, batch=12, steps=0, lr=2e-4, warmup=0, seeds=1, workers=8, calib_batches=64,
                   finetune_fractions=(0.005, 0.01, 0.02, 0.05), finetune_steps=200, finetune_batch=8,
                   finetune_lrs=(1e-4, 1e-3, 1e-2), finetune_holdout=0.2, finetune_evals=5, amod_depth=12,
                   amod_dense_steps=0, amod_steps=0, amod_evals=0, mone_fixed=(0.2, 0.4, 0.6, 0.8, 1.0),
                   cost_steps=0, time_repeats=20, **_COMMON),
}

# Seconds per training step at small scale (batch 16, 64 px, width 96, depth 4, fp32, one process, all 13 tasks;
# STL: one single-task model): the CPU seconds of one thread measured on the 2-core development machine
# (`measure_cost`'s ``cpu_s`` with torch.set_num_threads(1)) divided by 1.7, the speed-up of two threads. Used by
# `estimate_seconds` only for the families this invocation did not measure (the MTL + task embedding control and the
# adapted MoD model step as MTL does).
TWO_THREAD_SPEEDUP = 1.7  # a step on two threads against one (the constants below are two threads' wall seconds)
SMALL_STEP_SECONDS: dict[str, float] = {
    "stl": 0.076 / 1.7, "mtl": 0.72 / 1.7, "m3vit": 0.92 / 1.7, "moe_mlp": 0.88 / 1.7, "moe_attn": 0.72 / 1.7,
    "modsquad": 0.99 / 1.7, "modsquad_balance": 1.1 / 1.7, "modsquad_balance_all": 1.1 / 1.7, "mone": 0.62 / 1.7,
}
DATA_SHARE = 0.2  # reading and augmenting the batches (HDF5 shards, one loader worker) beside a measured step
# Per training run at small scale with 13 tasks: DeepSpeed set-up, the validations at step 0 and at the end (250
# images, every task), the checkpoint and model.pt; a single-task (STL) run costs about a tenth of it.
RUN_OVERHEAD_S = 20.0
# Post-training work per claim and seed at small scale besides router-finetune's fine-tunes (extraction,
# evaluations, usage statistics, forward timing), seconds, measured with `--steps 2 --seeds 1` on the development
# machine while other jobs shared it (load ~5).
SMALL_EXTRA_SECONDS: dict[str, float] = {
    "modsquad-table2": 60.0, "pruning": 100.0, "router-finetune": 40.0, "mi-vs-balance": 20.0, "amod-table3": 40.0,
    "mone-budget": 60.0, "pascal-table3": 70.0,
}
# One fine-tune step of router-finetune (one task, AdamW) against one training step of Mod-Squad with every task at
# the same batch: the forward and backward of one task's rows (1/13 of them), about half of the modes stopping the
# backward at the head. An estimate (not measured on its own).
FINETUNE_STEP_SHARE = 0.6 / 13

# On a GPU (MEASURED.md, one H100, bf16): a reproduction run at the demo widths (D 96, depth 4, 16 images, 64 px)
# took 0.04 s per step for a single-task model and 0.14 s for Mod-Squad with 13 tasks, and "the GPU idles: per-step
# overhead, not arithmetic". The other families are placed between by their CPU ratios to Mod-Squad. While the GPU
# idles a step's time follows the number of layers launched, not the widths or the batch: the plan scales these by
# depth / 4. Not measured at the gpu scale's widths (D 192, batch 64): `estimate_seconds` uses the step times the
# invocation measures before it starts wherever it can.
GPU_DEMO_STEP_SECONDS: dict[str, float] = {
    "stl": 0.04, **{f: 0.14 * v / SMALL_STEP_SECONDS["modsquad"] for f, v in SMALL_STEP_SECONDS.items() if f != "stl"},
}
GPU_DEMO_DEPTH = 4
GPU_RUN_OVERHEAD_S = 15.0  # per 13-task run: set-up, two validations, model.pt (assumed, not measured)
# Post-training work per claim and seed on one GPU besides router-finetune's fine-tunes (assumed, not measured).
GPU_EXTRA_SECONDS: dict[str, float] = {
    "modsquad-table2": 20.0, "pruning": 60.0, "router-finetune": 20.0, "mi-vs-balance": 15.0, "amod-table3": 20.0,
    "mone-budget": 30.0, "pascal-table3": 40.0,
}
# --parallel N on one GPU: N runs at once share a GPU that one run leaves mostly idle. Each further run is assumed to
# add 0.75 of a run's throughput up to one run per 1.5 CPU cores (a run keeps a thread busy launching kernels, and
# its data-loader workers take about half a core); not measured. Several GPUs: one run each (N ≤ GPUs: N times the
# throughput). On a CPU the runs share the cores: no gain is planned (their set-up overlaps; nothing more).
GPU_PARALLEL_EFFICIENCY = 0.75


def parallel_speedup(parallel: int, device: str = "cpu", gpus: int = 1, cores: int = 16) -> float:
    """The planned throughput of ``parallel`` runs at once, in runs (see `GPU_PARALLEL_EFFICIENCY`)."""
    if parallel <= 1 or device != "cuda":
        return 1.0
    if gpus > 1:
        return float(min(parallel, gpus))
    usable = min(parallel, max(1, int(cores / 1.5)))
    return 1.0 + GPU_PARALLEL_EFFICIENCY * (usable - 1)


# pascal-table3 runs on its own data (the synthetic PASCAL-Context, squad.data.synthetic.pascal) with the 5 PASCAL
# tasks: per scale, the keys of `Scale` that differ from the Taskonomy scale (the ViT widths stay the scale's). The
# synthetic render's long side is the model's img_size (the reader pads it to a square); its train/val split is
# PASCAL-Context's (4,998 / 5,105, so about half of the images validate). Paper: Table 3's ViT-S at the 512 px,
# batch 8 of configs/pascal_context/modsquad_vit_s.yaml.
PASCAL_SETTINGS: dict[str, dict] = {
    "tiny": dict(images=16, img_size=32, batch=4, steps=3, thetas=(0.01,), calib_batches=1),
    "small": dict(images=320, img_size=64, batch=16, steps=100, thetas=(0.01,), calib_batches=4),
    "cpu": dict(images=320, img_size=64, batch=16, steps=100, thetas=(0.01,), calib_batches=4),
    "gpu": dict(images=2000, img_size=64, batch=64, steps=1500, thetas=(0.01,), calib_batches=8),
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


def describe_scale(scale: Scale) -> str:
    """One line describing a scale for ``--help`` and the README (its tasks, widths, steps, seeds)."""
    if scale.paper:
        return (f"{scale.name}: ViT-B/16 at {scale.img_size} px on the real Taskonomy, the paper's schedule "
                "(configs and deepspeed commands written, nothing run)")
    tasks = "all 13 tasks" if len(scale.tasks) == len(TASK_NAMES) else f"{len(scale.tasks)} tasks"
    if tuple(scale.tasks) == LEARNABLE:
        tasks = f"the {len(LEARNABLE)} learnable tasks"
    return (f"{scale.name}: {tasks}, {scale.img_size} px, ViT width {scale.embed_dim}, depth {scale.depth}, "
            f"{scale.steps:,} steps of {scale.batch} images, {scale.seeds} seed{'s' if scale.seeds > 1 else ''}")


def get_scale(name: str) -> Scale:
    """The scale called ``name`` (tiny, small, gpu or paper).

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


@dataclasses.dataclass(frozen=True)
class Planned:
    """A training run still to do, as the time plan sees it."""

    family: str  # a method family (`squad.reproduce.runs.FAMILIES`)
    steps: int
    tasks: int  # tasks trained
    depth: int  # blocks
    key: str = ""  # its cost signature: a step time measured for it is looked up by this key


def _cost_family(family: str) -> str:
    return {"mod": "mtl", "mod_stl": "stl", "mtl_embed": "mtl"}.get(family, family)


def planned_step_seconds(p: Planned, scale: Scale, device: str = "cpu") -> float:
    """Seconds per step of a planned run from the constants above (nothing measured for it)."""
    fam = _cost_family(p.family)
    depth = p.depth / scale.depth
    if device == "cuda":
        launch = scale.depth / GPU_DEMO_DEPTH  # launch-bound: per-step time follows the layers
        if fam.startswith("pascal_"):
            base = GPU_DEMO_STEP_SECONDS["stl" if fam == "pascal_stl" else "modsquad"] * (5 / 13 if fam != "pascal_stl"
                                                                                       else 1.0)
            return base * launch
        base = GPU_DEMO_STEP_SECONDS.get(fam, max(GPU_DEMO_STEP_SECONDS.values()))
        # the 13-task figure for any number of tasks: an upper bound (fewer tasks launch fewer per-task slices, and
        # a launch-bound step does not shrink with the arithmetic)
        return base * launch * depth
    if fam.startswith("pascal_"):
        pratio = _size(pascal_scale(scale)) / _size(pascal_scale(SCALES["small"])) \
            if scale.name in PASCAL_SETTINGS else 1.0
        return PASCAL_SMALL_STEP_SECONDS.get(fam, 0.45) * pratio
    ratio = _size(scale) / _size(SCALES["small"])
    per = SMALL_STEP_SECONDS.get(fam, max(SMALL_STEP_SECONDS.values())) * ratio * depth
    return per * (1.0 if fam == "stl" else p.tasks / len(TASK_NAMES))


# Rendering the synthetic Taskonomy at 64 px: images per second per core (4,000 images in 333 s on one core of the
# 2-core development machine, shared; `render_dataset` spreads the rooms over every core), and packing the shards.
RENDER_IMAGES_PER_CORE_S = 12.0
PACK_SECONDS = 30.0


def render_seconds(scale: Scale, cores: int) -> float:
    """Planned seconds to render and pack a scale's synthetic data on ``cores`` cores (0 at the paper scale)."""
    if scale.paper or not scale.images:
        return 0.0
    return scale.images / (RENDER_IMAGES_PER_CORE_S * max(1, cores)) + PACK_SECONDS * scale.images / 4000


def finetune_seconds(scale: Scale, modsquad_step_s: float, tasks: int) -> float:
    """router-finetune's fine-tunes per seed: every task, fraction, mode and lr (`FINETUNE_STEP_SHARE` of a Mod-Squad
    step at the fine-tune batch), with its held-out and validation evaluations (a fifth more)."""
    runs = tasks * len(scale.finetune_fractions) * 4 * len(scale.finetune_lrs)
    per = modsquad_step_s * FINETUNE_STEP_SHARE * scale.finetune_batch / scale.batch
    return 1.2 * runs * scale.finetune_steps * per


def estimate_seconds(plan: list[Planned], step_seconds: dict[str, float], scale: Scale,
                     claims: list[str] | None = None, seeds: int = 1, parallel: int = 1, device: str = "cpu",
                     gpus: int = 1, cores: int = 16) -> float:
    """The planned wall time of an invocation: the training runs still to do, and the claims' other work.

    Args:
        plan: every run still to train.
        step_seconds: seconds per step measured just before, by cost signature (`Planned.key`).
        scale: the scale (the constants above fill in what was not measured).
        claims: the claims measured (their post-training work is added).
        seeds: seeds per run.
        parallel: runs trained at once (``--parallel``); the fine-tunes of router-finetune run that way too.
        device: ``cpu`` or ``cuda``.
        gpus, cores: of the machine (`parallel_speedup`); on a CPU, ``cores=1`` plans one thread per run (the
            constants' two-thread step times × `TWO_THREAD_SPEEDUP`).
    """
    gpu = device == "cuda"
    speedup = parallel_speedup(parallel, device, gpus, cores)
    ratio = _size(scale) / _size(SCALES["small"])
    extra_table = GPU_EXTRA_SECONDS if gpu else SMALL_EXTRA_SECONDS
    serial = sum(max(5.0, extra_table.get(c, 0.0) * (1.0 if gpu else ratio)) for c in claims or []) * seeds
    jobs = 0.0
    if "router-finetune" in (claims or []):
        msq = step_seconds.get("modsquad") or planned_step_seconds(Planned("modsquad", 1, len(scale.tasks),
                                                                           scale.depth), scale, device)
        held = sum(1 for t in HELD_OUT if t in scale.tasks)
        jobs += finetune_seconds(scale, msq, held) * seeds
    train = 0.0
    for p in plan:
        per = step_seconds.get(p.key) or planned_step_seconds(p, scale, device) * (
            TWO_THREAD_SPEEDUP if not gpu and cores == 1 else 1.0)  # one core: one thread's step time
        if p.family.startswith("pascal_"):
            share = 0.3 if p.family == "pascal_stl" else 1.0
            overhead = (GPU_RUN_OVERHEAD_S if gpu else PASCAL_RUN_OVERHEAD_S) * share
        else:
            share = 0.1 if p.family == "stl" else p.tasks / len(TASK_NAMES)
            overhead = (GPU_RUN_OVERHEAD_S if gpu else RUN_OVERHEAD_S * min(1.0, ratio)) * max(0.1, share)
        train += p.steps * per * (1 + DATA_SHARE) + 1.0 + overhead
    return train / speedup + jobs / speedup + serial


def format_duration(seconds: float) -> str:
    """``1 h 05 min``, ``12 min``, ``40 s``, ``0.3 s``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    minutes = math.ceil(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"
