"""Bench case ``data``: what one loader core gives at 224 px with all 13 domains and augmentation on — from HDF5 shards
and from the PNG tree — split by stage, and the cores per GPU a step rate needs.

The figures are absolute (samples per second of one core's CPU time, `time.thread_time`, so other processes on the
machine do not count against it), measured on the loader's per-sample stage as a DataLoader worker runs it
(`squad.data.samples.SampleDataset.__getitems__` and `squad.data.device.collate_integers`, in this process, one
thread). The per-pixel work that the training device does on the whole batch (`squad.data.device.decode_batch`) is
timed apart, on this machine's CPU (and on the GPU with ``--device cuda``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from squad.data.accounting import track
from squad.data.device import collate_integers, decode_batch
from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.data.samplers import ResumableSampler
from squad.data.samples import SampleDataset, collate
from squad.data.shards import ShardDataset
from squad.data.taskonomy import TaskonomyDataset
from squad.timing import BenchResult

# the modelled H100 rate of modsquad_vit_b, all 13 tasks in one pass (issue 38: a ViT-B step at 35 % MFU)
DEFAULT_STEP_RATE = 3000.0
TARGET_PER_CORE = 1000.0  # samples/s per loader core from shards (DESIGN.md's input contract)
IMAGE, STORED, TREE = 224, 256, 512  # crop, packed size (the resize before the crop), Taskonomy's file size


def _cpu_seconds(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _batches(ds: SampleDataset, batch: int) -> list[list[int]]:
    """One epoch of the training order (blocks of 64 shuffled 4 at a time, as `squad.data.build_loader` reads)."""
    order = list(ResumableSampler(len(ds), batch, block=64, buffer=4, seed=0))
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def per_core(ds: SampleDataset, batch: int, repeats: int, limit: int | None = None) -> dict[str, float]:
    """Samples/s of one core through the integer stage (the best of `repeats` epochs after a warm-up one), and the
    per-sample microseconds of its stages: ``read`` (the stored arrays), ``crop`` (augmentation draws, checks, the
    crop; a resize where the stored size differs) and ``collate`` (stacking the batch, a DataLoader worker's
    copy into shared memory aside). `limit`: the first batches of the epoch only."""
    ds.integer_batches = True
    batches = _batches(ds, batch)[:limit]
    n = sum(len(b) for b in batches)

    def epoch() -> None:
        for b in batches:
            collate_integers(ds.__getitems__(b))

    def read() -> None:
        for b in batches:
            ds._prefetch(b)
            for i in b:
                for k, d in enumerate(ds.domains):
                    if int(ds._present[i]) >> k & 1:
                        ds._read(i, d)
            ds._prefetch(())

    epoch()
    total = min(_cpu_seconds(epoch) for _ in range(repeats))
    t_read = min(_cpu_seconds(read) for _ in range(repeats))
    items = [ds.__getitems__(b) for b in batches]
    def stack() -> None:  # each batch dropped before the next, as in `epoch` (no fresh pages per batch)
        for x in items:
            collate_integers(x)

    t_collate = min(_cpu_seconds(stack) for _ in range(repeats))
    us = 1e6 / n
    return {"samples_per_s": n / total, "read_us": t_read * us, "crop_us": max(0.0, total - t_read - t_collate) * us,
            "collate_us": t_collate * us, "samples": n}


def per_sample_pipeline(ds: SampleDataset, batch: int) -> float:
    """Samples/s of one core through the per-sample float pipeline (`SamplePipeline.__call__` and `collate`): what
    every worker did before the integer stage, and what evaluation still does."""
    ds.integer_batches = False
    batches = _batches(ds, batch)[:2]
    n = sum(len(b) for b in batches)
    return n / _cpu_seconds(lambda: [collate([ds[i] for i in b]) for b in batches])


def device_decode(ds: SampleDataset, batch: int, device: str) -> float:
    """Samples/s of `decode_batch` on `device` (all the threads torch uses there) for integer batches of `ds`."""
    ds.integer_batches = True
    b = collate_integers(ds.__getitems__(_batches(ds, batch)[0]))
    decode_batch(b, ds.pipeline, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        decode_batch(b, ds.pipeline, device)
    sync()
    return 3 * len(b["id"]) / (time.perf_counter() - t0)


def bench_data(tmpdir: str | Path | None = None, quick: bool = False, device: str = "cpu",
               step_rate: float | None = None) -> list[BenchResult]:
    """The loader's figures at 224 px, all 13 domains, augmentation on (module docstring).

    Writes its own data (`write_random_tree`: 512 samples, 16 distinct, the rest byte copies): a tree at
    Taskonomy's 512 px, shards packed from it at 256 px, and a tree at 256 px (the PNG reader without its resize).
    `quick` (a smoke test, not a figure): 32 samples, every size a quarter. Rows, each in samples/s of one loader
    core unless named otherwise:

    * ``data_shards_224px_per_core`` (the contract, >= 1,000): shards at 256 px read at 224 px;
    * ``data_png_tree_512px_per_core`` / ``data_png_tree_256px_per_core``: the PNG tree at 512 px (decode and a
      mask-aware resize per sample) and at 256 px (decode only);
    * ``hdf5_vs_png_13_domains`` (>= 3): the shards' rate over the 512 px tree's;
    * ``data_shards_per_sample_pipeline``: the per-sample float pipeline on the same shards (what came before);
    * ``data_device_decode_{cpu,cuda}``: the batched decode on the training device, samples/s;
    * ``data_cores_per_gpu``: loader cores one GPU needs at `step_rate` images/s from shards.

    Args:
        tmpdir: scratch folder (a temporary one is made and removed when None).
        quick: fewer samples and repeats.
        device: ``"cuda"`` adds the decode's rate on the GPU.
        step_rate: images/s one GPU trains at (``tools/bench.py --step-rate``; default `DEFAULT_STEP_RATE`).
    """
    if tmpdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return bench_data(tmp, quick, device, step_rate)
    tmpdir, rate = Path(tmpdir), float(step_rate or DEFAULT_STEP_RATE)
    n, batch, repeats = (32, 8, 1) if quick else (512, 64, 2)
    image, stored, big = (s // 4 for s in (IMAGE, STORED, TREE)) if quick else (IMAGE, STORED, TREE)
    tree = write_random_tree(tmpdir / "tree_big", n=n, size=big, unique=8)
    small = write_random_tree(tmpdir / "tree_stored", n=n, size=stored, unique=8)
    shards = tmpdir / "shards"
    pack_shards(tree, shards, image_size=stored, partitions=("train",), workers=2)
    opts = {"image_size": image, "resize": stored, "augment": True, "split": "train"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one loader core
    try:
        with track():  # the bench's own data: no accounting lines at the tool's end
            h5 = ShardDataset(shards, "all", **opts)
            figures = {"shards": per_core(h5, batch, repeats),  # the PNG trees: 2 batches, once (decoding is slow)
                       "png_512": per_core(TaskonomyDataset(tree, "all", **opts), batch, 1, limit=2),
                       "png_256": per_core(TaskonomyDataset(small, "all", **opts), batch, 1, limit=2)}
            old = per_sample_pipeline(ShardDataset(shards, "all", **opts), batch)
    finally:
        torch.set_num_threads(threads)
    base = {"image_size": image, "stored_size": stored, "domains": len(h5.domains), "augment": True,
            "batch": batch, "one_core": "thread CPU time"}
    rows = []
    for key, name, what in (("shards", "data_shards_224px_per_core", f"shards packed at {stored} px"),
                            ("png_512", "data_png_tree_512px_per_core", f"PNG tree at {big} px"),
                            ("png_256", "data_png_tree_256px_per_core", f"PNG tree at {stored} px")):
        f = figures[key]
        ok = f["samples_per_s"] >= TARGET_PER_CORE if key == "shards" else None
        rows.append(BenchResult(name, f["samples_per_s"], f">= {TARGET_PER_CORE:.0f}" if key == "shards" else "",
                                "samples/s/core", ok, {**base, **f, "source": what}))
    for key, label in (("shards", "shards"), ("png_512", "png_tree_512px")):
        for stage in ("read", "crop", "collate"):
            rows.append(BenchResult(f"data_{label}_{stage}_us", figures[key][f"{stage}_us"], "", "us/sample", None,
                                    {**base, "stage": stage}))
    ratio = figures["shards"]["samples_per_s"] / figures["png_512"]["samples_per_s"]
    rows.append(BenchResult("hdf5_vs_png_13_domains", ratio, ">= 3", "x", ratio >= 3,
                            {**base, "shards": figures["shards"]["samples_per_s"],
                             "png_512": figures["png_512"]["samples_per_s"]}))
    rows.append(BenchResult("data_shards_per_sample_pipeline", old, "", "samples/s/core", None,
                            {**base, "what": "SamplePipeline.__call__ + collate per sample (float targets)"}))
    for dev in ("cpu", "cuda") if device == "cuda" else ("cpu",):
        rows.append(BenchResult(f"data_device_decode_{dev}", device_decode(h5, batch, dev), "", "samples/s", None,
                                {**base, "threads": torch.get_num_threads() if dev == "cpu" else None}))
    cores = rate / figures["shards"]["samples_per_s"]
    rows.append(BenchResult("data_cores_per_gpu", cores, "", "cores", None,
                            {**base, "step_rate": rate, "per_core": figures["shards"]["samples_per_s"]}))
    return rows
