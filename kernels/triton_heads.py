"""Triton head-select GEMMs for MoE attention: the dense all-head projections with the [M, E·d] operand virtual.

A token selects k of E attention heads; ``SLOTS`` [M, E] int32 says which slot j of token m took head e (−1: m
did not select e), and the selected heads live compact, [M, k, d] (``C``/``AUX``/``OUT`` with any strides). Each
kernel treats the all-head operand of width E·d as E column blocks of width d and maps a block to a compact row
through the slot map, so the all-head GEMM reads each token once and nothing of width E·d is written or read:

- `_head_select_kernel`: one program per (row tile, head e): ``acc = A[rows] @ W[e]`` (W [E, K, d]), stored at
  ``OUT[m, slots[m, e]]`` for the rows that selected e (a tile no row of which selected e returns before its
  GEMM). GATED: ``OUT = g · acc`` and ``GATE_GRAD[m, j] = Σ_i acc · AUX[m, j]`` — the backward of a gated output
  projection, whose gate gradient is complete in the one program that owns (m, j).
- `_head_gather_kernel`: one program per (row tile, N tile): ``out = Σ_e V[rows, e] @ W[e] (+ A2 @ W2) + bias``
  with ``V[m, e] = g[m, j] · C[m, j]`` for j = slots[m, e], loaded as zero where −1; the K loop steps one head at a
  time.
- `_head_wgrad_kernel`: one program per (head e, N tile, row chunk) (split-K over the rows, order ``rows_split`` of
  `squad.kernels.tiles`): ``DW[s, e] = Σ_m V[m, e]ᵀ B[m]`` over chunk s's rows and, with HAS_DB, the head-0 programs
  also sum ``DB[s] = Σ_m B[m]`` (in a loop of their own: a tile `tl.dot` consumes is read for nothing else inside
  its pipelined loop). One chunk writes the result; several write float32 partials that `_split_sum_kernel` adds
  in chunk order (deterministic, no atomics).

fp16/bf16 operands go to `tl.dot` with fp32 accumulation; fp32 operands use IEEE precision; element-wise math in
fp32; bf16 tiles upcast in Triton's CPU interpreter (``UPCAST``), which computes bf16 dots wrongly. Block sizes are
powers of two >= 16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tiles import launch_settings, split_rows
from .triton_common import device_function, grouped_order, interpreter_enabled, wrap_kernels


@device_function
def _mma(acc, A, rows, mask_m, stride_am, stride_ak, W, offs_n, mask_n, stride_wk, stride_wn, K,
         UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += A[rows, :K] @ W[:K, offs_n], K stepped BLOCK_K at a time (masked past K, the rows and the columns)."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(W + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@device_function
def _head_rows(C, SLOTS, GATES, rows, mask_m, head, offs_d, mask_d, stride_cm, stride_cj, stride_cd, stride_sm,
               stride_se, stride_gm, stride_gj, GATED: tl.constexpr):
    """Head ``head``'s d features of rows ``rows`` of the [M, k, d] operand C, read through the slot map (zero where a
    row did not select the head), times the row's gate for the head when GATED."""
    slot = tl.load(SLOTS + rows * stride_sm + head * stride_se, mask=mask_m, other=-1)
    picked = mask_m & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    a = tl.load(C + rows[:, None] * stride_cm + slot[:, None] * stride_cj + offs_d[None, :] * stride_cd,
                mask=picked[:, None] & mask_d[None, :], other=0.0)
    if GATED:
        g = tl.load(GATES + rows * stride_gm + slot * stride_gj, mask=picked, other=0.0).to(tl.float32)
        a = (a.to(tl.float32) * g[:, None]).to(C.dtype.element_ty)
    return a


def _head_select_kernel(A, W, SLOTS, GATES, AUX, OUT, GATE_GRAD,
                        M, K, DH,
                        stride_am, stride_ak, stride_we, stride_wk, stride_wd, stride_sm, stride_se,
                        stride_gm, stride_gj, stride_xm, stride_xj, stride_xd, stride_om, stride_oj, stride_od,
                        stride_qm, stride_qj,
                        GATED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    head = tl.program_id(0)  # a row tile's heads run one after another: its rows are read once into L2
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)
    slot = tl.load(SLOTS + rows * stride_sm + head * stride_se, mask=mask_m, other=-1)
    if tl.max(slot, axis=0) < 0:
        return  # no row of this tile selected the head
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DH
    acc = _mma(tl.zeros([BLOCK_M, BLOCK_D], tl.float32), A, rows, mask_m, stride_am, stride_ak,
               W + head.to(tl.int64) * stride_we, offs_d, mask_d, stride_wk, stride_wd, K, UPCAST, PRECISION, BLOCK_K)
    picked = mask_m & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    mask_md = picked[:, None] & mask_d[None, :]
    if GATED:
        aux = tl.load(AUX + rows[:, None] * stride_xm + slot[:, None] * stride_xj + offs_d[None, :] * stride_xd,
                      mask=mask_md, other=0.0).to(tl.float32)
        tl.store(GATE_GRAD + rows * stride_qm + slot * stride_qj, tl.sum(acc * aux, axis=1), mask=picked)
        acc = acc * tl.load(GATES + rows * stride_gm + slot * stride_gj, mask=picked, other=0.0).to(tl.float32)[:, None]
    tl.store(OUT + rows[:, None] * stride_om + slot[:, None] * stride_oj + offs_d[None, :] * stride_od,
             acc.to(OUT.dtype.element_ty), mask=mask_md)


def _head_gather_kernel(C, SLOTS, GATES, W, A2, W2, BIAS, OUT,
                        M, N, E, DH, K2,
                        stride_cm, stride_cj, stride_cd, stride_sm, stride_se, stride_gm, stride_gj,
                        stride_we, stride_wd, stride_wn, stride_am, stride_ak, stride_vk, stride_vn,
                        stride_om, stride_on,
                        GATED: tl.constexpr, HAS_A2: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = grouped_order(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DH
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for head in range(0, E):  # K = E·d, one head's d features at a time
        a = _head_rows(C, SLOTS, GATES, rows, mask_m, head, offs_d, mask_d, stride_cm, stride_cj, stride_cd,
                       stride_sm, stride_se, stride_gm, stride_gj, GATED)
        w = tl.load(W + head * stride_we + offs_d[:, None] * stride_wd + offs_n[None, :] * stride_wn,
                    mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if HAS_A2:
        acc = _mma(acc, A2, rows, mask_m, stride_am, stride_ak, W2, offs_n, mask_n, stride_vk, stride_vn, K2, UPCAST,
                   PRECISION, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rows[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(OUT.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _head_wgrad_kernel(C, SLOTS, GATES, B, DW, DB,
                       M, N, DH, SPLIT_ROWS,
                       stride_cm, stride_cj, stride_cd, stride_sm, stride_se, stride_gm, stride_gj,
                       stride_bm, stride_bn, stride_ws, stride_we, stride_wd, stride_wn, stride_ds,
                       GATED: tl.constexpr, HAS_DB: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(0)  # a chunk's heads and N tiles run side by side: its rows are read once into L2
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    split = tl.program_id(2)
    first = split * SPLIT_ROWS
    end = tl.minimum(first + SPLIT_ROWS, M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DH
    acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    for m0 in range(first, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = offs_m.to(tl.int64)
        a = _head_rows(C, SLOTS, GATES, rows, mask_m, head, offs_d, mask_d, stride_cm, stride_cj, stride_cd,
                       stride_sm, stride_se, stride_gm, stride_gj, GATED)
        b = tl.load(B + rows[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    part = split.to(tl.int64) * stride_ws + head.to(tl.int64) * stride_we
    tl.store(DW + part + offs_d[:, None] * stride_wd + offs_n[None, :] * stride_wn,
             acc.to(DW.dtype.element_ty), mask=mask_d[:, None] & mask_n[None, :])
    if HAS_DB:
        if head == 0:  # B's column sums in a loop of their own, outside the pipelined dot loop
            db = tl.zeros([BLOCK_N], tl.float32)
            for m0 in range(first, end, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < end
                b = tl.load(B + offs_m.to(tl.int64)[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                            mask=mask_m[:, None] & mask_n[None, :], other=0.0)
                db += tl.sum(b.to(tl.float32), axis=0)
            tl.store(DB + split.to(tl.int64) * stride_ds + offs_n, db.to(DB.dtype.element_ty), mask=mask_n)


@device_function
def _sum_splits(P, OUT, NUMEL, SPLITS, block, BLOCK: tl.constexpr):
    """OUT[i] = Σ_s P[s, i] for the BLOCK elements of block ``block``, s in order (P [SPLITS, NUMEL] float32)."""
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(P + s * NUMEL + offs, mask=mask, other=0.0)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def _split_sum_kernel(P, OUT, P2, OUT2, NUMEL, NUMEL2, SPLITS, HAS_SECOND: tl.constexpr, BLOCK: tl.constexpr):
    """The chunks' partials summed in chunk order: OUT = Σ_s P[s] and, with HAS_SECOND, OUT2 = Σ_s P2[s] by the
    programs past OUT's blocks (contiguous tensors)."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(NUMEL, BLOCK)
    if pid < blocks:
        _sum_splits(P, OUT, NUMEL, SPLITS, pid, BLOCK)
    if HAS_SECOND:
        if pid >= blocks:
            _sum_splits(P2, OUT2, NUMEL2, SPLITS, pid - blocks, BLOCK)


SUM_BLOCK = 1024  # elements a program of `_split_sum_kernel` sums


@functools.cache
def _kernels() -> dict[str, object]:
    """The kernels, wrapped for the compiler or the interpreter (whichever mode Triton was imported in)."""
    return wrap_kernels(_head_select_kernel, _head_gather_kernel, _head_wgrad_kernel, _split_sum_kernel)


def _flags(dtype: torch.dtype) -> dict[str, object]:
    return {"UPCAST": bool(interpreter_enabled() and dtype == torch.bfloat16), "PRECISION": "ieee"}


def head_select_mm(a: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, top_k: int, gates: torch.Tensor | None,
                   aux: torch.Tensor | None, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches `_head_select_kernel` (arguments as ``squad::head_select_mm`` takes them, `squad.kernels.heads`)."""
    cfg, launch = launch_settings(config)
    m, k = a.shape
    e, _, d = w.shape
    out = torch.empty(m, top_k, d, dtype=a.dtype, device=a.device)
    gated = gates is not None
    gate_grad = torch.empty(m, top_k, dtype=torch.float32, device=a.device) if gated else \
        torch.empty(0, 0, dtype=torch.float32, device=a.device)
    if m == 0:
        return out, gate_grad
    dummy = slots
    _kernels()["_head_select_kernel"][(e, triton.cdiv(m, cfg["BLOCK_M"]))](
        a, w, slots, gates if gated else dummy, aux if gated else dummy, out, gate_grad if gated else dummy,
        m, k, d, *a.stride(), *w.stride(), *slots.stride(), *(gates.stride() if gated else (0, 0)),
        *(aux.stride() if gated else (0, 0, 0)), *out.stride(), *(gate_grad.stride() if gated else (0, 0)),
        GATED=gated, **_flags(a.dtype), **cfg, **launch)
    return out, gate_grad


def head_gather_mm(c: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor | None, w: torch.Tensor,
                   a2: torch.Tensor | None, w2: torch.Tensor | None, bias: torch.Tensor | None,
                   config: dict) -> torch.Tensor:
    """Launches `_head_gather_kernel` (arguments as ``squad::head_gather_mm`` takes them)."""
    cfg, launch = launch_settings(config)
    m = c.shape[0]
    e, d, n = w.shape
    out = torch.empty(m, n, dtype=c.dtype, device=c.device)
    if m == 0:
        return out
    dummy = slots
    k2 = a2.shape[1] if a2 is not None else 0
    cfg.setdefault("GROUP_M", 1)  # a hand-made config without a launch order: a row tile's N tiles in turn
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _kernels()["_head_gather_kernel"][grid](
        c, slots, dummy if gates is None else gates, w, dummy if a2 is None else a2, dummy if w2 is None else w2,
        dummy if bias is None else bias, out, m, n, e, d, k2,
        *c.stride(), *slots.stride(), *(gates.stride() if gates is not None else (0, 0)), *w.stride(),
        *(a2.stride() if a2 is not None else (0, 0)), *(w2.stride() if w2 is not None else (0, 0)), *out.stride(),
        GATED=gates is not None, HAS_A2=a2 is not None, HAS_BIAS=bias is not None, **_flags(c.dtype), **cfg,
        **launch)
    return out


def head_wgrad(c: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor | None, b: torch.Tensor, num_heads: int,
               transpose: bool, bias_grad: bool, dtype: torch.dtype,
               config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches `_head_wgrad_kernel` on ``config["splits"]`` row chunks (1 where absent), then `_split_sum_kernel`
    where there are several: (dW [E, d, N] — [E, N, d] with ``transpose`` — and db [N] or empty)."""
    cfg, launch = launch_settings(config)
    m, _, d = c.shape
    n = b.shape[1]
    chunk, splits = split_rows(m, cfg["BLOCK_M"], int(config.get("splits", 1)))
    shape = (num_heads, n, d) if transpose else (num_heads, d, n)
    dw = torch.empty(shape, dtype=dtype, device=c.device)
    db = torch.empty(n if bias_grad else 0, dtype=dtype, device=c.device)
    if splits > 1:  # float32 partials, one per chunk
        part = torch.empty(splits, *shape, dtype=torch.float32, device=c.device)
        db_part = torch.empty(splits, db.numel(), dtype=torch.float32, device=c.device)
    else:  # the one chunk writes the result
        part, db_part = dw.unsqueeze(0), db.unsqueeze(0)
    s = part.stride()
    strides = (s[0], s[1], s[3], s[2]) if transpose else s  # as (split, e, i, n)
    dummy = slots
    grid = (num_heads, triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _kernels()["_head_wgrad_kernel"][grid](
        c, slots, dummy if gates is None else gates, b, part, db_part if bias_grad else dummy, m, n, d, chunk,
        *c.stride(), *slots.stride(), *(gates.stride() if gates is not None else (0, 0)), *b.stride(), *strides,
        db_part.stride(0), GATED=gates is not None, HAS_DB=bool(bias_grad), **_flags(c.dtype), **cfg, **launch)
    if splits > 1:
        blocks = triton.cdiv(dw.numel(), SUM_BLOCK) + (triton.cdiv(db.numel(), SUM_BLOCK) if bias_grad else 0)
        _kernels()["_split_sum_kernel"][(blocks,)](
            part, dw, db_part, db, dw.numel(), db.numel(), splits, HAS_SECOND=bool(bias_grad), BLOCK=SUM_BLOCK,
            num_warps=4)
    return dw, db
