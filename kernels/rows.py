"""Row ops of the inference path as PyTorch custom operators: ``squad::row_norm``, ``squad::row_add`` and
``squad::row_scatter_lerp_`` — the layer norm, residual add and token write-back of a block, each with a per-row
embedding folded in where a separate pass would add it.

A model with task embeddings adds its [R, D] row embedding before every block (``x + e``: a full pass over the
residual stream the dense twin does not make). On the CUDA path in inference the blocks take it in their own passes
instead (`squad.models.vit`): a dense block normalises ``x + e`` and adds ``x + e + attention`` in the passes it
makes anyway, and a Mixture-of-Depths block reads its selected tokens with ``e`` added and writes its results back
into the residual stream it owns (``- e``: the embedding stays pending for the blocks after it). On rows x [R, N, D]
(features contiguous), per-row embedding ``emb`` [R, D]:

- ``row_norm(x, index?, emb?, weight, bias, eps) -> (h, rows)``: ``v = x[r, index[r, j]] + emb[r]`` (all N rows
  without an index), ``h = LayerNorm(v)``; ``rows`` = v when indexed (the selected tokens, embedded), else empty.
- ``row_add(a, b, emb?) -> a + b + emb[r]``.
- ``row_scatter_lerp_(x, index, a, b, s?, shift?, emb?)``: in place, ``x[r, index[r, j]] = a + (s + shift[r]) ·
  (b - a) - emb[r]`` (``b - emb[r]`` without s): a MoD block's write-back, ``lerp(x_sel, y_sel, router weight)``.

Triton on CUDA (and CPU tensors under ``TRITON_INTERPRET=1``, `triton_rows`); a PyTorch reference elsewhere (float32
math for 16-bit inputs, float64 kept); fakes for meta tensors and `torch.compile`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .device import triton_runs_on
from .tiles import KERNEL_DTYPES


def _use_triton(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0].device) and all(t.dtype in KERNEL_DTYPES for t in tensors)


def _ct(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(op: str, x: torch.Tensor, index: torch.Tensor | None, emb: torch.Tensor | None) -> None:
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"squad::{op}: x must be [R, N, D] with contiguous features, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if index is not None and (index.dtype != torch.int64 or index.dim() != 2 or index.shape[0] != x.shape[0]):
        raise ValueError(f"squad::{op}: index must be int64 [R={x.shape[0]}, K], got {index.dtype} "
                         f"{tuple(index.shape)}")
    if emb is not None and emb.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"squad::{op}: emb must be [R, D] = {(x.shape[0], x.shape[2])}, got {tuple(emb.shape)}")


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[2]))


# ------------------------------------------------------------------------------------------ PyTorch reference
def row_norm_reference(x, index, emb, weight, bias, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """``squad::row_norm`` in PyTorch."""
    ct = _ct(x.dtype)
    v = _rows(x, index).to(ct)
    if emb is not None:
        v = v + emb.to(ct).unsqueeze(1)
    h = F.layer_norm(v, (x.shape[2],), weight.to(ct), bias.to(ct), eps).to(x.dtype)
    return h, (v.to(x.dtype) if index is not None else x.new_empty(0, 0, 0))


def row_add_reference(a, b, emb) -> torch.Tensor:
    """``squad::row_add`` in PyTorch."""
    ct = _ct(a.dtype)
    out = a.to(ct) + b.to(ct)
    if emb is not None:
        out = out + emb.to(ct).unsqueeze(1)
    return out.to(a.dtype)


def row_scatter_lerp_reference(x, index, a, b, s, shift, emb) -> torch.Tensor:
    """The rows ``squad::row_scatter_lerp_`` writes (returned; the op writes them into x)."""
    ct = _ct(x.dtype)
    out = b.to(ct)
    if s is not None:
        weight = s.to(ct) if shift is None else s.to(ct) + shift.to(ct).unsqueeze(1)
        out = a.to(ct) + weight.unsqueeze(-1) * (out - a.to(ct))
    if emb is not None:
        out = out - emb.to(ct).unsqueeze(1)
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("squad::row_norm", mutates_args=(),
                         schema="(Tensor x, Tensor? index, Tensor? emb, Tensor weight, Tensor bias, float eps) "
                                "-> (Tensor, Tensor)")
def row_norm(x, index, emb, weight, bias, eps):
    """LayerNorm of (selected) rows plus a per-row embedding (module docstring).

    Args:
        x: [R, N, D]; index: [R, K] int64 tokens to read, or None (all N); emb: [R, D] or None; weight, bias: [D].

    Returns:
        (h [R, K or N, D], the embedded selected rows [R, K, D] — an empty tensor without an index).
    """
    _check("row_norm", x, index, emb)
    if _use_triton(x, weight):
        from . import triton_rows
        return triton_rows.row_norm(x, index, emb, weight, bias, eps)
    return row_norm_reference(x, index, emb, weight, bias, eps)


@row_norm.register_fake
def _(x, index, emb, weight, bias, eps):
    _check("row_norm", x, index, emb)
    rows = x.shape[1] if index is None else index.shape[1]
    return x.new_empty(x.shape[0], rows, x.shape[2]), (x.new_empty(x.shape[0], rows, x.shape[2]) if index is not None
                                                       else x.new_empty(0, 0, 0))


@torch.library.custom_op("squad::row_add", mutates_args=(), schema="(Tensor a, Tensor b, Tensor? emb) -> Tensor")
def row_add(a, b, emb):
    """a + b + emb[r] for a, b [R, N, D] and emb [R, D] or None."""
    _check("row_add", a, None, emb)
    if a.shape != b.shape:
        raise ValueError(f"squad::row_add: a {tuple(a.shape)} and b {tuple(b.shape)} must agree")
    if _use_triton(a, b):
        from . import triton_rows
        return triton_rows.row_add(a, b, emb)
    return row_add_reference(a, b, emb)


@row_add.register_fake
def _(a, b, emb):
    _check("row_add", a, None, emb)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _check_scatter(x, index, a, b, s, shift, emb) -> None:
    _check("row_scatter_lerp_", x, index, emb)
    shape = (x.shape[0], index.shape[1], x.shape[2])
    if tuple(b.shape) != shape or (s is not None and (tuple(a.shape) != shape or s.shape != index.shape)):
        raise ValueError(f"squad::row_scatter_lerp_: b (and a, with s) must be {shape}, s [R, K]; got a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)}, s {None if s is None else tuple(s.shape)}")


@torch.library.custom_op("squad::row_scatter_lerp_", mutates_args=("x",),
                         schema="(Tensor(a!) x, Tensor index, Tensor a, Tensor b, Tensor? s, Tensor? shift, "
                                "Tensor? emb) -> ()")
def row_scatter_lerp_(x, index, a, b, s, shift, emb):
    """x[r, index[r, j]] = a + (s + shift[r]) · (b - a) - emb[r] in place (``b - emb[r]`` without s).

    Args:
        x: [R, N, D], written at the indexed tokens only; index: [R, K] int64 (distinct per row); a, b: [R, K, D];
            s: [R, K] or None; shift: [R] or None (with s); emb: [R, D] or None.
    """
    _check_scatter(x, index, a, b, s, shift, emb)
    if _use_triton(x, b):
        from . import triton_rows
        triton_rows.row_scatter_lerp_(x, index, a, b, s, shift, emb)
        return
    rows = row_scatter_lerp_reference(x, index, a, b, s, shift, emb)
    x.scatter_(1, index.unsqueeze(-1).expand(-1, -1, x.shape[2]), rows)


@row_scatter_lerp_.register_fake
def _(x, index, a, b, s, shift, emb):
    _check_scatter(x, index, a, b, s, shift, emb)
