"""Building datasets and loaders: `build_dataset` (whichever dataset and format a folder holds), `build_loader` and
`set_epoch` (the training loader: order sharded over ranks, resumable mid-epoch; the one `squad.train` runs), and
`eval_loader` (each rank's in-order share, every sample at most once).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from squad.data.benchmark import DATASETS, check_dataset_tasks
from squad.data.nyud import NYUDDataset
from squad.data.pascal import PascalContextDataset
from squad.data.samplers import InOrderBatches, ResumableSampler
from squad.data.samples import SampleDataset, collate
from squad.data.shards import BenchmarkShardDataset, ShardDataset, detect_dataset, is_shard_root
from squad.data.taskonomy import TaskonomyDataset, make_data_hint
from squad.tasks import NYUD_TASKS, PASCAL_TASKS

# names only PASCAL-Context / NYUD provide: asking a Taskonomy tree for them is an error naming its tasks
BENCHMARK_ONLY_TASKS = frozenset(PASCAL_TASKS) | frozenset(NYUD_TASKS)


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


def build_loader(dataset: SampleDataset, batch_size: int, *, seed: int = 0, num_workers: int = 0, rank: int = 0,
                 world: int = 1, grad_accum: int = 1, pin_memory: bool = False) -> DataLoader:
    """The training loader: this rank's share of a seeded permutation per epoch, full global batches only, resumable
    mid-epoch (`squad.data.samplers.ResumableSampler`).

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
    """
    sampler = ResumableSampler(len(dataset), batch_size, world, rank, grad_accum, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, collate_fn=collate,
                      drop_last=True, pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))


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
