"""Samplers: the training sampler that resumes mid-epoch (`ResumableSampler`: a `DistributedSampler` whose first epoch
after a resume starts ``skip`` batches in, so the data order continues exactly), and in-order evaluation batches
(`InOrderBatches`: this rank's share of a dataset, every sample at most once, unusable samples left out rather than
replaced; `squad.data.eval_loader` wraps it).
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler, IterableDataset, Sampler, get_worker_info


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose first epoch after a resume starts ``skip`` batches in."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


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
