"""Nested projections for Mixture of Nested Experts (autograd ops used by squad.layers.mone).

Tokens arrive as 2-D token-major rows in which each expert group's rows are contiguous; group g uses the first w_g
features of a projection. `nested_linear_in` reads the first w_g input features, `nested_linear_out` writes the
first w_g output features and zero-pads the rest. Each group is one matmul that reads its feature slice in place
and writes into one preallocated output: no concatenation, padding or slicing copies, forward or backward.
"""

from __future__ import annotations

import torch


class _NestedLinearIn(torch.autograd.Function):
    """out[rows of group g] = x[rows of g, :w_g] @ W[:, :w_g]ᵀ + b: the first w_g input features, full output.

    Works on 2-D token-major blocks (each group's rows contiguous), reading the feature slice in place (a strided
    matmul operand) and writing each group's rows straight into one preallocated output.
    """

    @staticmethod
    def forward(ctx, x, w, b, blocks):  # x [T, Din], w [C, Din], b [C] | None, blocks: (row start, row end, width)
        out = x.new_empty(x.shape[0], w.shape[0])  # [T, C]
        for s, e, k in blocks:
            if b is None:
                torch.mm(x[s:e, :k], w[:, :k].t(), out=out[s:e])
            else:
                torch.addmm(b, x[s:e, :k], w[:, :k].t(), out=out[s:e])
        ctx.save_for_backward(x, w)
        ctx.blocks, ctx.has_bias = blocks, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [T, C]
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        for s, e, k in ctx.blocks:
            if dx is not None:
                torch.mm(grad[s:e], w[:, :k], out=dx[s:e, :k])
                if k < x.shape[1]:
                    dx[s:e, k:].zero_()
            if dw is not None:
                dw[:, :k].addmm_(grad[s:e].t(), x[s:e, :k])
        db = grad.sum(0) if (need_b and ctx.has_bias) else None
        return dx, dw, db, None


class _NestedLinearOut(torch.autograd.Function):
    """out[rows of group g, :w_g] = x[rows of g] @ W[:w_g]ᵀ + b[:w_g]; the features past w_g are zero (the pad)."""

    @staticmethod
    def forward(ctx, x, w, b, blocks):  # x [T, C], w [Dout, C], b [Dout] | None
        full = w.shape[0]
        out = x.new_empty(x.shape[0], full)  # [T, Dout]
        for s, e, k in blocks:
            if b is None:
                torch.mm(x[s:e], w[:k].t(), out=out[s:e, :k])
            else:
                torch.addmm(b[:k], x[s:e], w[:k].t(), out=out[s:e, :k])
            if k < full:
                out[s:e, k:].zero_()
        ctx.save_for_backward(x, w)
        ctx.blocks, ctx.has_bias = blocks, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [T, Dout]
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        db = w.new_zeros(w.shape[0]) if (need_b and ctx.has_bias) else None
        for s, e, k in ctx.blocks:
            g = grad[s:e, :k]
            if dx is not None:
                torch.mm(g, w[:k], out=dx[s:e])
            if dw is not None:
                dw[:k].addmm_(g.t(), x[s:e])
            if db is not None:
                db[:k] += g.sum(0)
        return dx, dw, db, None


def nested_linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Nested input projection: rows ``s:e`` use the first ``w`` input features (``nn.Linear`` weight layout).

    Args:
        x: [T, Din] token rows, each group's rows contiguous.
        weight: [C, Din]; bias: [C] or None.
        blocks: (row start, row end, width) per group, covering every row.

    Returns:
        [T, C].
    """
    return _NestedLinearIn.apply(x, weight, bias, blocks)


def nested_linear_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Nested output projection: rows ``s:e`` produce the first ``w`` output features, zero-padded to full width.

    Args:
        x: [T, C] token rows, each group's rows contiguous.
        weight: [Dout, C]; bias: [Dout] or None.
        blocks: (row start, row end, width) per group, covering every row.

    Returns:
        [T, Dout].
    """
    return _NestedLinearOut.apply(x, weight, bias, blocks)
