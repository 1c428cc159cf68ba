"""Building datasets and loaders: `build_dataset` (whichever dataset and format a folder holds), `build_loader` and
`set_epoch` (training order, sharded over ranks), and `eval_loader` (each rank's in-order share, every sample at most
once).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from squad.data.benchmark import DATASETS, check_dataset_tasks
from squad.data.nyud import NYUDDataset
from squad.data.pascal import PascalContextDataset
from squad.data.samplers import InOrderBatches
from squad.data.shards import BenchmarkShardDataset, ShardDataset, detect_dataset, is_shard_root
from squad.data.taskonomy import TaskonomyBase, TaskonomyDataset, collate, make_data_hint
from squad.distributed import has_process_group
from squad.tasks import NYUD_TASKS, PASCAL_TASKS

# names only PASCAL-Context / NYUD provide: asking a Taskonomy tree for them is an error naming its tasks
BENCHMARK_ONLY_TASKS = frozenset(PASCAL_TASKS) | frozenset(NYUD_TASKS)


def build_dataset(root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                  dataset: str | None = None, **kwargs: Any) -> TaskonomyBase:
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


def build_loader(dataset: TaskonomyBase, batch_size: int, shuffle: bool = True, num_workers: int = 2,
                 seed: int = 0, drop_last: bool = True, persistent_workers: bool = False,
                 pin_memory: bool = False) -> DataLoader:
    """A DataLoader over a Taskonomy dataset; sharded over ranks with `DistributedSampler` when distributed.

    Call `set_epoch(loader, epoch)` at the start of each epoch (it reshuffles and changes the augmentation).

    Args:
        dataset: a `TaskonomyDataset` or `ShardDataset`.
        batch_size: images per rank and step.
        shuffle: shuffle the order (seeded by `seed` and the epoch).
        num_workers: worker processes (each opens its own files).
        seed: sampler seed, the same on every rank.
        drop_last: drop the last incomplete batch (and pad nothing across ranks).
        persistent_workers: keep workers between epochs; `set_epoch` then only takes effect in workers started
            after it, so leave it off when augmenting.
        pin_memory: pin batches (useful with GPUs).
    """
    if has_process_group():  # any process group, even one of a single rank
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                          collate_fn=collate, drop_last=drop_last, pin_memory=pin_memory,
                          persistent_workers=persistent_workers and num_workers > 0)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      num_workers=num_workers, collate_fn=collate, drop_last=drop_last, pin_memory=pin_memory,
                      persistent_workers=persistent_workers and num_workers > 0)


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Sets the epoch on the loader's sampler (order) and dataset (augmentation draws)."""
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)
    elif loader.generator is not None and isinstance(loader.dataset, TaskonomyBase):
        loader.generator.manual_seed(loader.dataset.seed * 1_000_003 + epoch)
    if isinstance(loader.dataset, TaskonomyBase):
        loader.dataset.set_epoch(epoch)


def eval_loader(dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """An in-order loader over this rank's shard of ``dataset``, every sample at most once.

    A sample the dataset cannot use (a corrupt or wrong-size file, `squad.data.accounting`) is left out — its
    batch is smaller — never replaced by its neighbour, so nothing is scored twice.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if isinstance(dataset, TaskonomyBase):
        dataset = dataset.without_substitutes()
    return DataLoader(InOrderBatches(dataset, batch_size, rank, world, collate), batch_size=None,
                      num_workers=workers)
