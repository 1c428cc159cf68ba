"""Triton kernels of MoNE inference: nested-width projections and a layer norm that writes only the width read.

Tokens are rows in G consecutive groups (``LAYOUT[0, g]``: int32 cumulative end of group g; ``LAYOUT[1, g]``: its
width w_g); group g uses the first w_g features of a projection (Mixture of Nested Experts). One launch serves all
groups:

- `_nested_mm_kernel`, input projection (``IN_MODE``): out[t] = act(x[t, :w] @ W[:, :w]ᵀ + b), the sum over the
  group's w input features only, every output feature (``act``: GELU when ``GELU``, fused, so the hidden layer is
  written once and never re-read for an activation pass);
- the same kernel, output projection: only the first w output features are computed, ``acc = x[t] @ W[:w]ᵀ +
  b[:w]``, and added to a residual r in the epilogue: out[t] = r[t] (+ e[t]) + s[t] · acc on those features and
  out[t] = r[t] (+ e[t]) on the others (``RESIDUAL == 1``: a new tensor, written once), or r[t, :w] += s[t] · acc in
  place (``RESIDUAL == 2``: the other features are not touched at all);
- `_nested_norm_kernel`: LayerNorm of x[t] (+ e[t]) over all D features, written only where the next nested
  projection reads it (the first w features).

The input rows may be two-level (``A_DIV`` > 1): row t reads ``A + (t // A_DIV) · stride_a0 + (t % A_DIV) ·
stride_a1``, and its features two-level too (feature k at ``(k // A_COLDIV) · stride_ak0 + (k % A_COLDIV) ·
stride_ak1``), so the attention's output [R, H, N, d] is read where SDPA wrote it, whatever its memory order, as
token-major rows t = n·R + r of H·d features, without a permuting copy. ``e`` is a per-row embedding indexed by
t % PERIOD (the image row of token-major rows). fp32 accumulation; element-wise math in fp32; bf16 tiles upcast in
the interpreter (``UPCAST``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tiles import launch_settings
from .triton_common import gelu, interpreter_enabled, tile_group, wrap_kernels


def _nested_mm_kernel(A, W, BIAS, LAYOUT, RES, EMB, SCALE, OUT,
                      T, K, N, G, A_DIV, A_COLDIV, PERIOD,
                      stride_a0, stride_a1, stride_ak0, stride_ak1, stride_wn, stride_wk,
                      stride_rm, stride_rn, stride_em, stride_en, stride_om, stride_on,
                      IN_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, RESIDUAL: tl.constexpr,
                      HAS_EMB: tl.constexpr, HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(1)
    grp, first, end = tile_group(tl.program_id(0), LAYOUT, G, T, BLOCK_M)
    if grp < 0 or grp == G:
        return
    width = tl.load(LAYOUT + G + grp)
    k_lim = width if IN_MODE else K
    n_lim = N if IN_MODE else width
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    compute = pid_n * BLOCK_N < n_lim
    if RESIDUAL == 2:
        if not compute:
            return  # in place: the features past the group's width stay as they are
    a_base = A + (rows // A_DIV) * stride_a0 + (rows % A_DIV) * stride_a1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    mask_nw = offs_n < n_lim
    if compute:
        for k0 in range(0, k_lim, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_lim
            a_cols = (offs_k // A_COLDIV) * stride_ak0 + (offs_k % A_COLDIV) * stride_ak1
            a = tl.load(a_base[:, None] + a_cols[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(W + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                        mask=mask_k[:, None] & mask_nw[None, :], other=0.0)  # Wᵀ tile [BLOCK_K, BLOCK_N]
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_nw, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = gelu(acc)
    if RESIDUAL == 0:
        tl.store(OUT + rows[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(OUT.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])
    else:
        if HAS_SCALE:
            acc = acc * tl.load(SCALE + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        if RESIDUAL == 1:
            mask_store = mask_m[:, None] & mask_n[None, :]
        else:
            mask_store = mask_m[:, None] & mask_nw[None, :]
        res = tl.load(RES + rows[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask_store,
                      other=0.0).to(tl.float32)
        if HAS_EMB:
            e_rows = (rows % PERIOD)[:, None] * stride_em
            res += tl.load(EMB + e_rows + offs_n[None, :] * stride_en, mask=mask_store, other=0.0).to(tl.float32)
        res = tl.where(mask_nw[None, :], res + acc, res)
        tl.store(OUT + rows[:, None] * stride_om + offs_n[None, :] * stride_on, res.to(OUT.dtype.element_ty),
                 mask=mask_store)


def _nested_norm_kernel(X, EMB, WEIGHT, BIAS, LAYOUT, OUT, T, D, G, PERIOD, eps,
                        stride_xm, stride_em, stride_om,
                        HAS_EMB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    eps = tl.cast(eps, tl.float32)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    rows = offs_m.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask = mask_m[:, None] & mask_d[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_EMB:
        x += tl.load(EMB + (rows % PERIOD)[:, None] * stride_em + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    weight = tl.load(WEIGHT + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    bias = tl.load(BIAS + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * weight[None, :] + bias[None, :]
    width = tl.zeros([BLOCK_M], tl.int32)
    prev = 0
    for g in range(G):  # each row's group width: the features the next projection reads
        e = tl.load(LAYOUT + g)
        width = tl.where((offs_m >= prev) & (offs_m < e), tl.load(LAYOUT + G + g), width)
        prev = e
    tl.store(OUT + rows[:, None] * stride_om + offs_d[None, :], y.to(OUT.dtype.element_ty),
             mask=mask & (offs_d[None, :] < width[:, None]))


@functools.cache
def _kernels() -> dict[str, object]:
    return wrap_kernels(_nested_mm_kernel, _nested_norm_kernel)


def nested_mm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, layout: torch.Tensor, period: int,
              in_mode: bool, use_gelu: bool, residual: torch.Tensor | None, emb: torch.Tensor | None,
              scale: torch.Tensor | None, out: torch.Tensor | None, config: dict) -> torch.Tensor:
    """Launches `_nested_mm_kernel` (arguments as ``squad::nested_linear`` takes them, `squad.kernels.nested`):
    ``a`` [T, K], [T / R, R, K] or [T / R, R, H, K / H]; ``out`` given: the residual itself (in place)."""
    cfg, launch = launch_settings(config)
    rows = a if a.dim() >= 3 else a.unsqueeze(1)  # [T / R, R, ...]
    feats = rows if rows.dim() == 4 else rows.unsqueeze(2)  # [T / R, R, H, K / H]
    a_div, col_div = feats.shape[1], feats.shape[3]
    s0, s1, sk0, sk1 = feats.stride()
    t, k, n = feats.shape[0] * a_div, feats.shape[2] * col_div, w.shape[0]
    mode = 0 if residual is None else (2 if out is residual else 1)
    if out is None:
        out = torch.empty(t, n, dtype=a.dtype, device=a.device)
    g = layout.shape[1]
    grid = (triton.cdiv(t, cfg["BLOCK_M"]) + g + 1, triton.cdiv(n, cfg["BLOCK_N"]))
    dummy = layout
    res = residual if residual is not None else out
    _kernels()["_nested_mm_kernel"][grid](
        a, w, dummy if bias is None else bias, layout, res, dummy if emb is None else emb,
        dummy if scale is None else scale, out, t, k, n, g, a_div, col_div, period, s0, s1, sk0, sk1, *w.stride(),
        *res.stride(),
        *(emb.stride() if emb is not None else (0, 0)), *out.stride(),
        IN_MODE=bool(in_mode), HAS_BIAS=bias is not None, GELU=bool(use_gelu), RESIDUAL=mode, HAS_EMB=emb is not None,
        HAS_SCALE=scale is not None, UPCAST=bool(interpreter_enabled() and a.dtype == torch.bfloat16),
        PRECISION="ieee", **cfg, **launch)
    return out


def nested_norm(x: torch.Tensor, emb: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                layout: torch.Tensor, period: int) -> torch.Tensor:
    """Launches `_nested_norm_kernel`: [T, D] with each row's first w features normalised (others unwritten)."""
    t, d = x.shape
    out = torch.empty_like(x)
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(1, min(16, 4096 // block_d))
    _kernels()["_nested_norm_kernel"][(triton.cdiv(t, block_m),)](
        x, layout if emb is None else emb, weight, bias, layout, out, t, d, layout.shape[1], period, eps,
        x.stride(0), emb.stride(0) if emb is not None else 0, out.stride(0),
        HAS_EMB=emb is not None, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    return out

