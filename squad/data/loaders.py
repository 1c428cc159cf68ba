"""Building datasets and loaders: `build_dataset` (whichever dataset and format a folder holds), `build_loader` and
`set_epoch` (the training loader: order sharded over ranks, resumable mid-epoch; the one `squad.train` runs), and
`eval_loader` (each rank's in-order share, every sample at most once).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from squad.data.benchmark import DATASETS, check_dataset_tasks
from squad.data.device import collate_integers
from squad.data.nyud import NYUDDataset
from squad.data.pascal import PascalContextDataset
from squad.data.samplers import InOrderBatches, ResumableSampler
from squad.data.samples import SampleDataset, collate
from squad.data.shards import BenchmarkShardDataset, ShardDataset, detect_dataset, is_shard_root
from squad.data.taskonomy import TaskonomyDataset, make_data_hint
from squad.tasks import NYUD_TASKS, PASCAL_TASKS

# names only PASCAL-Context / NYUD provide: asking a Taskonomy tree for them is an error naming its tasks
BENCHMARK_ONLY_TASKS = frozenset(PASCAL_TASKS) | frozenset(NYUD_TASKS)
MAX_AUTO_WORKERS = 8  # loader workers per rank when data.workers is left to the cores (tools/bench.py --only data)


def build_dataset(root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                  dataset: str | None = None, **kwargs: Any) -> SampleDataset:
    """The dataset for `root`, whichever dataset and format it is in.

    Args:
        root: a Taskonomy tree (either layout), a PASCAL-Context (PASCAL_MT) or NYUD-v2 (MTI-Net) folder, or a
            shard folder written by ``tools/make_data.py pack``.
        tasks: task names or aliases, or ``"all"`` (the dataset's tasks).
        split: ``"train"``, ``"val"``, ``"test"`` (Taskonomy), ``"all"`` or a list of them.
        dataset: ``"taskonomy"``, ``"pascal_context"`` or ``"nyud"`` (``data.dataset``); None: detected from
            `root` (`squad.data.shards.detect_dataset`: the shard index's record, else the folder layout).
        **kwargs: the readers' common options — ``image_size``, ``resize``, ``augment``, ``missing``,
            ``geometry_mask``, ``seed``, ``buildings``, ``task_options`` (the options of the model the data is
            for: ``model.task_options``, so targets decode as that model's tasks do) — plus ``split_csv`` for trees
            (ignored for shards, which were split when packed). The PASCAL / NYUD readers ignore the Taskonomy-only
            ones.

    Raises:
        FileNotFoundError: `root` does not exist; the message says how to make data.
        DatasetTaskError: a task the dataset does not provide (the message lists its tasks; a ValueError).
        ValueError: an unknown dataset, or `root` holds another dataset than `dataset`.
    """
    root = Path(root)
    if not root.exists():
        hint = make_data_hint(root) if dataset in (None, "taskonomy") else (
            f"Make a small synthetic one with: python tools/make_data.py synthetic --dataset {dataset} --out {root}")
        raise FileNotFoundError(f"data root {root} does not exist. {hint}")
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)}")
    found = detect_dataset(root)
    if dataset is None:
        dataset = found
    elif found != dataset and (found != "taskonomy" or is_shard_root(root)):
        raise ValueError(f"{root} holds {found} data, but the dataset asked for is {dataset}")
    foreign = [t for t in ([tasks] if isinstance(tasks, str) else tasks) if t in BENCHMARK_ONLY_TASKS]
    if dataset == "taskonomy" and foreign:
        check_dataset_tasks("taskonomy", foreign)
    if is_shard_root(root):
        kwargs.pop("split_csv", None)
        if dataset != "taskonomy":
            return BenchmarkShardDataset(root, tasks, split=split, **kwargs)
        return ShardDataset(root, tasks, split=split, **kwargs)
    if dataset == "pascal_context":
        return PascalContextDataset(root, tasks, split=split, **kwargs)
    if dataset == "nyud":
        return NYUDDataset(root, tasks, split=split, **kwargs)
    return TaskonomyDataset(root, tasks, split=split, **kwargs)


def loader_workers(workers: int | None, ranks_per_node: int = 1) -> int:
    """DataLoader workers per rank: `workers` when set; None gives this process's share of the cores it may run on
    (``os.sched_getaffinity``) less one for the training process itself, at least 1 and at most `MAX_AUTO_WORKERS`.
    On a GPU node that is the cores per GPU less one (`ranks_per_node`: the ranks sharing the node's cores)."""
    if workers is not None:
        return int(workers)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cores // max(1, ranks_per_node) - 1))


def integer_stage(dataset: SampleDataset) -> bool:
    """Whether a dataset's pipeline hands over integers for `squad.data.device.decode_batch` (Taskonomy's square
    crops do; the benchmarks' fit-and-pad runs per sample)."""
    return hasattr(dataset.pipeline, "integers")


def build_loader(dataset: SampleDataset, batch_size: int, *, seed: int = 0, num_workers: int = 0, rank: int = 0,
                 world: int = 1, grad_accum: int = 1, pin_memory: bool = False, prefetch: int = 4,
                 device_decode: bool = True, block: int = 1, buffer: int = 1) -> DataLoader:
    """The training loader: this rank's share of a seeded permutation per epoch, full global batches only, resumable
    mid-epoch (`squad.data.samplers.ResumableSampler`).

    With `device_decode` and a pipeline that has an integer stage (`integer_stage`), batches are integer batches
    (`squad.data.device`): the workers read and crop, and the training loop decodes them with
    `squad.data.device.decode_batch` on its device; otherwise batches are `collate`'s decoded ones.

    Call `set_epoch(loader, epoch)` before each epoch: it sets the order, the augmentation draws and, after a resume,
    the batches of the epoch already consumed.

    Args:
        dataset: a `SampleDataset` (any reader, tree or shards).
        batch_size: images per rank and step.
        seed: the permutation seed, the same on every rank (each epoch's order comes from (seed, epoch)); it also
            seeds the loader's own generator, from which the workers' base seed is drawn — never from the global RNG
            that a training step reseeds, so where an epoch starts does not shift anything else.
        num_workers: worker processes (each opens its own files).
        rank: this rank's index among ``world`` data-parallel ranks.
        world: data-parallel ranks (each gets every ``world``-th micro-batch of the permutation).
        grad_accum: micro-batches per optimiser step: with ``world`` and ``batch_size``, the global batch the sampler
            lays out the same way however it is split (so a run can move to another number of ranks).
        pin_memory: pin batches (useful with GPUs).
        prefetch: batches each worker keeps ready (``prefetch_factor``); workers persist across epochs.
        device_decode: integer batches where the pipeline allows them (above).
        block, buffer: the read-sized permutation (`squad.data.samplers.block_order`; block 1: sample by sample).
    """
    sampler = ResumableSampler(len(dataset), batch_size, world, rank, grad_accum, seed=seed, block=block,
                               buffer=buffer)
    integers = device_decode and integer_stage(dataset)
    dataset.integer_batches = integers
    workers = {"persistent_workers": True, "prefetch_factor": prefetch} if num_workers > 0 else {}
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_integers if integers else collate, drop_last=True, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(seed), **workers)


def set_epoch(loader: DataLoader, epoch: int, skip_batches: int = 0) -> None:
    """Sets a `build_loader` loader's epoch: its order and its dataset's augmentation draws; the first
    ``skip_batches`` batches of the epoch are left out (a resume mid-epoch continues where the run stopped)."""
    loader.sampler.set_epoch(epoch)
    loader.sampler.skip = skip_batches
    loader.dataset.set_epoch(epoch)


def eval_loader(dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """An in-order loader over this rank's shard of ``dataset``, every sample at most once.

    A sample the dataset cannot use (a corrupt or wrong-size file, `squad.data.accounting`) is left out — its
    batch is smaller — never replaced by its neighbour, so nothing is scored twice.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if isinstance(dataset, SampleDataset):
        dataset = dataset.without_substitutes()
    return DataLoader(InOrderBatches(dataset, batch_size, rank, world, collate), batch_size=None,
                      num_workers=workers)
