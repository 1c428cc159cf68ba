"""The CPU algorithm of token dispatch and combine: the fastest form on a CPU, and the readable reference.

The group sizes cost nothing to read on a CPU, so per-expert work is sliced on the host: `embedding_bag` sums each
token's k rows and each expert's rows, bias rows are added by a slice per group. Two fused ops serve the layers,
each a handful of whole-tensor calls rather than a Python loop over the experts:

- `dispatch_matmul` = ``grouped_matmul(dispatch_tokens(x))``: one gather of the k copies of every token, one
  grouped matmul; backward sums each token's k slot gradients.
- `matmul_combine` = ``combine(grouped_matmul(rows))``: the gate is folded into the input rows, so the outputs
  are summed per token unweighted and the gate's gradient is a dot product on the input side (64 wide for MoA
  heads).

`dispatch_tokens`, `to_slots`, `from_slots` and `combine` are the readable pieces; the tests check the fused ops
against their composition. Under `torch.export` these ops are what the exported program holds (plain aten ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.layers.experts.grouped import gmm, project, segment_sum
from squad.layers.experts.plan import Dispatch


def sum_slots(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, N] expert-sorted rows → [M, N], each token's k rows summed (one `embedding_bag`)."""
    return F.embedding_bag(plan.inverse.view(-1, plan.k), rows, mode="sum")


class _GatherSlots(torch.autograd.Function):
    """rows[i] = x[token[i]]: every token copied once per slot, in expert order. Backward sums each token's k
    copies with one `embedding_bag` pass over the inverse permutation."""

    @staticmethod
    def forward(ctx, x, token, inverse, k):  # x [M, D]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, D]
        (inverse,) = ctx.saved_tensors
        return F.embedding_bag(inverse.view(-1, ctx.k), grad.contiguous(), mode="sum"), None, None, None


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
    return _GatherSlots.apply(x, plan.token, plan.inverse, plan.k)


def to_slots(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, ...] expert-sorted rows → [M, k, ...] in (token, slot) order."""
    y = _Permute.apply(rows, plan.inverse, plan.order)
    return y.view(-1, plan.k, *rows.shape[1:])


def from_slots(slots: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M, k, ...] per (token, slot) → [M·k, ...] expert-sorted rows."""
    flat = slots.reshape(-1, *slots.shape[2:])
    return _Permute.apply(flat, plan.order, plan.inverse)


class _Combine(torch.autograd.Function):
    """out[m] = Σ_j gates[m, j] · rows[inverse[m·k + j]]: a weighted `embedding_bag` over the token's k rows."""

    @staticmethod
    def forward(ctx, rows, gates, order, inverse, token):  # rows [M·k, D], gates [M, k]
        g = gates.to(rows.dtype)
        out = F.embedding_bag(inverse.view(gates.shape), rows, per_sample_weights=g, mode="sum")  # [M, D]
        ctx.save_for_backward(rows, g, order, inverse, token)
        ctx.gates_dtype = gates.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        rows, g, order, inverse, token = ctx.saved_tensors
        grad_rows = grad_gates = None
        dy = grad.contiguous().index_select(0, token)  # [M·k, D]: each sorted row's token gradient
        if ctx.needs_input_grad[1]:
            grad_gates = torch.linalg.vecdot(dy, rows).index_select(0, inverse).view(g.shape).to(ctx.gates_dtype)
        if ctx.needs_input_grad[0]:
            grad_rows = dy.mul_(g.reshape(-1).index_select(0, order).unsqueeze(1))
        return grad_rows, grad_gates, None, None, None


def combine(rows: torch.Tensor, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Expert outputs back to tokens: Σ_slots gate · output.

    Args:
        rows: [M·k, D] expert outputs in expert-sorted order.
        gates: [M, k] gate weight of each slot.
        plan: the layer's `Dispatch`.

    Returns:
        [M, D].
    """
    return _Combine.apply(rows, gates, plan.order, plan.inverse, plan.token)


class _DispatchMatmul(torch.autograd.Function):
    """rows[i] = x[token[i]] @ w[e(i)] (+ b[e(i)]) for expert-sorted rows i; no-op rows are zero."""

    @staticmethod
    def forward(ctx, x, w, b, plan):  # x [M, Din], w [E, Din, Dout], b [E, Dout] | None
        gathered = x.index_select(0, plan.token)  # [M·k, Din]: every token once per slot, grouped by expert
        out = project(gathered, w, b, plan)  # [M·k, Dout]
        ctx.save_for_backward(gathered, w)
        ctx.plan, ctx.has_bias = plan, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, Dout]
        gathered, w = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            gx = sum_slots(gmm(grad, w.transpose(1, 2), plan), plan)  # [M, Din]: Σ over each token's slots
        if need_w:
            gw = gmm(gathered.t(), grad, plan)
        if need_b and ctx.has_bias:
            gb = segment_sum(grad, plan)
        return gx, gw, gb, None


def dispatch_matmul(x: torch.Tensor, w: torch.Tensor, plan: Dispatch, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens to their experts and through one projection (CPU algorithm; see `squad.layers.experts.ops`)."""
    return _DispatchMatmul.apply(x, w, bias, plan)


class _MatmulCombine(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (rows[p] @ w[e] + b[e]) with p = inverse[m·k + j] and e the expert of row p.

    The gate is folded into the input rows, ``g·(a W + b) = (g·a) W + g·b``: the gated rows go through one grouped
    matmul and are summed per token (`sum_slots`); the bias term is Σ_j g_j · b[e_j], one weighted `embedding_bag`
    over the [E, Dout] bias table. The gate's gradient then comes from the input side, ``dg = <d(g·a), a> + <dy, b>``
    (narrow for MoA, where the input is one head), and nothing of width Dout is kept for backward.
    """

    @staticmethod
    def forward(ctx, rows, w, b, gates, experts, plan):  # rows [M·k, Din], gates/experts [M, k]
        g = gates.to(rows.dtype)
        g_rows = g.reshape(-1).index_select(0, plan.order)  # [M·k] gate of each sorted row
        scaled = rows * g_rows.unsqueeze(1)  # [M·k, Din]
        out = sum_slots(gmm(scaled, w, plan), plan)  # [M, Dout]
        if b is not None:  # no-op slots index the zero row E
            table = torch.cat([b, b.new_zeros(1, b.shape[1])])  # [E + 1, Dout]
            out += F.embedding_bag(experts.clamp(max=b.shape[0]), table, per_sample_weights=g, mode="sum")
        ctx.save_for_backward(rows, scaled, w, b, g_rows, experts)
        ctx.plan, ctx.gates_dtype = plan, gates.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, Dout]
        rows, scaled, w, b, g_rows, experts = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_rows, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        m, k = experts.shape
        dy = grad.index_select(0, plan.token)  # [M·k, Dout]: each sorted row's token gradient
        gw = gmm(scaled.t(), dy, plan) if need_w else None
        d_rows = grad_gates = gb = None
        if need_rows or need_g:
            d_scaled = gmm(dy, w.transpose(1, 2), plan)  # [M·k, Din] = d(g·a)
            if need_g:
                dg = torch.linalg.vecdot(d_scaled, rows).index_select(0, plan.inverse).view(m, k)
                if b is not None:  # + <grad_m, b[e_mj]>
                    gb_dot = F.pad(grad @ b.t(), (0, 1))  # [M, E + 1], zero column for no-op slots
                    dg = dg + gb_dot.gather(1, experts.clamp(max=b.shape[0]))
                grad_gates = dg.to(ctx.gates_dtype)
            if need_rows:
                d_rows = d_scaled.mul_(g_rows.unsqueeze(1))
        if need_b and b is not None:  # Σ over slots routed to e of g · grad_m: [E, M] @ [M, Dout]
            g = g_rows.index_select(0, plan.inverse).view(m, k)
            weights = grad.new_zeros(m, b.shape[0] + 1).scatter_add_(1, experts.clamp(max=b.shape[0]), g)
            gb = weights[:, : b.shape[0]].t() @ grad
        return d_rows, gw, gb, grad_gates, None, None


def matmul_combine(rows: torch.Tensor, w: torch.Tensor, gates: torch.Tensor, plan: Dispatch,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped projection of expert-sorted rows, then back to the tokens mixed by the gates (CPU algorithm; see
    `squad.layers.experts.ops`)."""
    return _MatmulCombine.apply(rows, w, bias, gates, plan.slot_experts(), plan)
