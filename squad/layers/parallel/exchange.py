"""The token exchange of expert parallelism: rows to their experts' ranks and back, dropless, with autograd.

An MoE layer is plan → expert computation → combine (`squad.layers.experts`). Under expert parallelism the plan is
made on each rank for its own tokens over ALL E experts (the routers are replicated), so its expert-sorted rows are
already cut by destination: rank i of the expert-parallel group holds experts ``[i·E/P, (i+1)·E/P)``, whose rows are
one contiguous run. `ExpertExchange` then

1. exchanges the per-expert row counts ([E] ints, one ``all_to_all_single`` of equal splits) and reads them on the
   host: the split sizes of the next exchanges are host ints, so THIS IS WHERE A LAYER WAITS FOR THE DEVICE — once
   per layer and forward pass (the backward reuses the splits; MoE attention's two projections share one exchange).
   Nothing else of the exchange reads the device, and the layers' own CUDA path stays sync-free around it;
2. sends the rows with ``all_to_all_single`` and uneven splits (`all_to_all`; gloo supports only this single-tensor
   form): every real slot goes, none is dropped — slots of no-op experts and capacity-dropped slots sort after the
   last expert and are never sent;
3. groups the received rows by local expert (`local_plan`: they arrive source-major, each source's run sorted by
   expert), for the grouped matmuls of the local experts;
4. sends the expert outputs back the same way (`to_tokens`); the layer combines them with the gates as a
   single-process layer does. The backward of each exchange is the exchange with the splits swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from squad.layers.experts import Dispatch, plan_dispatch
from squad.layers.parallel.groups import ExpertGroups


class _AllToAll(torch.autograd.Function):
    """out = rows of every rank's ``x`` addressed to this rank, source-major: ``all_to_all_single`` with uneven
    splits along dim 0. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):  # x [sum(send), ...] → [sum(recv), ...]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):  # grad [sum(recv), ...] → [sum(send), ...]
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows to the ranks of ``group`` and back under autograd.

    Args:
        x: [sum(send), ...] rows, the run for rank i of the group at ``sum(send[:i])``.
        send: rows for each rank of the group (host ints).
        recv: rows from each rank (host ints; what the others' ``send`` name for this rank).
        group: the process group.

    Returns:
        [sum(recv), ...] the rows addressed to this rank, source-major.
    """
    return _AllToAll.apply(x, send, recv, group)


class ExpertExchange:
    """One layer's exchange of expert rows over an expert-parallel group (see the module docstring).

    Args:
        plan: the layer's `Dispatch` of this rank's tokens over all E experts (global indices).
        ep: the layout; E must be divisible by ``ep.size``.

    Attributes:
        sent: rows this rank sends (its slots of real experts), host int.
        received: rows it receives for its local experts, host int.
        send_splits, recv_splits: rows to / from each rank of the group (host ints).
        local_plan: `Dispatch` of the received rows by local expert (k = 1).
    """

    def __init__(self, plan: Dispatch, ep: ExpertGroups):
        e, p = plan.num_experts, ep.size
        local = e // p
        counts = plan.counts  # [E] rows per global expert, on the device
        recv = torch.empty_like(counts)  # [P·E/P] rows each source sends to each local expert, source-major
        dist.all_to_all_single(recv, counts.contiguous(), group=ep.group)
        # The one wait of the layer: split sizes of all_to_all_single are host ints.
        host = torch.cat([counts, recv]).tolist()
        sent_counts, recv_counts = host[:e], host[e:]
        self.send_splits = [sum(sent_counts[i * local : (i + 1) * local]) for i in range(p)]
        self.recv_splits = [sum(recv_counts[i * local : (i + 1) * local]) for i in range(p)]
        self.sent, self.received = sum(self.send_splits), sum(self.recv_splits)
        self.rows = plan.token.shape[0]  # M·k rows of the plan (real and no-op slots)
        self.group = ep.group
        experts = torch.arange(local, device=counts.device).repeat(p)  # [P·E/P] local expert of each count
        row_expert = torch.repeat_interleave(experts, recv, output_size=self.received)  # [A'] received rows
        self.local_plan = plan_dispatch(row_expert.unsqueeze(1), local, host_sizes=False, noop=False,
                                        sync_free=plan.sync_free)
        per_expert = [sum(recv_counts[s * local + j] for s in range(p)) for j in range(local)]
        self.local_plan.sizes = per_expert  # known on the host already: no second read

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        """[M·k, ...] expert-sorted rows of the plan → [A', ...] rows received for the local experts (source-major;
        the no-op tail is not sent)."""
        return all_to_all(rows[: self.sent], self.send_splits, self.recv_splits, self.group)

    def to_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """[A', ...] outputs of the received rows → [M·k, ...] in the plan's expert-sorted order (zero rows for the
        no-op tail)."""
        back = all_to_all(rows, self.recv_splits, self.send_splits, self.group)  # [A, ...]
        if back.shape[0] == self.rows:
            return back
        pad = [0, 0] * (back.dim() - 1) + [0, self.rows - back.shape[0]]
        return F.pad(back, pad)

    def unit_gates(self, like: torch.Tensor) -> torch.Tensor:
        """[A', 1] gates of one: the local experts' outputs go back ungated (the source applies the gates)."""
        return like.new_ones(self.received, 1)
