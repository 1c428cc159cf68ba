"""The DeepSpeed training loop: one fused multi-task pass per step, uncertainty-weighted task losses, the MI loss
across ranks, periodic validation, TensorBoard logs, checkpoints that resume exactly, and the exported model.

Exact resumption: the data order is the sampler's (seed, epoch) permutation with the consumed batches skipped,
augmentation draws come from (seed, epoch, index), and the torch RNG (router noise, task sampling) is reseeded from
(seed, step, rank) every step — so nothing but the step counters needs saving beside DeepSpeed's own state.
"""

from __future__ import annotations

from torch.utils.data import DistributedSampler, Sampler


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
