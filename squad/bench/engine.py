"""Bench case ``engine``: what the training engine costs beyond the model's own steps.

A single-task run at the reproduction's small widths (`WIDTHS`: 64 px, patch 8, ViT width 96, depth 4, batch 16,
one thread, the data read in the training process) is trained twice by `squad.train.engine.train` — ``short`` and
``long`` steps, each with its start-up, its validations at step 0 and at the end, its checkpoint and its export —
beside bare forward + backward + AdamW steps of the same model on one batch (`squad.train.cost.measure_cost`,
before and after the runs). Everything is CPU time of this process (the engine reads its data in-process here, so
nothing runs in a child), which the other processes of a shared machine disturb far less than wall time.

Rows:

* ``engine_step_vs_bare`` (≤ 1.5): the engine's CPU per step, ``(C_long − C_short) / (long − short)`` — the
  fixed costs cancel — against the bare step: data loading, DeepSpeed's wrappers and gradient clipping, logging.
* ``engine_run_vs_bare`` (≤ 1.5): the whole ``long`` run's CPU (start-up, two validations, checkpoint, export
  included) against ``long`` bare steps.
* ``engine_fixed_cpu_s`` and ``engine_fixed_wall_s`` (informational): what a run costs besides its steps (start-up,
  validations, checkpoint, export) in CPU and in wall seconds; the wall figure also shows waiting, e.g. for a
  DeepSpeed op being rebuilt at start-up (40–130 s when installations shared its build folder).

The data is a random Taskonomy-format tree (`squad.data.offline.random_tree`) packed into HDF5 shards, validated
on a few batches of its training split.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from squad.config.base import to_dict
from squad.config.loading import load_config
from squad.config.run import RunConfig
from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.distributed import prepare_environment
from squad.timing import BenchResult, check
from squad.train.cost import measure_cost

WIDTHS = {"img_size": 64, "patch_size": 8, "embed_dim": 96, "depth": 4, "num_heads": 4}
TASK = "depth_zbuffer"
BATCH = 16


def run_config(root: Path, steps: int) -> RunConfig:
    """The STL run the case trains: stl_vit_b at `WIDTHS` on ``TASK``, AdamW with warm-up and cosine, clipping,
    the logging of a reproduction run (every 25 steps), validations at the start and the end (4 batches)."""
    paper = load_config("stl_vit_b")
    return load_config({
        "model": {**to_dict(paper.model), **WIDTHS, "head_dim": None, "heads": [TASK]},
        "loss": to_dict(paper.loss),
        "data": {"root": str(root), "workers": 0, "val_split": "train", "val_batches": 4},
        "optim": {"lr": 1e-3, "weight_decay": 0.05, "steps": steps, "batch_per_rank": BATCH, "clip": 1.0,
                  "warmup_steps": min(20, steps - 1), "min_lr": 1e-6},
        "train": {"seed": 0, "log_every": 25, "eval_every": 0, "ckpt_every": 0, "progress": False},
    }, cls=RunConfig)


def _train_cpu(cfg: RunConfig, run_dir: Path) -> tuple[float, float]:
    """CPU seconds of this process and wall seconds of one whole engine run."""
    from squad.train.engine import train

    c0, t0 = time.process_time(), time.perf_counter()
    train(cfg, run_dir, "none")
    return time.process_time() - c0, time.perf_counter() - t0


def bench_engine(quick: bool = False, tmpdir: str | Path | None = None) -> list[BenchResult]:
    """Engine steps and a whole engine run against bare steps (module docstring), one thread, CPU time."""
    if tmpdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return bench_engine(quick, tmp)
    tmp = Path(tmpdir)
    short, long_, bare_steps = (4, 12, 3) if quick else (20, 200, 20)
    prepare_environment()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    quiet = [logging.getLogger(n) for n in ("DeepSpeed", "deepspeed", "torch.distributed")]
    levels = [q.level for q in quiet]
    console = logging.StreamHandler()  # warnings only (the engine adds no console of its own beside one)
    console.setLevel(logging.WARNING)
    logging.getLogger("squad").addHandler(console)
    try:
        for q in quiet:
            q.setLevel(logging.WARNING)
        tree = write_random_tree(tmp / "tree", n=64, size=WIDTHS["img_size"], buildings=4, unique=16)
        pack_shards(tree, tmp / "shards", image_size=WIDTHS["img_size"], partitions=("train",), workers=1)
        cfg = run_config(tmp / "shards", long_)
        before = measure_cost(cfg, bare_steps)["cpu_s"]
        (c_short, w_short), (c_long, w_long) = (_train_cpu(run_config(tmp / "shards", short), tmp / "short"),
                                                _train_cpu(cfg, tmp / "long"))
        after = measure_cost(cfg, bare_steps)["cpu_s"]
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("squad").removeHandler(console)
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    bare = statistics.fmean([before, after])
    step = (c_long - c_short) / (long_ - short)
    fixed = c_long - long_ * step
    fixed_wall = w_long - long_ * (w_long - w_short) / (long_ - short)
    details = {"run_wall_s": {str(short): w_short, str(long_): w_long}, "fixed_wall_s": fixed_wall,
               "bare_cpu_s": bare, "bare_before_cpu_s": before, "bare_after_cpu_s": after, "engine_step_cpu_s": step,
               "run_cpu_s": {str(short): c_short, str(long_): c_long}, "fixed_cpu_s": fixed, "threads": 1,
               "model": f"stl_vit_b {WIDTHS}, {TASK}, batch {BATCH}"}
    step_ratio, run_ratio = step / bare, c_long / (long_ * bare)
    return [BenchResult("engine_step_vs_bare", step_ratio, "<= 1.5", "x CPU time", check(step_ratio, "<= 1.5"),
                        details),
            BenchResult(f"engine_run_{long_}_steps_vs_bare", run_ratio, "<= 1.5", "x CPU time",
                        check(run_ratio, "<= 1.5"), details),
            BenchResult("engine_fixed_cpu_s", fixed, "", "s", None, details),
            BenchResult("engine_fixed_wall_s", fixed_wall, "", "s", None, details)]
