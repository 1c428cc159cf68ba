"""Nested projections for Mixture of Nested Experts (autograd ops used by squad.layers.mone).

Tokens arrive as 2-D token-major rows in which each expert group's rows are contiguous; group g uses the first w_g
features of a projection. `nested_linear_in` reads the first w_g input features, `nested_linear_out` writes the
first w_g output features, added (scaled per row) to a residual or zero-padded without one. Each group is one matmul
that reads its feature slice in place and writes into one preallocated output (or adds into the residual's first
w_g features): no concatenation or padding copies. Writes into a column slice are assignments (``t[:, :w] = ...``)
rather than ``mm(out=...)``, which compiled code cannot take for a strided output.
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
            if dx is not None:  # into a column slice: assigned, not mm(out=) (compiled code takes no strided out=)
                dx[s:e, :k] = grad[s:e] @ w[:, :k]
                if k < x.shape[1]:
                    dx[s:e, k:].zero_()
            if dw is not None:
                dw[:, :k].addmm_(grad[s:e].t(), x[s:e, :k])
        db = grad.sum(0) if (need_b and ctx.has_bias) else None
        return dx, dw, db, None


def _nested_out(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, blocks: list[tuple[int, int, int]],
                out: torch.Tensor | None, scale: torch.Tensor | None,
                keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The forward of `nested_linear_out` without autograd: into ``out`` (the residual, added to) when given, else
    into a fresh zero-padded output. ``keep`` collects each group's projection (the scale's gradient needs them)."""
    full = w.shape[0]
    if out is None:
        out = x.new_empty(x.shape[0], full)  # [T, Dout]
        for s, e, k in blocks:
            out[s:e, :k] = x[s:e] @ w[:k].t() if b is None else torch.addmm(b[:k], x[s:e], w[:k].t())
            if k < full:
                out[s:e, k:].zero_()
        return out
    for s, e, k in blocks:  # only the first k features of a group's rows change: nothing full-width for slices
        y = torch.mm(x[s:e], w[:k].t()) if b is None else torch.addmm(b[:k], x[s:e], w[:k].t())  # [n_g, k]
        if scale is None:
            out[s:e, :k].add_(y)
        else:
            out[s:e, :k].addcmul_(y, scale[s:e])
        if keep is not None:
            keep.append(y)
    return out


class _NestedLinearOut(torch.autograd.Function):
    """out[rows of group g, :w_g] = r + s · (x[rows of g] @ W[:w_g]ᵀ + b[:w_g]) and out[rows of g, w_g:] = r there:
    the residual r (zero when absent) plus the nested projection scaled per row by s (one when absent)."""

    @staticmethod
    def forward(ctx, x, w, b, residual, scale, blocks):  # x [T, C], w [Dout, C], b [Dout] | None, r [T, Dout]
        keep = [] if scale is not None and ctx.needs_input_grad[4] else None
        out = _nested_out(x, w, b, blocks, None if residual is None else residual.clone(), scale, keep)
        ctx.save_for_backward(x, w, scale)
        ctx.blocks, ctx.has_bias, ctx.kept = blocks, b is not None, keep
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [T, Dout]
        x, w, scale = ctx.saved_tensors
        need_x, need_w, need_b, need_r, need_s = ctx.needs_input_grad[:5]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        db = w.new_zeros(w.shape[0]) if (need_b and ctx.has_bias) else None
        ds = torch.empty_like(scale) if need_s else None
        for i, (s, e, k) in enumerate(ctx.blocks):
            g = grad[s:e, :k]
            if ds is not None:
                torch.linalg.vecdot(g, ctx.kept[i], out=ds[s:e, 0])
            if scale is not None:
                g = g * scale[s:e]
            if dx is not None:
                torch.mm(g, w[:k], out=dx[s:e])
            if dw is not None:
                dw[:k].addmm_(g.t(), x[s:e])
            if db is not None:
                db[:k] += g.sum(0)
        return dx, dw, db, grad if need_r else None, ds, None


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
                      blocks: list[tuple[int, int, int]], residual: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None, inplace: bool = False) -> torch.Tensor:
    """Nested output projection: rows ``s:e`` produce the first ``w`` output features; the rest are zero, or the
    residual's when one is given (``residual + scale · projection``, with no full-width copy of the projection for
    rows that use a slice).

    Args:
        x: [T, C] token rows, each group's rows contiguous.
        weight: [Dout, C]; bias: [Dout] or None.
        blocks: (row start, row end, width) per group, covering every row.
        residual: [T, Dout] added to, or None (zero-padded output).
        scale: [T, 1] per-row factor on the projection (with a residual only), or None.
        inplace: write into ``residual`` instead of a copy; honoured only while autograd is not recording.

    Returns:
        [T, Dout].
    """
    if scale is not None and residual is None:
        raise ValueError("nested_linear_out: a scale needs a residual")
    if residual is not None and not torch.is_grad_enabled():  # inference: no autograd record, maybe no copy
        return _nested_out(x, weight, bias, blocks, residual if inplace else residual.clone(), scale)
    return _NestedLinearOut.apply(x, weight, bias, residual, scale, blocks)
