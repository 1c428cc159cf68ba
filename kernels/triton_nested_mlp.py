"""Triton kernel of MoNE inference's whole MLP sublayer in one launch: layer norm, the nested first projection, GELU,
the nested second projection and the scaled residual add, with the hidden layer never in memory.

Tokens are rows in G consecutive groups (``LAYOUT[0, g]``: int32 cumulative end of group g; ``LAYOUT[1, g]``: its
width w_g, as `triton_nested`'s); a token of group g reads the first w_g features of the normed row and writes the
first w_g features of its output. For a tile of rows of one group, `_nested_mlp_kernel` computes in place

    x[t, :w] += (α · gate[t] + 1) · (gelu(LN(x[t])[:w] @ W1[:, :w]ᵀ + b1) @ W2[:w]ᵀ + b2[:w])

(without HAS_SCALE the factor is 1: a plain pre-norm MLP sublayer, e.g. MoD's inner block, one group of width D)

- the layer norm's statistics over all D features (two passes over the row: mean, then the centred squares), then
  the row's first w normalised features made once (rounded to x's dtype, as a stored norm would be) into a scratch
  row (``NORMED``) that the tile's own threads read back for every hidden chunk — from L2, where the tile just wrote
  it — instead of normalising the row again on CUDA cores for each of the HID / BLOCK_H chunks;
- K tiles of 64 features for 16-bit operands (tensor-core sized; a token of width w reads ceil(w / 64) · 64);
- the hidden layer (all of its features, MoNE's MLP hidden is full width) a BLOCK_H-wide chunk at a time: each chunk
  is made by the first projection, goes through GELU (rounded to x's dtype) and into the second projection's
  accumulators while it is in registers;
- the second projection's output in W_CHUNKS accumulators of BLOCK_W features (the row's first D); a chunk past the
  group's width is skipped at run time, so a token of width w costs ceil(w / BLOCK_W) · BLOCK_W output features;
- ``gate`` is read where the router left it (token t = n·R + r of the token-major rows is ``GATE[r, n]``).

Each program owns its rows entirely (every output feature of them), so reading the row before writing its first w
features in place is safe. fp32 accumulation and element-wise math; bf16 tiles upcast in the interpreter
(``UPCAST``). Block sizes are powers of two >= 16; D at most W_CHUNKS · BLOCK_W (8 chunks).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tiles import MLP_MAX_CHUNKS, launch_settings
from .triton_common import device_function, gelu, interpreter_enabled, tile_group, wrap_kernels

MAX_CHUNKS = MLP_MAX_CHUNKS


@device_function
def _out_chunk(acc, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, chunk, width, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_W: tl.constexpr):
    """acc += hid @ W2[chunk's features, the hidden chunk]ᵀ, when the chunk starts inside the row's width."""
    if chunk * BLOCK_W < width:
        offs_n = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
        w2 = tl.load(W2 + offs_n[None, :] * stride_w2n + offs_h[:, None] * stride_w2h,
                     mask=mask_h[:, None] & (offs_n < width)[None, :], other=0.0)  # [BLOCK_H, BLOCK_W]
        if UPCAST:
            w2 = w2.to(tl.float32)
        acc = tl.dot(hid, w2, acc, input_precision=PRECISION)
    return acc


@device_function
def _store_chunk(X, B2, acc, x_rows, mask_m, scale, chunk, width, BLOCK_W: tl.constexpr):
    """x[rows, chunk's features below the width] += scale · (acc + b2)."""
    if chunk * BLOCK_W < width:
        offs_n = chunk * BLOCK_W + tl.arange(0, BLOCK_W)
        mask = mask_m[:, None] & (offs_n < width)[None, :]
        ptrs = x_rows[:, None] + offs_n[None, :]
        b2 = tl.load(B2 + offs_n, mask=offs_n < width, other=0.0).to(tl.float32)
        res = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (res + scale[:, None] * (acc + b2[None, :])).to(X.dtype.element_ty), mask=mask)


def _nested_mlp_kernel(X, LN_W, LN_B, W1, B1, W2, B2, LAYOUT, GATE, ALPHA, NORMED,
                       T, D, HID, G, PERIOD, eps,
                       stride_xm, stride_nm, stride_w1h, stride_w1k, stride_w2n, stride_w2h, stride_g0, stride_g1,
                       HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, W_CHUNKS: tl.constexpr):
    grp, first, end = tile_group(tl.program_id(0), LAYOUT, G, T, BLOCK_M)
    if grp < 0 or grp == G:
        return
    width = tl.load(LAYOUT + G + grp)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = offs_m.to(tl.int64)
    x_rows = X + rows * stride_xm
    eps = tl.cast(eps, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, D, BLOCK_K):  # the layer norm's mean over all D features
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & (offs_k < D)[None, :], other=0.0)
        total += tl.sum(x.to(tl.float32), axis=1)
    mean = total / D
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, D, BLOCK_K):  # ... and variance, from the centred features
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_m[:, None] & (offs_k < D)[None, :]
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        centred = tl.where(mask, x - mean[:, None], 0.0)
        squares += tl.sum(centred * centred, axis=1)
    rstd = 1.0 / tl.sqrt(squares / D + eps)
    n_rows = NORMED + rows * stride_nm
    for k0 in range(0, width, BLOCK_K):  # the normed features the first projection reads, made once per row
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < width
        mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        gamma = tl.load(LN_W + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        beta = tl.load(LN_B + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        normed = (x - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
        tl.store(n_rows[:, None] + offs_k[None, :], normed.to(NORMED.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # the tile's normed rows, written by all of its threads, are read by all of them below
    acc0 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc4 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc5 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc6 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    acc7 = tl.zeros([BLOCK_M, BLOCK_W], tl.float32)
    for h0 in range(0, HID, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < HID
        pre = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
        for k0 in range(0, width, BLOCK_K):  # the first projection over the group's first w normed features
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < width
            a = tl.load(n_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w1 = tl.load(W1 + offs_h[None, :] * stride_w1h + offs_k[:, None] * stride_w1k,
                         mask=mask_k[:, None] & mask_h[None, :], other=0.0)  # W1ᵀ tile [BLOCK_K, BLOCK_H]
            if UPCAST:
                a = a.to(tl.float32)
                w1 = w1.to(tl.float32)
            pre = tl.dot(a, w1, pre, input_precision=PRECISION)
        b1 = tl.load(B1 + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        hid = gelu(pre + b1[None, :]).to(X.dtype.element_ty)
        if UPCAST:
            hid = hid.to(tl.float32)
        acc0 = _out_chunk(acc0, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 0, width, UPCAST, PRECISION, BLOCK_W)
        if W_CHUNKS > 1:
            acc1 = _out_chunk(acc1, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 1, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 2:
            acc2 = _out_chunk(acc2, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 2, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 3:
            acc3 = _out_chunk(acc3, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 3, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 4:
            acc4 = _out_chunk(acc4, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 4, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 5:
            acc5 = _out_chunk(acc5, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 5, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 6:
            acc6 = _out_chunk(acc6, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 6, width, UPCAST, PRECISION,
                              BLOCK_W)
        if W_CHUNKS > 7:
            acc7 = _out_chunk(acc7, hid, W2, stride_w2n, stride_w2h, offs_h, mask_h, 7, width, UPCAST, PRECISION,
                              BLOCK_W)
    scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if HAS_SCALE:
        gate = tl.load(GATE + (rows % PERIOD) * stride_g0 + (rows // PERIOD) * stride_g1, mask=mask_m, other=0.0)
        scale += tl.load(ALPHA).to(tl.float32) * gate.to(tl.float32)
    _store_chunk(X, B2, acc0, x_rows, mask_m, scale, 0, width, BLOCK_W)
    if W_CHUNKS > 1:
        _store_chunk(X, B2, acc1, x_rows, mask_m, scale, 1, width, BLOCK_W)
    if W_CHUNKS > 2:
        _store_chunk(X, B2, acc2, x_rows, mask_m, scale, 2, width, BLOCK_W)
    if W_CHUNKS > 3:
        _store_chunk(X, B2, acc3, x_rows, mask_m, scale, 3, width, BLOCK_W)
    if W_CHUNKS > 4:
        _store_chunk(X, B2, acc4, x_rows, mask_m, scale, 4, width, BLOCK_W)
    if W_CHUNKS > 5:
        _store_chunk(X, B2, acc5, x_rows, mask_m, scale, 5, width, BLOCK_W)
    if W_CHUNKS > 6:
        _store_chunk(X, B2, acc6, x_rows, mask_m, scale, 6, width, BLOCK_W)
    if W_CHUNKS > 7:
        _store_chunk(X, B2, acc7, x_rows, mask_m, scale, 7, width, BLOCK_W)


@functools.cache
def _kernels() -> dict[str, object]:
    return wrap_kernels(_nested_mlp_kernel)


def nested_mlp_(x: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, eps: float, w1: torch.Tensor,
                b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, layout: torch.Tensor, gate: torch.Tensor | None,
                alpha: torch.Tensor | None, config: dict) -> None:
    """Launches `_nested_mlp_kernel` on x [T, D] in place (arguments as ``squad::nested_mlp_`` takes them,
    `squad.kernels.nested`; gate [R, N] with T = N·R token-major rows)."""
    cfg, launch = launch_settings(config)
    t, d = x.shape
    g = layout.shape[1]
    grid = (triton.cdiv(t, cfg["BLOCK_M"]) + g + 1,)
    scaled = gate is not None
    normed = torch.empty_like(x)  # [T, D] scratch: each row's first w normed features, written and read by its tile
    _kernels()["_nested_mlp_kernel"][grid](
        x, ln_w, ln_b, w1, b1, w2, b2, layout, gate if scaled else layout, alpha if scaled else layout, normed, t, d,
        w1.shape[0], g, gate.shape[0] if scaled else 1, eps, x.stride(0), normed.stride(0), *w1.stride(),
        *w2.stride(),
        *(gate.stride() if scaled else (0, 0)), HAS_SCALE=scaled,
        UPCAST=bool(interpreter_enabled() and x.dtype == torch.bfloat16), PRECISION="ieee", **cfg, **launch)
