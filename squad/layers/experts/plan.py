"""The dispatch plan: how a layer's (token, slot) pairs are grouped by expert, once per layer, before any matmul.

`plan_dispatch` sorts the M·k (token, slot) pairs of a routing decision by expert: every expert's rows are then
contiguous, each projection is one grouped matmul over those rows, and the plan's permutations (``order``,
``inverse``) and group ends carry the rows back to their tokens. It is the first of the three separable steps of an
MoE layer — plan, expert computation, combine — and what expert parallelism exchanges rows by (the group sizes say
how many rows go to each expert's rank).

`segment_groups` is the plan of the per-task routers (`squad.layers.routing.TaskLinear`): task-major runs of rows,
one group per run, known on the host and cached per layout.

Nothing here reads the device from the host unless asked (`Groups.host_sizes`): group ends are found by a binary
search in the sorted experts (no histogram, whose size a GPU would have to report) and host ints reach the device
through pinned memory.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from squad.kernels.device import cuda_path, pinned


def takes_kernel_path(device: torch.device) -> bool:
    """Whether routed layers on ``device`` use the grouped-GEMM kernel ops (`squad.kernels.grouped`): on the CUDA
    path (`squad.kernels.device.cuda_path`) and inside `torch.compile` on any device (the ops are single graph nodes,
    the CPU algorithm reads group sizes on the host); never under `torch.export`, whose programs must run without
    squad's ops."""
    if torch.compiler.is_exporting():
        return False
    return cuda_path(device) or torch.compiler.is_compiling()


@dataclasses.dataclass(kw_only=True)
class Groups:
    """Rows laid out in consecutive groups, group g multiplied by weight g: what a grouped matmul needs.

    Attributes:
        counts: [G] rows per group (long, on the rows' device).
        offsets: [G] int32 cumulative end of each group (`torch.nn.functional.grouped_mm` and the kernel ops).
        sizes: the same as host ints, or None until a looped fallback reads them (`host_sizes`).
        tail: rows past the last group may exist and must come out zero (no-op slots); False when the groups
            cover every row.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    sizes: list[int] | None = None
    tail: bool = True

    @property
    def num_groups(self) -> int:
        return self.counts.shape[0]

    def host_sizes(self) -> list[int]:
        """Group sizes on the host (one device read, cached)."""
        if self.sizes is None:
            self.sizes = self.counts.tolist()
        return self.sizes


@dataclasses.dataclass(kw_only=True)
class Dispatch(Groups):
    """How M tokens with k expert slots each are laid out grouped by expert (one group per real expert; slots of
    no-op experts sort after the last group).

    Attributes:
        order: [M·k] flat slot index (token·k + slot) of each row in expert-sorted order.
        inverse: [M·k] position in sorted order of each flat slot (inverse permutation of ``order``).
        k: slots per token.
        token: [M·k] token index of each row in expert-sorted order (``order // k``).
        row_expert: [M·k] expert of each sorted row; no-op rows get E.
        starts: [E + 1] int64 first row of each group and of the no-op tail.
        sync_free: the rows go through the grouped-GEMM kernel ops (`takes_kernel_path`: CUDA, compiled code);
            otherwise through the CPU algorithm (`squad.layers.experts.cpu`).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    k: int
    token: torch.Tensor
    row_expert: torch.Tensor
    starts: torch.Tensor
    sync_free: bool = False

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def active_rows(self) -> int:
        """Rows that belong to real experts (host int: reads the group sizes)."""
        return sum(self.host_sizes())

    def slot_experts(self) -> torch.Tensor:
        """[M, k] expert of every (token, slot), no-op slots as E (the sorted rows' experts put back in slot
        order)."""
        return self.row_expert.index_select(0, self.inverse).view(-1, self.k)


def host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a long tensor on ``device``. On the CUDA path copied from pinned memory asynchronously, so
    building it never waits for the device; inside a compiled region a constant of the graph (nothing pinned there:
    `torch.compile` cannot trace ``pin_memory``)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.compiler.is_compiling() or not cuda_path(device):
        return t.to(device)
    return pinned(t).to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def segment_groups(segments: tuple[tuple[int, int, int], ...], tokens_per_row: int,
                   device: torch.device) -> tuple[Groups, torch.Tensor]:
    """`Groups` of the tokens of task-major row runs, one group per run, and the runs' tasks on ``device``.

    Args:
        segments: ``(task, first_row, end_row)`` runs covering rows 0..R in order (`ForwardContext.segments`).
        tokens_per_row: N.
        device: where the rows live.

    Returns:
        (groups over the R·N token rows, [S] long task of each run). Cached: a step's layout recurs every step, so
        its few device ints are copied once (never as inference tensors, so evaluation and training share them).
        Compiled code calls the uncached function (``segment_groups.__wrapped__``).

    Raises:
        ValueError: the runs do not tile the rows in order.
    """
    end = 0
    for _, first, last in segments:
        if first != end or last < first:
            raise ValueError(f"segments must be consecutive (task, first_row, end_row) runs from row 0, got "
                             f"{list(segments)}")
        end = last
    sizes = [(last - first) * tokens_per_row for _, first, last in segments]
    ends = list(itertools.accumulate(sizes))
    s = len(segments)
    # Outside inference mode even when called inside it: the cached tensors outlive the call, and a tensor made in
    # inference mode could not be saved for backward by a later training step with the same layout.
    with torch.inference_mode(False):
        host = host_ints(sizes + ends + [task for task, _, _ in segments], device)
        offsets = host[s : 2 * s].to(torch.int32)
    return Groups(counts=host[:s], offsets=offsets, sizes=sizes, tail=False), host[2 * s :]


def plan_dispatch(experts: torch.Tensor, num_experts: int, host_sizes: bool = True, noop: bool = True,
                  sync_free: bool | None = None) -> Dispatch:
    """Groups (token, slot) pairs by expert.

    Args:
        experts: [M, k] expert index per token and slot; indices >= num_experts are no-op/dropped slots and are
            sorted after every real expert's rows.
        num_experts: number of real experts E.
        host_sizes: read the group sizes to the host now (otherwise only if a looped fallback needs them).
        noop: slots may name no-op experts (indices >= E); False promises they never do.
        sync_free: take the kernel ops (default `takes_kernel_path` of the experts' device).

    Returns:
        The `Dispatch` plan.
    """
    if sync_free is None:
        sync_free = takes_kernel_path(experts.device)
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [M·k]
    sorted_e, order = torch.sort(flat, stable=True)  # rows grouped by expert, token order inside a group
    arange = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, arange)
    row_expert = sorted_e.clamp(max=num_experts)
    # first row of each expert's group and of the no-op tail: a binary search in the sorted experts, no histogram
    # (bincount reads its size back to the host on CUDA) and no atomics
    starts = torch.searchsorted(row_expert, torch.arange(num_experts + 1, device=flat.device))  # [E + 1]
    ends = starts[1:]
    plan = Dispatch(counts=ends - starts[:-1], offsets=ends.to(torch.int32), tail=noop or not sync_free,
                    sync_free=sync_free, order=order, inverse=inverse, k=k,
                    token=torch.div(order, k, rounding_mode="floor"), row_expert=row_expert, starts=starts)
    if host_sizes and not sync_free:
        plan.host_sizes()
    return plan
