"""The process groups of expert parallelism: `ExpertGroups`, and `expert_groups(size)` that makes them.

With expert-parallel size P on W ranks, rank r belongs to

- its **expert-parallel group** (EP), the P consecutive ranks ``[r - r % P, ..., r - r % P + P - 1]``: together they
  hold one copy of every expert (rank i of the group holds experts ``[i·E/P, (i+1)·E/P)``) and exchange tokens with
  ``all_to_all_single``;
- its **expert-data-parallel group** (EDP), the W/P ranks ``r % P, r % P + P, ...`` that hold the same experts: an
  expert's gradient is summed over this group (and over nothing else).

The groups are DeepSpeed's own (`deepspeed.utils.groups`, the ones ``deepspeed.moe.layer.MoE(ep_size=P)`` makes,
named ``ep_size_P``): the engine broadcasts parameters tagged with that group name over its EDP group, and a run
that also holds DeepSpeed MoE layers shares them. DeepSpeed has no public API for them — only the private
``_create_expert_and_data_parallel`` / ``_get_expert_parallel_group`` / ``_get_expert_data_parallel_group`` — so
this module is the one place that names them (pinned by tests/test_expert_parallel.py against the installed
DeepSpeed); without a DeepSpeed process group (a torchrun job that never initialised deepspeed.comm) the same
layout is made with ``torch.distributed.new_group``.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """One expert-parallel layout of the running process group.

    Attributes:
        size: P, ranks per expert-parallel group (1: every rank holds every expert, nothing is exchanged).
        rank: this rank's index in its expert-parallel group (which slice of the experts it holds).
        group: the expert-parallel process group (None when P = 1).
        data_group: the expert-data-parallel process group (None when it would hold one rank).
        data_size: ranks in the expert-data-parallel group (W / P).
        name: DeepSpeed's name of the layout (``ep_size_P``): the ``group_name`` of the experts' parameters.
    """

    size: int
    rank: int
    group: object | None
    data_group: object | None
    data_size: int
    name: str

    def local_range(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds (``num_experts`` divisible by `size`)."""
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


SINGLE = ExpertGroups(size=1, rank=0, group=None, data_group=None, data_size=1, name="ep_size_1")
"""The layout of a single process (or of expert_parallel = 1): no exchange."""


def check_size(size: int, num_experts: int, world: int, key: str) -> None:
    """Checks an expert-parallel size against a layer's experts and the number of ranks.

    Raises:
        ValueError: ``size`` is below 1, does not divide ``num_experts``, or does not divide ``world`` (the message
            names ``key``, e.g. ``model.moe.expert_parallel``).
    """
    if size < 1:
        raise ValueError(f"{key}={size} must be >= 1")
    if num_experts % size:
        raise ValueError(f"{key}={size} does not divide the layer's {num_experts} experts (each rank of an "
                         f"expert-parallel group holds num_experts / {key} of them)")
    if world % size:
        raise ValueError(f"{key}={size} does not divide the {world} ranks of this run (the ranks are split into "
                         f"expert-parallel groups of {size})")


def _deepspeed_groups(size: int) -> tuple[object, object, str] | None:
    """DeepSpeed's EP and EDP groups of size ``size`` (made once per process group), or None when deepspeed.comm
    was never initialised. Every private name of `deepspeed.utils.groups` squad uses is here."""
    try:
        import deepspeed.comm as ds_dist
        from deepspeed.utils import groups
    except ImportError:
        return None
    if not ds_dist.is_initialized():
        return None
    name = f"ep_size_{size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name), name


def _torch_groups(size: int) -> tuple[object, object, str]:
    """The same layout with ``torch.distributed.new_group`` (every rank creates every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ep = edp = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            ep = g
    for first in range(size):
        g = dist.new_group(list(range(first, world, size)))
        if rank % size == first:
            edp = g
    return ep, edp, f"ep_size_{size}"


_CACHE: dict[int, tuple[object, ExpertGroups]] = {}  # size -> (the world group they were made in, the layout)


def expert_groups(size: int) -> ExpertGroups:
    """The expert-parallel layout of size ``size`` over the running process group (a collective on first use:
    every rank must call it with the same sizes in the same order).

    Args:
        size: P; 1 (or a process without a group) gives `SINGLE`.

    Raises:
        ValueError: ``size`` does not divide the number of ranks.
    """
    if size == 1 or not (dist.is_available() and dist.is_initialized()):
        if size != 1:
            raise ValueError(f"expert_parallel={size} needs a process group of a multiple of {size} ranks (this "
                             f"process runs alone): launch with deepspeed or torchrun")
        return SINGLE
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"expert_parallel={size} does not divide the {world} ranks of this run")
    world_group = dist.group.WORLD
    cached = _CACHE.get(size)
    if cached is None or cached[0] is not world_group:  # made in a process group since destroyed: made again
        ep, edp, name = _deepspeed_groups(size) or _torch_groups(size)
        data_size = world // size
        layout = ExpertGroups(size=size, rank=dist.get_rank() % size, group=ep,
                              data_group=edp if data_size > 1 else None, data_size=data_size, name=name)
        _CACHE[size] = (world_group, layout)
    return _CACHE[size][1]
