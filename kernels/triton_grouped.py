"""Triton grouped GEMMs over expert-sorted rows that gather their inputs and scatter their outputs by index.

The design is ScatterMoE's (Tan et al. 2024), written here: an MoE layer sorts its (token, slot) pairs by expert
once, and every projection is ONE launch over those sorted rows in which a row reads its input straight from the
token it came from (``A_ROWS``: no gathered copy of the tokens) and writes its output straight to where the next step
wants it (``OUT_ROWS``: (token, slot) order, so summing a token's k outputs is a sum over k contiguous rows). Bias,
GELU, the gate and the gate's gradient happen in the epilogue, on the tile in registers, instead of in passes over
the [M·k, N] rows.

Rows are laid out in G consecutive groups (``ENDS[g]``: int32 cumulative end of group g, on the device); group g
multiplies weight g. Rows past the last group (``ENDS[G-1] .. R``, slots of no-op experts and dropped slots) form a
tail that multiplies nothing: every output row of it is zero. Nothing is read back to the host: the grid has an
upper bound of row tiles (``cdiv(R, BLOCK_M) + G + 1``) times the N tiles, and each program finds its group by a scan
of the G ends; programs past the last tile return at once. The launch order is grouped (`squad.kernels.tiles`,
``GROUP_M``): GROUP_M row tiles × every N tile run one after another, so a row tile's gathered input is read from
HBM once and served from L2 to its N tiles, instead of once per N tile a whole pass apart.

Kernels:

- `_grouped_mm_kernel`: out[o(i)] = epilogue(A[a(i)] @ W[g(i)]) for sorted rows i, with o(i) = OUT_ROWS[i] or i and
  a(i) = A_ROWS[i] or i. Epilogues (``EPILOGUE``):
  0 ``linear``: (acc + bias[g]) · scale[i];
  1 ``gelu``: gelu(acc + bias[g]), the pre-activation also written to EXTRA when STORE_PRE;
  2 ``gate_grad``: the backward of a gated projection ``y = s · act(aux) W``: out = s · acc · act'(aux) and, per N
  tile, EXTRA[i, tile] = Σ_n acc · act(aux) (the gate's gradient, partial sums added by the caller), with act GELU
  when AUX_GELU else the identity; with a bias given, Σ_k A[a(i), k] · bias[g, k] is added to tile 0's sum (the
  gate's gradient through the bias of the projection whose backward this is). That sum is a loop of its own after
  the GEMM's K loop, reading the row tile again: summed inside the pipelined K loop from the tile `tl.dot` consumes,
  it gave wrong outputs on an H200 at 128×128 tiles (reports/bench/gpu_check_h200; the interpreter showed nothing).
- `_grouped_wgrad_kernel`: dW[g] = Σ_{i in g} A[a(i)]ᵀ · (scale[i] · B[b(i)]) and, when asked, db[g] = Σ_{i in g}
  scale[i] · B[b(i)] (the weight and bias gradients), one program per (group, dW tile) looping over the group's rows.

fp16/bf16 operands go to `tl.dot` with fp32 accumulation; fp32 operands use IEEE precision (no TF32, as
torch.matmul's default). Element-wise epilogue math is fp32. Triton's CPU interpreter computes bf16 wrongly, so
there bf16 tiles are upcast to fp32 after loading (``UPCAST``). Block sizes are powers of two >= 16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tiles import launch_settings, mm_config, wgrad_config
from .triton_common import gelu, gelu_grad, grouped_order, interpreter_enabled, tile_group, wrap_kernels

EPILOGUES = {"linear": 0, "gelu": 1, "gate_grad": 2}


def _grouped_mm_kernel(A, A_ROWS, W, BIAS, ENDS, SCALE, OUT_ROWS, OUT, EXTRA, AUX,
                       R, K, N, G, TILES_M,
                       stride_am, stride_ak, stride_wg, stride_wk, stride_wn, stride_bg, stride_bn,
                       stride_om, stride_on, stride_em, stride_en, stride_xm, stride_xn,
                       GATHER: tl.constexpr, SCATTER: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_SCALE: tl.constexpr, EPILOGUE: tl.constexpr, STORE_PRE: tl.constexpr,
                       AUX_GELU: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    tile_m, pid_n = grouped_order(tl.program_id(0), TILES_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    grp, first, end = tile_group(tile_m, ENDS, G, R, BLOCK_M)
    if grp < 0:
        return
    offs_m = first + tl.arange(0, BLOCK_M)  # sorted rows
    mask_m = offs_m < end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SCATTER:
        out_rows = tl.load(OUT_ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        out_rows = offs_m.to(tl.int64)
    out_ptrs = OUT + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    extra_tile = EXTRA + offs_m.to(tl.int64) * stride_em + pid_n * stride_en  # gate_grad: [R, N tiles]
    extra_ptrs = EXTRA + out_rows[:, None] * stride_em + offs_n[None, :] * stride_en  # gelu: [R, N] like OUT
    if grp == G:  # the tail: rows of no group multiply nothing
        tl.store(out_ptrs, tl.zeros([BLOCK_M, BLOCK_N], tl.float32).to(OUT.dtype.element_ty), mask=mask_mn)
        if EPILOGUE == 1 and STORE_PRE:
            tl.store(extra_ptrs, tl.zeros([BLOCK_M, BLOCK_N], tl.float32).to(EXTRA.dtype.element_ty), mask=mask_mn)
        if EPILOGUE == 2:
            tl.store(extra_tile, tl.zeros([BLOCK_M], tl.float32), mask=mask_m)
        return
    if GATHER:
        a_rows = tl.load(A_ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    w_base = W + grp.to(tl.int64) * stride_wg
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    bias_dot = tl.zeros([BLOCK_M], tl.float32)  # gate_grad: Σ_k a · bias[g, k]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if EPILOGUE == 2 and HAS_BIAS:
        if pid_n == 0:  # the bias's share of the gate gradient: a loop of its own over the row tile (see below)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
                bk = tl.load(BIAS + grp * stride_bg + offs_k * stride_bn, mask=mask_k, other=0.0).to(tl.float32)
                bias_dot += tl.sum(a * bk[None, :], axis=1)
    if HAS_SCALE:
        scale = tl.load(SCALE + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    if EPILOGUE == 0:
        if HAS_BIAS:
            acc += tl.load(BIAS + grp * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_SCALE:
            acc = acc * scale
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_mn)
    elif EPILOGUE == 1:
        if HAS_BIAS:
            acc += tl.load(BIAS + grp * stride_bg + offs_n * stride_bn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if STORE_PRE:
            tl.store(extra_ptrs, acc.to(EXTRA.dtype.element_ty), mask=mask_mn)
        tl.store(out_ptrs, gelu(acc).to(OUT.dtype.element_ty), mask=mask_mn)
    else:
        aux = tl.load(AUX + out_rows[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask_mn,
                      other=0.0).to(tl.float32)
        if AUX_GELU:
            part = tl.sum(acc * gelu(aux), axis=1)
            acc = acc * gelu_grad(aux)
        else:
            part = tl.sum(acc * aux, axis=1)
        tl.store(extra_tile, part + bias_dot, mask=mask_m)
        if HAS_SCALE:
            acc = acc * scale
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_mn)


def _grouped_wgrad_kernel(A, A_ROWS, B, B_ROWS, SCALE, ENDS, DW, DB,
                          K, N,
                          stride_am, stride_ak, stride_bm, stride_bn, stride_wg, stride_wk, stride_wn,
                          stride_dg, stride_dn,
                          GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, HAS_SCALE: tl.constexpr,
                          HAS_DB: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    grp = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_k = tl.program_id(1) // tiles_n
    pid_n = tl.program_id(1) % tiles_n
    first = tl.where(grp > 0, tl.load(ENDS + tl.maximum(grp - 1, 0)), 0)
    end = tl.load(ENDS + grp)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(first, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        if GATHER_A:
            a_rows = tl.load(A_ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
        else:
            a_rows = offs_m.to(tl.int64)
        if GATHER_B:
            b_rows = tl.load(B_ROWS + offs_m, mask=mask_m, other=0).to(tl.int64)
        else:
            b_rows = offs_m.to(tl.int64)
        a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(B + b_rows[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if HAS_SCALE:
            s = tl.load(SCALE + offs_m, mask=mask_m, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * s[:, None]).to(a.dtype)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        if HAS_DB:
            db += tl.sum(b.to(tl.float32), axis=0)
    w_ptrs = DW + grp.to(tl.int64) * stride_wg + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    tl.store(w_ptrs, acc.to(DW.dtype.element_ty), mask=mask_k[:, None] & mask_n[None, :])
    if HAS_DB:
        if pid_k == 0:
            tl.store(DB + grp * stride_dg + offs_n * stride_dn, db.to(DB.dtype.element_ty), mask=mask_n)


@functools.cache
def _kernels() -> dict[str, object]:
    """The kernels, wrapped for the compiler or the interpreter (whichever mode Triton was imported in)."""
    return wrap_kernels(_grouped_mm_kernel, _grouped_wgrad_kernel)


def _flags(dtype: torch.dtype) -> dict[str, object]:
    return {"UPCAST": bool(interpreter_enabled() and dtype == torch.bfloat16), "PRECISION": "ieee"}


def grouped_mm(a: torch.Tensor, a_rows: torch.Tensor | None, w: torch.Tensor, bias: torch.Tensor | None,
               ends: torch.Tensor, scale: torch.Tensor | None, out_rows: torch.Tensor | None, aux: torch.Tensor | None,
               rows: int, epilogue: str, store_pre: bool = True, aux_gelu: bool = False,
               config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches `_grouped_mm_kernel` (see the module docstring; arguments as ``squad::grouped_mm`` takes them,
    `squad.kernels.grouped`; ``config`` overrides `grouped.mm_config`, e.g. small tiles in tests).

    Returns:
        (out [rows, N] in a's dtype, extra): the pre-activation [rows, N] for ``gelu`` with ``store_pre``, the gate's
        gradient partial sums [rows, N tiles] float32 for ``gate_grad``, else an empty tensor.
    """
    k, n = w.shape[1], w.shape[2]
    cfg, launch = launch_settings(config or mm_config(k, n, a.dtype))
    cfg.setdefault("GROUP_M", 1)  # a hand-made config without a launch order: a row tile's N tiles in turn
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    code = EPILOGUES[epilogue]
    if code == 1 and store_pre:
        extra = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    elif code == 2:
        extra = torch.empty(rows, triton.cdiv(n, cfg["BLOCK_N"]), dtype=torch.float32, device=a.device)
    else:
        extra = out.new_empty(0, 0)
    g = ends.shape[0]
    dummy = ends  # never read: the flag that would read it is off
    tiles_m = triton.cdiv(rows, cfg["BLOCK_M"]) + g + 1  # an upper bound: each group's last tile may be partial
    grid = (tiles_m * triton.cdiv(n, cfg["BLOCK_N"]),)
    if rows == 0:
        return out, extra
    bias_strides = bias.stride() if bias is not None else (0, 0)
    aux_strides = aux.stride() if aux is not None else (0, 0)
    extra_strides = extra.stride() if extra.dim() == 2 and extra.numel() else (0, 0)
    _kernels()["_grouped_mm_kernel"][grid](
        a, dummy if a_rows is None else a_rows, w, dummy if bias is None else bias, ends,
        dummy if scale is None else scale, dummy if out_rows is None else out_rows, out, extra,
        dummy if aux is None else aux,
        rows, k, n, g, tiles_m, *a.stride(), *w.stride(), *bias_strides, *out.stride(), *extra_strides, *aux_strides,
        GATHER=a_rows is not None, SCATTER=out_rows is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None, EPILOGUE=code, STORE_PRE=bool(store_pre), AUX_GELU=bool(aux_gelu),
        **_flags(a.dtype), **cfg, **launch)
    return out, extra


def grouped_wgrad(a: torch.Tensor, a_rows: torch.Tensor | None, b: torch.Tensor, b_rows: torch.Tensor | None,
                  scale: torch.Tensor | None, ends: torch.Tensor, bias_grad: bool, dtype: torch.dtype,
                  config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches `_grouped_wgrad_kernel`: (dW [G, K, N], db [G, N] or an empty tensor) in ``dtype``."""
    k, n, g = a.shape[1], b.shape[1], ends.shape[0]
    cfg, launch = launch_settings(config or wgrad_config(k, n, a.dtype))
    dw = torch.empty(g, k, n, dtype=dtype, device=a.device)
    db = torch.empty(g, n, dtype=dtype, device=a.device) if bias_grad else dw.new_empty(0, 0)
    dummy = ends
    grid = (g, triton.cdiv(k, cfg["BLOCK_K"]) * triton.cdiv(n, cfg["BLOCK_N"]))
    _kernels()["_grouped_wgrad_kernel"][grid](
        a, dummy if a_rows is None else a_rows, b, dummy if b_rows is None else b_rows,
        dummy if scale is None else scale, ends, dw, db if bias_grad else dummy, k, n,
        *a.stride(), *b.stride(), *dw.stride(), *(db.stride() if bias_grad else (0, 0)),
        GATHER_A=a_rows is not None, GATHER_B=b_rows is not None, HAS_SCALE=scale is not None,
        HAS_DB=bool(bias_grad), **_flags(a.dtype), **cfg, **launch)
    return dw, db
