"""Grouped expert matmuls and token dispatch: the hot path of every MoE layer.

Tokens are grouped by expert ONCE per layer (`Dispatch`): the (token, slot) pairs are sorted by expert, every
expert's rows are then contiguous, and each projection is one grouped matmul over those rows
(`grouped_matmul`). On CUDA with bf16, PyTorch's `grouped_mm` runs the groups in one kernel from a device-side
offsets tensor (no host sync). Elsewhere a fused autograd op loops over the groups with `addmm(out=...)` into one
preallocated output and computes weight gradients in place: no concatenation copies, one host read of the group
sizes per layer (free on the CPU).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class Dispatch:
    """How M tokens with k expert slots each are laid out grouped by expert.

    Attributes:
        order: [M·k] flat slot index (token·k + slot) of each row in expert-sorted order.
        inverse: [M·k] position in sorted order of each flat slot (inverse permutation of ``order``).
        counts: [E] rows per expert (long, on the tokens' device).
        sizes: the same as host ints (for the looped path); None when the device path needs no host copy.
        offsets: [E] int32 cumulative end of each group (for `torch.nn.functional.grouped_mm`).
        k: slots per token.
        active_rows: rows that belong to real experts (slots routed to no-op experts sort to the end).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    sizes: list[int] | None
    offsets: torch.Tensor
    k: int
    active_rows: int | None


def _use_device_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def plan_dispatch(experts: torch.Tensor, num_experts: int, host_sizes: bool = True) -> Dispatch:
    """Groups (token, slot) pairs by expert.

    Args:
        experts: [M, k] expert index per token and slot; indices >= num_experts are no-op/dropped slots and are
            sorted after every real expert's rows.
        num_experts: number of real experts E.
        host_sizes: also read the group sizes to the host (needed by the looped grouped matmul).

    Returns:
        The `Dispatch` plan.
    """
    m, k = experts.shape
    flat = experts.reshape(-1)  # [M·k]
    order = torch.sort(flat, stable=True).indices  # [M·k], rows grouped by expert, token order inside a group
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat.clamp(max=num_experts), minlength=num_experts + 1)[:num_experts]
    offsets = counts.cumsum(0).to(torch.int32)
    sizes = None
    active = None
    if host_sizes:
        sizes = counts.tolist()
        active = sum(sizes)
    return Dispatch(order, inverse, counts, sizes, offsets, k, active)


class _GroupedMatmul(torch.autograd.Function):
    """y[rows of group e] = x[rows of group e] @ w[e] (+ b[e]); rows past the last group are zero."""

    @staticmethod
    def forward(ctx, x, w, b, sizes):  # x [R, Din], w [E, Din, Dout], b [E, Dout] | None
        out = x.new_empty(x.shape[0], w.shape[2])
        start = 0
        for e, n in enumerate(sizes):
            if n:
                seg = out[start : start + n]
                if b is None:
                    torch.mm(x[start : start + n], w[e], out=seg)
                else:
                    torch.addmm(b[e], x[start : start + n], w[e], out=seg)
            start += n
        if start < x.shape[0]:
            out[start:].zero_()
        ctx.sizes = sizes
        ctx.has_bias = b is not None
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = gb = None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if need_x:
            gx = torch.zeros_like(x) if sum(ctx.sizes) < x.shape[0] else torch.empty_like(x)
        if need_w:
            gw = torch.empty_like(w)
        if need_b and ctx.has_bias:
            gb = w.new_empty(w.shape[0], w.shape[2])
        start = 0
        for e, n in enumerate(ctx.sizes):
            g = grad[start : start + n]
            if need_x and n:
                torch.mm(g, w[e].t(), out=gx[start : start + n])
            if need_w:
                if n:
                    torch.mm(x[start : start + n].t(), g, out=gw[e])
                else:
                    gw[e].zero_()
            if gb is not None:
                torch.sum(g, 0, out=gb[e]) if n else gb[e].zero_()
            start += n
        return gx, gw, gb, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, plan: Dispatch, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One matmul per expert group over expert-sorted rows.

    Args:
        x: [R, Din] rows sorted by expert (R = M·k; rows past the real experts' groups give zeros).
        w: [E, Din, Dout] expert weights.
        plan: the layer's `Dispatch`.
        bias: [E, Dout] or None.

    Returns:
        [R, Dout].
    """
    if _use_device_grouped_mm(x) and plan.active_rows is None:
        y = F.grouped_mm(x, w, offs=plan.offsets)
        if bias is not None:
            group = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), plan.counts,
                                            output_size=x.shape[0])
            y = y + bias[group]
        return y
    if plan.sizes is None:
        raise ValueError("this Dispatch was planned without host sizes; plan_dispatch(..., host_sizes=True)")
    return _GroupedMatmul.apply(x, w, bias, plan.sizes)


class _GatherSlots(torch.autograd.Function):
    """rows[i] = x[order[i] // k]: every token copied once per slot, in expert order. Backward sums the k copies
    through the inverse permutation (a gather + a sum, no scatter-add)."""

    @staticmethod
    def forward(ctx, x, order, inverse, k):  # x [M, D]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, D]
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)  # [M·k, D] in (token, slot) order
        return g.view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """y = x[index] for a permutation ``index`` (with its ``inverse``): backward is the inverse gather."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def dispatch_tokens(x: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M, D] tokens → [M·k, D] rows grouped by expert (each token once per slot)."""
    return _GatherSlots.apply(x, plan.order, plan.inverse, plan.k)


def to_slots(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, ...] expert-sorted rows → [M, k, ...] in (token, slot) order."""
    y = _Permute.apply(rows, plan.inverse, plan.order)
    return y.view(-1, plan.k, *rows.shape[1:])


def from_slots(slots: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M, k, ...] per (token, slot) → [M·k, ...] expert-sorted rows."""
    flat = slots.reshape(-1, *slots.shape[2:])
    return _Permute.apply(flat, plan.order, plan.inverse)


class _Combine(torch.autograd.Function):
    """out[m] = Σ_j gates[m, j] · rows[inverse[m·k + j]] — expert outputs gathered back to their tokens and mixed
    by the gates in one pass (the gathered copy is recomputed in backward rather than kept)."""

    @staticmethod
    def forward(ctx, rows, gates, order, inverse):  # rows [M·k, D], gates [M, k]
        m, k = gates.shape
        slots = rows.index_select(0, inverse).view(m, k, -1)  # [M, k, D]
        g = gates.to(rows.dtype)
        out = slots[:, 0] * g[:, :1]
        for j in range(1, k):
            out.addcmul_(slots[:, j], g[:, j : j + 1])
        ctx.save_for_backward(rows, g, order, inverse)
        ctx.gates_dtype = gates.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        rows, g, order, inverse = ctx.saved_tensors
        m, k = g.shape
        grad_rows = grad_gates = None
        if ctx.needs_input_grad[1]:
            slots = rows.index_select(0, inverse).view(m, k, -1)
            grad_gates = (slots * grad.unsqueeze(1)).sum(-1).to(ctx.gates_dtype)  # [M, k]
        if ctx.needs_input_grad[0]:
            grad_slots = g.unsqueeze(-1) * grad.unsqueeze(1)  # [M, k, D]
            grad_rows = grad_slots.view(m * k, -1).index_select(0, order)
        return grad_rows, grad_gates, None, None


def combine(rows: torch.Tensor, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Expert outputs back to tokens: Σ_slots gate · output.

    Args:
        rows: [M·k, D] expert outputs in expert-sorted order.
        gates: [M, k] gate weight of each slot.
        plan: the layer's `Dispatch`.

    Returns:
        [M, D].
    """
    return _Combine.apply(rows, gates, plan.order, plan.inverse)
