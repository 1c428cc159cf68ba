"""Samplers: the training sampler (`ResumableSampler`: the same global batches however they are split over ranks and
micro-batches, resumable mid-epoch), and in-order evaluation batches (`InOrderBatches`: this rank's share of a
dataset, every sample at most once, unusable samples left out rather than replaced; `squad.data.eval_loader` wraps
it).
"""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info


class ResumableSampler(Sampler[int]):
    """This rank's share of each shuffled epoch, laid out so that how a global batch is split does not change it.

    An epoch is a permutation of the dataset (drawn from ``seed + epoch``, as `DistributedSampler` draws it) cut into
    micro-batch slots of ``batch_size``; global batch ``s`` is slots ``s·S`` to ``s·S + S − 1`` with ``S = ranks ×
    grad_accum``, and rank ``r``'s micro-batch ``j`` is slot ``j·ranks + r``. So 2 ranks × 1 micro-batch and 1 rank ×
    2 micro-batches see the same images in the same micro-batches, and a run moved to another number of ranks with the
    same global batch goes on exactly (`squad.train.run_folder`). The epoch holds the whole global batches the dataset
    has. The first epoch after a resume starts ``skip`` micro-batches in.

    Args:
        length: samples in the dataset.
        batch_size: samples per micro-batch (per rank).
        num_replicas, rank: the ranks and this one.
        grad_accum: micro-batches per optimiser step.
        seed: the permutation's seed (with the epoch); ``shuffle=False`` keeps the dataset order.
        block: 1 draws the permutation sample by sample (``torch.randperm``). Above 1, the permutation is read-sized
            for a cluster file system (`block_order`): blocks of ``block`` neighbouring samples in a shuffled order
            (across shards), then shuffled within windows of ``buffer`` blocks — so a micro-batch reads about
            ``buffer`` contiguous runs per domain instead of ``batch_size`` single samples.
        buffer: blocks per shuffle window (with ``block`` > 1).
    """

    def __init__(self, length: int, batch_size: int, num_replicas: int = 1, rank: int = 0, grad_accum: int = 1,
                 seed: int = 0, shuffle: bool = True, block: int = 1, buffer: int = 1):
        self.block, self.buffer = max(1, int(block)), max(1, int(buffer))
        self.length, self.batch_size = int(length), int(batch_size)
        self.num_replicas, self.rank, self.grad_accum = int(num_replicas), int(rank), int(grad_accum)
        self.seed, self.shuffle = int(seed), shuffle
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches_per_epoch(self) -> int:
        """This rank's micro-batches in an epoch."""
        return self.length // (self.batch_size * self.num_replicas * self.grad_accum) * self.grad_accum

    def __iter__(self):
        if self.shuffle and self.block > 1:
            order = block_order(self.length, self.block, self.buffer, self.seed + self.epoch).tolist()
        elif self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        skip, self.skip = self.skip, 0
        b, w = self.batch_size, self.num_replicas
        for j in range(skip, self.batches_per_epoch()):
            slot = j * w + self.rank
            for i in order[slot * b:(slot + 1) * b]:
                yield EpochIndex(i, self.epoch)

    def __len__(self) -> int:
        return self.batches_per_epoch() * self.batch_size


class EpochIndex(int):
    """A sample index carrying the epoch it is drawn for: DataLoader workers that persist across epochs keep the
    dataset as it was when they started, so the augmentation draws read the epoch from the index
    (`squad.data.samples.SampleDataset`), never from the workers' stale copy."""

    epoch: int

    def __new__(cls, index: int, epoch: int) -> EpochIndex:
        out = super().__new__(cls, index)
        out.epoch = int(epoch)
        return out

    def __reduce__(self):
        return EpochIndex, (int(self), self.epoch)


def block_order(length: int, block: int, buffer: int, seed: int) -> torch.Tensor:
    """A permutation of ``range(length)`` for block reads: the blocks ``[k·block, (k+1)·block)`` in a seeded random
    order, then the samples shuffled within each window of ``buffer`` consecutive blocks of that order."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(-(-length // block), generator=g)
    order = (blocks[:, None] * block + torch.arange(block)).flatten()
    window = (torch.arange(len(blocks), dtype=torch.float64) // buffer).repeat_interleave(block)
    keep = order < length  # the last block may be short
    order, window = order[keep], window[keep]
    return order[torch.argsort(window + torch.rand(len(order), generator=g, dtype=torch.float64))]


class ShardSampler(Sampler[int]):
    """This rank's share of a dataset in order (rank, rank + world, ...): no padding, no duplicates."""

    def __init__(self, length: int, rank: int = 0, world: int = 1):
        self.indices = list(range(rank, length, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class InOrderBatches(IterableDataset):
    """This rank's share of a dataset (rank, rank + world, ...) as collated batches in order, leaving out the samples
    the dataset cannot produce (it returns None for them) rather than serving a substitute.

    Batch ``j`` holds positions ``j·B ... j·B + B - 1`` of the rank's share; DataLoader workers take every
    ``num_workers``-th batch, so the loader yields them in the same order whatever the number of workers. A batch
    with a left-out sample is smaller; one with nothing usable is not yielded. Use with ``batch_size=None``.
    """

    def __init__(self, dataset, batch_size: int, rank: int = 0, world: int = 1, collate_fn=None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.indices = list(range(rank, len(dataset), world))
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for j in range(first, len(self), step):
            chunk = self.indices[j * self.batch_size: (j + 1) * self.batch_size]
            samples = [s for s in (self.dataset[i] for i in chunk) if s is not None]
            if samples:
                yield self.collate_fn(samples) if self.collate_fn is not None else samples
