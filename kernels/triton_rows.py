"""Triton row kernels of the inference path (`squad.kernels.rows`): a layer norm that reads (selected) rows with a
per-row embedding added, a residual add with the embedding, and a MoD block's in-place write-back.

Every kernel takes a tile of BLOCK_M rows with all D features (BLOCK_D, a power of two covering D); row t of the
output is token j = t % K of image row r = t // K, which reads token ``index[r, j]`` (or j) of x [R, N, D]. Element
math is fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_common import wrap_kernels


def _row_norm_kernel(X, INDEX, EMB, WEIGHT, BIAS, OUT, ROWS, T, K, D, eps,
                     stride_xr, stride_xn, stride_ir, stride_ik, stride_er,
                     HAS_INDEX: tl.constexpr, HAS_EMB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    eps = tl.cast(eps, tl.float32)
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_t = offs_t < T
    rows = offs_t.to(tl.int64)
    img, tok = rows // K, rows % K
    if HAS_INDEX:
        tok = tl.load(INDEX + img * stride_ir + tok * stride_ik, mask=mask_t, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    v = tl.load(X + (img * stride_xr + tok * stride_xn)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = v.to(tl.float32)
    if HAS_EMB:
        v += tl.load(EMB + img[:, None] * stride_er + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_INDEX:
        tl.store(ROWS + rows[:, None] * D + offs_d[None, :], v.to(ROWS.dtype.element_ty), mask=mask)
    mean = tl.sum(v, axis=1) / D
    centred = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    weight = tl.load(WEIGHT + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    bias = tl.load(BIAS + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(OUT + rows[:, None] * D + offs_d[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def _row_add_kernel(A, B, EMB, OUT, T, K, D, stride_ar, stride_an, stride_br, stride_bn, stride_er,
                    HAS_EMB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_t = offs_t < T
    rows = offs_t.to(tl.int64)
    img, tok = rows // K, rows % K
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    out = tl.load(A + (img * stride_ar + tok * stride_an)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    out = out.to(tl.float32) + tl.load(B + (img * stride_br + tok * stride_bn)[:, None] + offs_d[None, :], mask=mask,
                                       other=0.0).to(tl.float32)
    if HAS_EMB:
        out += tl.load(EMB + img[:, None] * stride_er + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def _row_scatter_lerp_kernel(X, INDEX, A, B, S, SHIFT, EMB, T, K, D,
                             stride_xr, stride_xn, stride_ir, stride_ik, stride_ar, stride_ak, stride_br, stride_bk,
                             stride_sr, stride_sk, stride_er,
                             HAS_S: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_EMB: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_t = offs_t < T
    rows = offs_t.to(tl.int64)
    img, j = rows // K, rows % K
    tok = tl.load(INDEX + img * stride_ir + j * stride_ik, mask=mask_t, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    out = tl.load(B + (img * stride_br + j * stride_bk)[:, None] + offs_d[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    if HAS_S:
        a = tl.load(A + (img * stride_ar + j * stride_ak)[:, None] + offs_d[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        s = tl.load(S + img * stride_sr + j * stride_sk, mask=mask_t, other=0.0).to(tl.float32)
        if HAS_SHIFT:
            s += tl.load(SHIFT + img, mask=mask_t, other=0.0).to(tl.float32)
        out = a + s[:, None] * (out - a)
    if HAS_EMB:
        out -= tl.load(EMB + img[:, None] * stride_er + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(X + (img * stride_xr + tok * stride_xn)[:, None] + offs_d[None, :], out.to(X.dtype.element_ty), mask=mask)


@functools.cache
def _kernels() -> dict[str, object]:
    return wrap_kernels(_row_norm_kernel, _row_add_kernel, _row_scatter_lerp_kernel)


def _tiles(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, warps): all D features of a row in one tile, 4096 elements a program."""
    block_d = max(16, triton.next_power_of_2(d))
    return max(1, min(16, 4096 // block_d)), block_d, 4


def row_norm(x: torch.Tensor, index: torch.Tensor | None, emb: torch.Tensor | None, weight: torch.Tensor,
             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches `_row_norm_kernel` (arguments as ``squad::row_norm`` takes them)."""
    r, n, d = x.shape
    k = n if index is None else index.shape[1]
    out = torch.empty(r, k, d, dtype=x.dtype, device=x.device)
    rows = torch.empty_like(out) if index is not None else x.new_empty(0, 0, 0)
    block_m, block_d, warps = _tiles(d)
    dummy = weight
    _kernels()["_row_norm_kernel"][(triton.cdiv(r * k, block_m),)](
        x, dummy if index is None else index, dummy if emb is None else emb, weight, bias, out,
        rows if index is not None else out, r * k, k, d, eps, x.stride(0), x.stride(1),
        *(index.stride() if index is not None else (0, 0)), emb.stride(0) if emb is not None else 0,
        HAS_INDEX=index is not None, HAS_EMB=emb is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out, rows


def row_add(a: torch.Tensor, b: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
    """Launches `_row_add_kernel`: a + b + emb[r], [R, N, D] contiguous."""
    r, n, d = a.shape
    out = torch.empty(r, n, d, dtype=a.dtype, device=a.device)
    block_m, block_d, warps = _tiles(d)
    _kernels()["_row_add_kernel"][(triton.cdiv(r * n, block_m),)](
        a, b, a if emb is None else emb, out, r * n, n, d, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        emb.stride(0) if emb is not None else 0, HAS_EMB=emb is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=warps)
    return out


def row_scatter_lerp_(x: torch.Tensor, index: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      s: torch.Tensor | None, shift: torch.Tensor | None, emb: torch.Tensor | None) -> None:
    """Launches `_row_scatter_lerp_kernel` (x written in place at the indexed tokens)."""
    r, k = index.shape
    d = x.shape[2]
    block_m, block_d, warps = _tiles(d)
    dummy = b
    _kernels()["_row_scatter_lerp_kernel"][(triton.cdiv(r * k, block_m),)](
        x, index, a, b, dummy if s is None else s, dummy if shift is None else shift, dummy if emb is None else emb,
        r * k, k, d, x.stride(0), x.stride(1), *index.stride(), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        *(s.stride() if s is not None else (0, 0)), emb.stride(0) if emb is not None else 0,
        HAS_S=s is not None, HAS_SHIFT=shift is not None, HAS_EMB=emb is not None, BLOCK_M=block_m,
        BLOCK_D=block_d, num_warps=warps)
