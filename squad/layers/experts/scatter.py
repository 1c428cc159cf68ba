"""The kernel path of token dispatch and combine (CUDA, compiled code): ScatterMoE's design on squad's ops.

Every projection is one ``squad::grouped_mm`` over the expert-sorted rows that reads its input rows where they are
(``a_rows``: the token of each row, or its slot) and writes its output rows where they go (``out_rows``: (token,
slot) order), so no gathered copy of the tokens and no permutation pass exists; bias, GELU, the gate and the gate's
gradient are applied on the tile (`squad.kernels.grouped`). What remains outside the kernels is the sum of each
token's k output rows, a sum over k contiguous rows. Nothing reads the device from the host and nothing adds
atomically, so a layer never waits for the device and compiles to one graph.

Functions (each its forward and backward, all kernel launches):

- `_DispatchMatmul`: rows[i] = x[token(i)] @ w[e(i)] (+ b[e(i)]).
- `_MatmulCombine`: out[m] = Σ_j g[m, j] · (rows[m, j] @ w[e] + b[e]).
- `_ScatterMLP`: the MoE MLP, gelu(x W1 + b1) W2 + b2 gated and summed per token, in two forward launches (the
  pre-activation kept for the backward) and four backward launches.
"""

from __future__ import annotations

import torch

from squad.kernels.grouped import grouped_mm, grouped_wgrad
from squad.layers.experts.plan import Dispatch


def _sum_slots(rows: torch.Tensor, k: int) -> torch.Tensor:
    """[M·k, N] rows in (token, slot) order → [M, N], each token's k rows summed."""
    return rows if k == 1 else rows.view(-1, k, rows.shape[1]).sum(1)


class _DispatchMatmul(torch.autograd.Function):
    """rows[i] = x[token(i)] @ w[e(i)] (+ b[e(i)]), in expert-sorted or (token, slot) order."""

    @staticmethod
    def forward(ctx, x, w, b, plan, slot_order):  # x [M, Din], w [E, Din, Dout], b [E, Dout] | None
        rows = plan.token.shape[0]
        out_rows = plan.order if slot_order else None
        y, _ = grouped_mm(x, plan.token, w, b, plan.offsets, None, out_rows, None, rows, "linear", False, False)
        ctx.save_for_backward(x, w)
        ctx.plan, ctx.slot_order, ctx.has_bias = plan, slot_order, b is not None
        return y

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, Dout] in the forward's output order
        x, w = ctx.saved_tensors
        plan = ctx.plan
        in_rows = plan.order if ctx.slot_order else None  # where sorted row i's gradient is
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            rows, _ = grouped_mm(grad, in_rows, w.transpose(1, 2), None, plan.offsets, None, plan.order, None,
                                 grad.shape[0], "linear", False, False)
            gx = _sum_slots(rows, plan.k)
        if need_w or (need_b and ctx.has_bias):
            gw, gb = grouped_wgrad(x, plan.token, grad, in_rows, None, plan.offsets, ctx.has_bias, w.dtype)
        return gx, gw, gb if ctx.has_bias else None, None, None


class _MatmulCombine(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (rows[m, j] @ w[e_mj] + b[e_mj]); the rows in expert-sorted or (token, slot) order.

    The gate is applied to each output row in the forward's epilogue; its gradient, <grad_m, rows W + b>, comes from
    the backward's input-gradient launch (Σ over the tile of (grad W^T) · rows, plus grad · b accumulated with it).
    """

    @staticmethod
    def forward(ctx, rows, w, b, gates, plan, slot_order):  # rows [M·k, Din], gates [M, k]
        g = gates.reshape(-1).index_select(0, plan.order).to(rows.dtype)  # [M·k] gate of each sorted row
        in_rows = plan.order if slot_order else None
        y, _ = grouped_mm(rows, in_rows, w, b, plan.offsets, g, plan.order, None, rows.shape[0], "linear", False,
                          False)
        ctx.save_for_backward(rows, w, b, g)
        ctx.plan, ctx.slot_order, ctx.gates_dtype = plan, slot_order, gates.dtype
        return _sum_slots(y, plan.k)

    @staticmethod
    def backward(ctx, grad):  # grad [M, Dout]
        rows, w, b, g = ctx.saved_tensors
        plan = ctx.plan
        in_rows = plan.order if ctx.slot_order else None
        need_rows, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        d_rows = grad_gates = gw = gb = None
        if need_rows or need_g:  # d_rows = g · grad W^T, written where the rows were; dg = <grad W^T, rows> + grad·b
            d_rows, partial = grouped_mm(grad, plan.token, w.transpose(1, 2), b, plan.offsets, g, in_rows, rows,
                                         rows.shape[0], "gate_grad", False, False)
            grad_gates = partial.sum(1).index_select(0, plan.inverse).view(-1, plan.k).to(ctx.gates_dtype)
        if need_w or (need_b and b is not None):
            gw, gb = grouped_wgrad(rows, in_rows, grad, plan.token, g, plan.offsets, b is not None, w.dtype)
        return d_rows, gw, gb if b is not None else None, grad_gates, None, None


class _ScatterMLP(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (gelu(x[m] W1[e_mj] + b1[e_mj]) W2[e_mj] + b2[e_mj])."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, gates, plan):  # x [M, D], w1 [E, D, H], w2 [E, H, D], gates [M, k]
        rows = plan.token.shape[0]
        train = any(ctx.needs_input_grad)
        g = gates.reshape(-1).index_select(0, plan.order).to(x.dtype)  # [M·k] gate of each sorted row
        # h = gelu(x[token] W1 + b1) [M·k, H] in expert order (a = the pre-activation, kept for the backward)
        h, a = grouped_mm(x, plan.token, w1, b1, plan.offsets, None, None, None, rows, "gelu", train, False)
        # g · (h W2 + b2), written to (token, slot) order: the token's k rows are contiguous
        y, _ = grouped_mm(h, None, w2, b2, plan.offsets, g, plan.order, None, rows, "linear", False, False)
        if train:
            ctx.save_for_backward(x, w1, w2, b2, a, h, g)
            ctx.plan, ctx.has_b1 = plan, b1 is not None
        return _sum_slots(y, plan.k)

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        x, w1, w2, b2, a, h, g = ctx.saved_tensors
        plan = ctx.plan
        rows = plan.token.shape[0]
        # da = g · (grad W2^T) · gelu'(a); the gate's gradient <grad, h W2 + b2> from the same tiles
        da, partial = grouped_mm(grad, plan.token, w2.transpose(1, 2), b2, plan.offsets, g, None, a, rows,
                                 "gate_grad", False, True)
        gw2, gb2 = grouped_wgrad(h, None, grad, plan.token, g, plan.offsets, b2 is not None, w2.dtype)
        dx_rows, _ = grouped_mm(da, None, w1.transpose(1, 2), None, plan.offsets, None, plan.order, None, rows,
                                "linear", False, False)
        gw1, gb1 = grouped_wgrad(x, plan.token, da, None, None, plan.offsets, ctx.has_b1, w1.dtype)
        grad_gates = partial.sum(1).index_select(0, plan.inverse).view(-1, plan.k)
        return (_sum_slots(dx_rows, plan.k), gw1, gb1 if ctx.has_b1 else None, gw2, gb2 if b2 is not None else None,
                grad_gates.to(g.dtype), None)


def dispatch_matmul(x: torch.Tensor, w: torch.Tensor, plan: Dispatch, bias: torch.Tensor | None = None,
                    slot_order: bool = False) -> torch.Tensor:
    """`squad.layers.experts.ops.dispatch_matmul` on the kernel path."""
    return _DispatchMatmul.apply(x, w, bias, plan, slot_order)


def matmul_combine(rows: torch.Tensor, w: torch.Tensor, gates: torch.Tensor, plan: Dispatch,
                   bias: torch.Tensor | None = None, slot_order: bool = False) -> torch.Tensor:
    """`squad.layers.experts.ops.matmul_combine` on the kernel path."""
    return _MatmulCombine.apply(rows, w, bias, gates, plan, slot_order)


def scatter_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """`squad.layers.experts.ops.expert_mlp` on the kernel path."""
    return _ScatterMLP.apply(x, w1, b1, w2, b2, gates, plan)
