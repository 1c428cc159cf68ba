"""Capacity plan of a training run: ``tools/bench.py --plan CONFIG --gpus N`` — per-device step time, memory and
images/s, the data rate the loader must sustain, and the wall time of the run, for N devices like the one this
machine has, from a training step measured here (`squad.bench.step`) and the dataset's size. An estimate:

- The step is measured on this machine's device: on a GPU at the config's own widths and batch per GPU (bf16); on
  a CPU at a shrunken width (`squad.bench.step.CPU_WIDTH`, fp32), then scaled to the config's MACs at the FLOP rate
  the measured step reached (same MFU).
- Memory per device = model state (parameters, gradients, AdamW state, as the ZeRO paper counts them for the run's
  precision, ZeRO stage over N devices and expert-parallel sizes: `squad.bench.layouts`) + activations (measured
  beside the step: its peak above the resident parameters and optimizer state; scaled with the MACs per embedding
  width — rows × tokens × widths — when the step was measured at a shrunken width).
- Layouts: the same memory for every ZeRO stage and expert-parallel layout (none, the config's, 8 GPUs per group for
  the MoE MLP alone and for MoE attention too), the 80 GiB GPUs
  each needs at least, and the all-to-all bytes an expert-parallel step sends per GPU (`squad.bench.layouts`).
- Not included: the gradient all-reduce between devices, data loading stalls, validation and checkpoint time.
- The dataset: counted when ``data.root`` exists here; else ``--images``, else a documented estimate (Taskonomy:
  4M images over the 537 buildings of the fullplus split, DESIGN.md / FACTS.md §5, times the training buildings
  of the config's split; PASCAL-Context 4,998 and NYUD-v2 795 training images).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

import squad
from squad.bench import step as bench_step
from squad.bench.layouts import (
    expert_parameters,
    format_layouts,
    layout_table,
    layouts_to_show,
    rows_per_gpu,
    state_bytes,
)
from squad.bench.step import StepSetup, device_name, measure_steps, step_macs, width_label
from squad.config.run import RunConfig
from squad.config.run import precision as run_precision
from squad.data import build_dataset
from squad.models.vit import SquadViT

TASKONOMY_IMAGES = 4_000_000  # the whole dataset (DESIGN.md)
TASKONOMY_BUILDINGS = 537  # fullplus: 381 train + 75 val + 81 test (FACTS.md §5)
TASKONOMY_TRAIN_BUILDINGS = {"tiny": 25, "medium": 98, "full": 344, "fullplus": 381}  # FACTS.md §5
TRAIN_IMAGES = {"pascal_context": 4998, "nyud": 795}  # FACTS.md


def dataset_images(cfg: RunConfig, images: int | None = None) -> tuple[int, str]:
    """Training images of the run and where the number comes from."""
    if images is not None:
        return images, "--images"
    d = cfg.data
    root = Path(d.root)
    if root.exists():
        ds = build_dataset(root, cfg.train_tasks(), d.split, dataset=d.dataset, split_csv=d.split_csv,
                           image_size=cfg.model.img_size, augment=False, task_options=cfg.model.task_options)
        return len(ds), f"counted in data.root={d.root} (split {d.split})"
    if d.dataset in TRAIN_IMAGES and d.split == "train":
        return TRAIN_IMAGES[d.dataset], f"{d.dataset} training split (FACTS.md); data.root={d.root} is not here"
    if d.dataset == "taskonomy":
        name = Path(d.split_csv or "train_val_test_full.csv").stem.removeprefix("train_val_test_")
        if name in TASKONOMY_TRAIN_BUILDINGS and d.split == "train":
            n = round(TASKONOMY_IMAGES * TASKONOMY_TRAIN_BUILDINGS[name] / TASKONOMY_BUILDINGS)
            return n, (f"estimate: 4M Taskonomy images over {TASKONOMY_BUILDINGS} buildings × "
                       f"{TASKONOMY_TRAIN_BUILDINGS[name]} training buildings of the {name} split "
                       f"(data.root={d.root} is not here; --images N to use a counted number)")
        if d.split == "all":
            return TASKONOMY_IMAGES, "estimate: the whole of Taskonomy (4M images)"
    raise ValueError(f"the size of the training set of {d.dataset} (data.root={d.root}, split {d.split}, "
                     f"split_csv {d.split_csv}) is unknown here: give it with --images N")


def _activation_units(model: SquadViT, images: int) -> float:
    """What activation memory grows with: rows × tokens × widths, i.e. the step's MACs per embedding width."""
    return step_macs(model) / model.cfg.embed_dim * images


def capacity_plan(config: str | Path, gpus: int, *, batch_per_gpu: int | None = None, images: int | None = None,
                  epochs: float | None = None, overrides: Sequence[str] = (), quick: bool = False) -> dict:
    """The plan of ``config`` on ``gpus`` devices like this machine's (see the module docstring).

    Args:
        config: a run config (YAML).
        gpus: data-parallel devices (ranks).
        batch_per_gpu: images per device per step (default: the config's ``optim.batch_per_rank``).
        images: training images (default: counted or estimated, `dataset_images`).
        epochs: epochs of the run (default: the config's ``optim.epochs``, or its ``optim.steps``).
        overrides: ``key=value`` config overrides.
        quick: measure at a tiny width (tests).

    Returns:
        A JSON-ready dict: ``measured`` (the step as measured here), ``estimate`` (per device and for the run) and
        ``basis`` (how each figure was obtained).

    Raises:
        ValueError: gpus or batch below 1, or a dataset whose size is unknown.
    """
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    cfg = squad.load_config(config, list(overrides))
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"{config} is a model config; --plan needs a run config (with optim/data/train sections, "
                         f"e.g. configs/taskonomy/modsquad_vit_b.yaml)")
    batch = batch_per_gpu or cfg.optim.batch_per_rank
    if batch < 1:
        raise ValueError(f"--batch-per-gpu must be >= 1, got {batch}")
    tasks = cfg.train_tasks()
    n_images, source = dataset_images(cfg, images)
    accum = cfg.optim.grad_accum
    batches_per_epoch = n_images // (gpus * batch)
    if batches_per_epoch == 0:
        raise ValueError(f"{n_images} training images are fewer than one batch ({gpus} devices × {batch} images)")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    width = [] if cuda and not quick else (bench_step.QUICK_WIDTH if quick else bench_step.CPU_WIDTH)
    measured_batch = min(batch, 4) if quick else batch
    full_cfg = cfg.model
    # the measured step runs in one process: its shrunken experts are not split over ranks
    single = ["model.moe.expert_parallel=1", "model.moa.expert_parallel=1"]
    small = squad.load_config(config, [*overrides, *width, *single]) if width else cfg
    setup = StepSetup(small.model, cfg.loss, measured_batch, device, dtype,
                      checkpointing=cfg.train.activation_checkpointing, checkpoint_every=cfg.train.checkpoint_every)
    (res,), rate = measure_steps([setup], repeats=2 if quick else 5, warmup=1, tasks=tasks, quick=quick)
    if isinstance(res, str):
        raise RuntimeError(f"the measured step failed: {res}")

    with torch.device("meta"):  # the config's own model, shapes only
        full_model = squad.build_model(full_cfg)
        small_model = squad.build_model(small.model)
    full_macs = step_macs(full_model, tasks)
    achieved = 6 * res.macs_per_image * measured_batch / res.seconds  # FLOP/s the measured step reached
    step_s = 6 * full_macs * batch / achieved
    precision = "bf16" if cuda else "fp32"
    params = sum(p.numel() for p in full_model.parameters())
    experts = expert_parameters(full_model)
    run_ep = {"moe": full_cfg.moe.expert_parallel, "moa": full_cfg.moa.expert_parallel}
    state = state_bytes(params, experts, precision, cfg.train.zero_stage, run_ep, gpus)
    scale = _activation_units(full_model, batch) / _activation_units(small_model, measured_batch) if width else 1.0
    activations = None if res.activation_bytes is None else res.activation_bytes * scale
    memory = None if activations is None else state + activations
    gpu_precision = run_precision(cfg.train, True)  # what the config trains in on GPUs (auto: bf16)
    layouts = layout_table(full_model, gpu_precision, gpus, rows_per_gpu(batch, cfg.train.tasks_per_image,
                                                                          len(tasks)), activations,
                           layouts_to_show(run_ep))

    steps_per_epoch = max(1, batches_per_epoch // accum)
    # as the trainer counts: optim.steps when set, else optim.epochs (--epochs wins over both)
    run_epochs = epochs if epochs is not None else (None if cfg.optim.steps > 0 else cfg.optim.epochs)
    total_steps = cfg.optim.steps if run_epochs is None else math.ceil(run_epochs * steps_per_epoch)
    micro_steps = total_steps * accum
    wall = micro_steps * step_s
    per_gpu = batch / step_s
    files = 1 + len(tasks)  # rgb + one file per target domain
    return {
        "config": str(config), "model": full_cfg.name, "tasks": len(tasks), "gpus": gpus, "batch_per_gpu": batch,
        "grad_accum": accum, "global_batch": gpus * batch * accum, "zero_stage": cfg.train.zero_stage,
        "expert_parallel": run_ep, "layouts": layouts, "layout_precision": gpu_precision, "expert_params": experts,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "measured": {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                     "width": width_label(small.model, width), "images": measured_batch, "step_s": res.seconds,
                     "mfu": res.mfu, "matmul_flops": rate["flops"], "macs_per_image": res.macs_per_image,
                     "peak_memory_bytes": res.peak_bytes, "activation_bytes": res.activation_bytes},
        "estimate": {"step_s": step_s, "images_per_s_per_gpu": per_gpu, "images_per_s": per_gpu * gpus,
                     "memory_per_gpu_bytes": memory, "model_state_bytes": state, "activation_bytes": activations,
                     "params": params, "macs_per_image": full_macs, "loader_images_per_s_per_gpu": per_gpu,
                     "loader_images_per_s": per_gpu * gpus, "loader_files_per_s": per_gpu * gpus * files,
                     "files_per_image": files, "dataset_images": n_images, "dataset_source": source,
                     "epochs": run_epochs, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
                     "wall_s": wall, "wall_days": wall / 86400},
        "basis": [
            f"step measured on {device_name(device)} ({str(dtype).removeprefix('torch.')}, "
            f"{width_label(small.model, width)}, {measured_batch} images, "
            f"{res.mfu:.1%} of the measured {rate['dtype']} matmul rate {rate['flops'] / 1e12:.3g} TFLOP/s)",
            "step time at the config's size = 6 × its step MACs × batch / the FLOP rate the measured step reached"
            if width else "step time measured at the config's size",
            f"memory = model state ({state / params:.2f} bytes/param on average, {precision}, ZeRO-"
            f"{cfg.train.zero_stage} over {gpus}, expert_parallel {run_ep['moe']} (MoE MLP) / {run_ep['moa']} (MoE "
            f"attention): squad.bench.layouts) + activations "
            + ("measured" if not width else "measured at the shrunken width, scaled by rows × tokens × widths"),
            f"layouts: model state in {gpu_precision} (the config's precision on GPUs) + the same activations, for "
            f"each ZeRO stage and expert-parallel size; all-to-all bytes sent per GPU per step, forward and backward, "
            f"routing spread evenly (squad.bench.layouts)",
            f"dataset: {n_images:,} images ({source})",
            "not included: gradient all-reduce across devices, loader stalls, validation, checkpoints",
        ],
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.0f} s"


def format_plan(plan: dict) -> str:
    """The plan as text: an estimate, with how it was obtained."""
    m, e = plan["measured"], plan["estimate"]
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    lines = [
        f"capacity plan (ESTIMATE) for {plan['config']} ({plan['model']}, {plan['tasks']} tasks) on "
        f"{plan['gpus']} devices like this one: {m['device']}",
        f"  batch {plan['batch_per_gpu']}/device × {plan['gpus']} × accum {plan['grad_accum']} = "
        f"{plan['global_batch']} images per step; ZeRO-{plan['zero_stage']}; activation checkpointing "
        f"{plan['activation_checkpointing']}",
        f"  measured here: {m['step_s'] * 1e3:.1f} ms per step of {m['images']} images ({m['width']}), "
        f"MFU {m['mfu']:.1%}",
        f"  per device:    step {e['step_s']:.3g} s, {e['images_per_s_per_gpu']:.3g} images/s, memory "
        f"{gib(e['memory_per_gpu_bytes'])} (model state {gib(e['model_state_bytes'])}, activations "
        f"{gib(e['activation_bytes'])}), {_si(6 * e['macs_per_image'], 'FLOP')} per image",
        f"  all devices:   {e['images_per_s']:.4g} images/s; the loader must sustain "
        f"{e['loader_images_per_s_per_gpu']:.3g} images/s per device, {e['loader_images_per_s']:.4g} images/s "
        f"({e['loader_files_per_s']:.4g} files/s: {e['files_per_image']} per image) in all",
        f"  run:           {e['dataset_images']:,} training images, {e['steps_per_epoch']:,} steps per epoch, "
        f"{e['total_steps']:,} steps" + (f" ({e['epochs']:g} epochs)" if e["epochs"] else "")
        + f": {_duration(e['wall_s'])} of training",
        *format_layouts(plan["layouts"], e["params"], plan["expert_params"]),
        "  basis:",
        *[f"    - {b}" for b in plan["basis"]],
    ]
    return "\n".join(lines)
