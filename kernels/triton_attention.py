"""Triton kernels for routed attention: a forward that also yields the A-MoD scores, and a flash backward.

Layouts: q [B, Hq, N, d], k/v [B, Hkv, N, d] with any strides; query head h reads key/value head h // (Hq / Hkv).
With a token index [B, K] every kernel reads row ``index[b, i]`` where it would read row ``i`` (no gathered copies);
results are compact: out [B, Hq, M, d], lse [B, Hq, M], with M = K (or N without an index).

Grids are (row block, head, batch): CUDA caps the second and third grid axes at 65535, which B·H on one axis could
exceed; heads and batch rows apart stay far below it.

Forward: one program per (query block, head, batch), one launch; three compile-time paths (`forward_config`):

- one tile, when every attended row fits one key tile (M ≤ 256 at d ≤ 64 in fp16/bf16: every ViT at 224 px): the
  [BLOCK_M, M] scores, their exact softmax, P V and, with scores asked, P's column sums — each probability is
  computed once, so the scores cost one row reduction per tile and nothing else.
- two phases, for longer rows with scores asked: phase 1 walks the key blocks for each row's log-sum-exp (QKᵀ and
  exp2 only, no V, no output); phase 2 walks them again forming the final probabilities exp2(S - LSE) once, which
  feed both P V (no running rescale) and the column sums. This is A-MoD's App. A.8 done row-major.
- online softmax, for longer rows without scores (routed token subsets): the usual flash forward.

Why two phases and not one pass with atomically rescaled column sums: a probability's final value is
exp(S_ij - m_i) · exp(m_i - LSE_i), and the second factor is a different unknown for every ROW i until the row's
last key block. Row-wise accumulators (the output) can be rescaled by a per-row factor as the max grows; a column sum
adds many rows, each needing its own factor, so no single rescale fixes it — it would need the whole [BLOCK_M, M]
probability block kept until the row's LSE is known (A-MoD's A_temp), which fits on chip only for short rows: the
one-tile path. Past one tile the probabilities must be formed twice or written out (B·H·N² values, slower than
recomputing them), so phase 1 recomputes QKᵀ and exp2: by the FLOP and exp2 count about half a forward more at long
N (unmeasured: no GPU was at hand; `tools/bench.py` on a GPU gives the ratios), against a column reduction per tile
on the one-tile path. Column sums, already divided by Hq·M, go to a [B, Hq, row blocks, M] buffer summed in PyTorch
(one launch after the forward): no atomics, the same sum in the same order every run (the scores choose tokens by
top-k; a last-bit wobble could change the choice between runs), and no zeroed buffer an atomic sum would need (a
launch too). Its size is M²/BLOCK_M per head — 1/64 of one N×N map; nothing N×N exists.

What this costs against SDPA without scores (the traffic profile's H100 model, `tools/bench.py --only traffic`):
on the one-tile path the forward itself matches flash's rate and the scores cost the one summing launch (N = 197:
~1.3×, a launch against a ~20 µs kernel). Past one tile the ratio is FLOP-bound at ~1.5× and no exact method with
O(N) memory does better: every probability exp(S_ij - LSE_i) needs S_ij after LSE_i is known, and LSE_i needs
every S_ij of row i, so S = QKᵀ is formed twice (6·N²·d FLOPs against flash's 4·N²·d) unless the N×N scores are
kept (written out: B·H·N² values, slower than recomputing them, and the O(N) memory contract forbids it). The
design contract's ≤ 1.15 at N ≥ 1024 is therefore out of reach for exact scores.

Backward: delta = rowsum(dO ∘ O) in PyTorch, then one kernel per (key block, kv head[·split], batch) accumulating
dK, dV over the group's query heads and all query blocks (split partial sums added in PyTorch), and one per (query
block, head, batch) accumulating dQ — again no atomics. The scores have no gradient.

The softmax scale arrives as a scalar argument; every kernel casts it to fp32 first, since a float64 scalar (what
torch.compile passes for a Python float) would make the loop-carried row max fp64 and the kernel fail to compile.

Scores are kept in the log2 domain inside the kernels (exp2 with scale·log2 e). fp16/bf16 operands go to `tl.dot`
with fp32 accumulation; fp32 operands use IEEE precision (no TF32). Triton's CPU interpreter computes bf16 wrongly,
so there bf16 tiles are upcast to fp32 after loading.

The kernel bodies are plain functions wrapped at first use by `_kernels()`, for the compiler or for the interpreter,
following the mode Triton itself was imported in (see `interpreter_enabled`). Their shared prologue lives in device
helpers they call (`_program_tile`: program ids → head, batch row, feature and row offsets and masks; `_block_rows`:
a block's positions, mask and token-index gather; `_load_tile`: a masked, optionally upcast q/k/v/dO tile), wrapped
the same way at import (`triton_common.device_function`); the compiler inlines them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .triton_common import device_function, interpreter_enabled, wrap_kernels

LOG2E = 1.4426950408889634


@device_function
def _block_rows(IDX, b, stride_ib, stride_ik, start, M,
                BLOCK: tl.constexpr, HAS_INDEX: tl.constexpr):
    """Positions ``start .. start + BLOCK`` of the M attended rows of batch row b.

    Returns (offs, mask, rows): the positions, which of them are < M, and the rows of q/k/v they read (the token
    index ``IDX[b, offs]`` with an index, the positions themselves without; int64).
    """
    offs = start + tl.arange(0, BLOCK)
    mask = offs < M
    if HAS_INDEX:
        rows = tl.load(IDX + b * stride_ib + offs * stride_ik, mask=mask, other=0)
    else:
        rows = offs.to(tl.int64)
    return offs, mask, rows


@device_function
def _load_tile(base, rows, mask_rows, stride_n, offs_d, mask_d, stride_d, UPCAST: tl.constexpr):
    """The [BLOCK, BLOCK_D] tile ``base[rows, offs_d]`` (zeros outside the masks), upcast to fp32 when UPCAST."""
    tile = tl.load(base + rows[:, None] * stride_n + offs_d[None, :] * stride_d,
                   mask=mask_rows[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@device_function
def _program_tile(IDX, stride_ib, stride_ik, M, D,
                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_INDEX: tl.constexpr):
    """The prologue of every kernel: grid (row block, head, batch row) → where this program works.

    Returns (head, b, offs_d, mask_d, offs, mask, rows): the grid's axis-1 id and batch row (int64, for pointer
    arithmetic), the feature offsets and their mask (< D), and `_block_rows` of the program's row block.
    """
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs, mask, rows = _block_rows(IDX, b, stride_ib, stride_ik, pid * BLOCK, M, BLOCK, HAS_INDEX)
    return head, b, offs_d, mask_d, offs, mask, rows


def _fwd_kernel(Q, K, V, IDX, OUT, LSE, PART,
                stride_qb, stride_qh, stride_qn, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_ib, stride_ik,
                M, D, HQ, GROUP, qk_scale,
                HAS_INDEX: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                SCORES: tl.constexpr, ONE_TILE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # a float64 scale (what torch.compile makes of a Python float) would turn every score and the loop-carried row
    # max into fp64: the kernel works in fp32 whatever it is given
    qk_scale = tl.cast(qk_scale, tl.float32)
    h, b, offs_d, mask_d, offs_m, mask_m, rows_m = _program_tile(IDX, stride_ib, stride_ik, M, D,
                                                                 BLOCK_M, BLOCK_D, HAS_INDEX)
    bh = b * HQ + h
    hk = h // GROUP
    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows_m, mask_m, stride_qn, offs_d, mask_d, stride_qd, UPCAST)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    part = PART + (bh * tl.num_programs(0) + tl.program_id(0)) * M  # this row block's column sums [M]
    col_scale = 1.0 / (HQ * M * 1.0)  # a column sum's share of the mean over heads and query rows
    if ONE_TILE:
        # every key in one tile (BLOCK_N >= M): the exact softmax in one pass, probabilities normalised once
        offs_n, mask_n, rows_n = _block_rows(IDX, b, stride_ib, stride_ik, 0, M, BLOCK_N, HAS_INDEX)
        k = _load_tile(k_base, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
        v = _load_tile(v_base, rows_n, mask_n, stride_vn, offs_d, mask_d, stride_vd, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_i = tl.max(s, 1)
        p = tl.exp2(s - m_i[:, None])
        l_i = tl.sum(p, 1)
        p = p * tl.where(mask_m, 1.0 / l_i, 0.0)[:, None]  # rows past M weigh nothing in the column sums
        acc = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if SCORES:
            tl.store(part + offs_n, tl.sum(p, 0) * col_scale, mask=mask_n)
        lse2 = m_i + tl.log2(l_i)
    elif SCORES:
        # phase 1: each row's log-sum-exp over the key blocks (no V, no output)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start_n in range(0, M, BLOCK_N):
            offs_n, mask_n, rows_n = _block_rows(IDX, b, stride_ib, stride_ik, start_n, M, BLOCK_N, HAS_INDEX)
            k = _load_tile(k_base, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        lse2 = m_i + tl.log2(l_i)
        row_lse2 = tl.where(mask_m, lse2, float("inf"))  # rows past M: probabilities exactly 0
        # phase 2: the final probabilities, once each: the output and this row block's column sums
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, M, BLOCK_N):
            offs_n, mask_n, rows_n = _block_rows(IDX, b, stride_ib, stride_ik, start_n, M, BLOCK_N, HAS_INDEX)
            k = _load_tile(k_base, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
            v = _load_tile(v_base, rows_n, mask_n, stride_vn, offs_d, mask_d, stride_vd, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            p = tl.where(mask_n[None, :], tl.exp2(s - row_lse2[:, None]), 0.0)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            tl.store(part + offs_n, tl.sum(p, 0) * col_scale, mask=mask_n)
    else:
        # online softmax (no scores): running max and sum, the output rescaled as the max grows
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start_n in range(0, M, BLOCK_N):
            offs_n, mask_n, rows_n = _block_rows(IDX, b, stride_ib, stride_ik, start_n, M, BLOCK_N, HAS_INDEX)
            k = _load_tile(k_base, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
            v = _load_tile(v_base, rows_n, mask_n, stride_vn, offs_d, mask_d, stride_vd, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        lse2 = m_i + tl.log2(l_i)
    o_ptrs = OUT + bh * M * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + bh * M + offs_m, lse2 * 0.6931471805599453, mask=mask_m)


def _bwd_dkdv_kernel(Q, K, V, DO, IDX, LSE, DELTA, DK, DV,
                     stride_qb, stride_qh, stride_qn, stride_qd,
                     stride_kb, stride_kh, stride_kn, stride_kd,
                     stride_vb, stride_vh, stride_vn, stride_vd,
                     stride_ib, stride_ik,
                     M, D, HQ, HKV, GROUP, SPLITS, qk_scale, sm_scale,
                     HAS_INDEX: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (key block, kv head·SPLITS + split, b): the split's GROUP / SPLITS query heads
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp32 whatever the caller passes (see _fwd_kernel)
    sm_scale = tl.cast(sm_scale, tl.float32)
    pid_h, b, offs_d, mask_d, offs_n, mask_n, rows_n = _program_tile(IDX, stride_ib, stride_ik, M, D,
                                                                     BLOCK_N, BLOCK_D, HAS_INDEX)
    pid = b * HKV * SPLITS + pid_h  # index of this program's (B, Hkv, SPLITS) output slab
    split = pid_h % SPLITS
    hk = pid_h // SPLITS
    heads = GROUP // SPLITS
    k = _load_tile(K + b * stride_kb + hk * stride_kh, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
    v = _load_tile(V + b * stride_vb + hk * stride_vh, rows_n, mask_n, stride_vn, offs_d, mask_d, stride_vd, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, heads):
        h = hk * GROUP + split * heads + g
        bh = b * HQ + h
        q_base = Q + b * stride_qb + h * stride_qh
        for start_m in range(0, M, BLOCK_M):
            offs_m, mask_m, rows_m = _block_rows(IDX, b, stride_ib, stride_ik, start_m, M, BLOCK_M, HAS_INDEX)
            q = _load_tile(q_base, rows_m, mask_m, stride_qn, offs_d, mask_d, stride_qd, UPCAST)
            do = _load_tile(DO + bh * M * D, offs_m, mask_m, D, offs_d, mask_d, 1, UPCAST)  # compact [M, d] rows
            lse2 = tl.load(LSE + bh * M + offs_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh * M + offs_m, mask=mask_m, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
            p = tl.exp2(s - lse2[:, None])
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out_offs = pid * M * D + offs_n[:, None] * D + offs_d[None, :]  # (B, Hkv, SPLITS, M, d)
    mask_nd = mask_n[:, None] & mask_d[None, :]
    tl.store(DK + out_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty), mask=mask_nd)


def _bwd_dq_kernel(Q, K, V, DO, IDX, LSE, DELTA, DQ,
                   stride_qb, stride_qh, stride_qn, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_ib, stride_ik,
                   M, D, HQ, GROUP, qk_scale, sm_scale,
                   HAS_INDEX: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # fp32 whatever the caller passes (see _fwd_kernel)
    sm_scale = tl.cast(sm_scale, tl.float32)
    h, b, offs_d, mask_d, offs_m, mask_m, rows_m = _program_tile(IDX, stride_ib, stride_ik, M, D,
                                                                 BLOCK_M, BLOCK_D, HAS_INDEX)
    bh = b * HQ + h
    hk = h // GROUP
    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows_m, mask_m, stride_qn, offs_d, mask_d, stride_qd, UPCAST)
    do = _load_tile(DO + bh * M * D, offs_m, mask_m, D, offs_d, mask_d, 1, UPCAST)  # compact [M, d] rows
    lse2 = tl.load(LSE + bh * M + offs_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + bh * M + offs_m, mask=mask_m, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, M, BLOCK_N):
        offs_n, mask_n, rows_n = _block_rows(IDX, b, stride_ib, stride_ik, start_n, M, BLOCK_N, HAS_INDEX)
        k = _load_tile(k_base, rows_n, mask_n, stride_kn, offs_d, mask_d, stride_kd, UPCAST)
        v = _load_tile(v_base, rows_n, mask_n, stride_vn, offs_d, mask_d, stride_vd, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.where(mask_n[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + bh * M * D + offs_m[:, None] * D + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


@functools.cache
def _kernels() -> dict[str, object]:
    """The kernels, wrapped for the compiler or the interpreter (whichever mode Triton was imported in)."""
    return wrap_kernels(_fwd_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel)


def _config(d: int, dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Block sizes (powers of two >= 16) and flags shared by the kernels of one call.

    64×64 tiles; wide rows (fp32 with d > 64) take 32×32 tiles and a single pipeline stage so that every kernel fits
    the 99 KiB of shared memory of sm_86/sm_89 blocks (checked by compiling for sm_80 in the tests). Head dims up to
    128 (`squad.kernels.op.MAX_TRITON_HEAD_DIM`).
    """
    del device  # one configuration for every GPU: no autotuning (the interpreter cannot autotune either)
    block_d = max(16, triton.next_power_of_2(d))
    itemsize = 4 if dtype == torch.float32 else 2
    wide = block_d * itemsize > 256
    return {
        "BLOCK_M": 32 if wide else 64,
        "BLOCK_N": 32 if wide else 64,
        "BLOCK_D": block_d,
        # the interpreter's bf16 arithmetic is wrong: compute on fp32 tiles there
        "UPCAST": bool(interpreter_enabled() and dtype == torch.bfloat16),
        # IEEE fp32 (no TF32), matching torch.matmul's default; fp16/bf16 operands ignore it
        "PRECISION": "ieee",
        "num_warps": 4 if block_d <= 64 else 8,
        "num_stages": 1 if wide else 2,
    }


# Bytes of one K tile plus one V tile that the one-tile forward may hold: 64 KiB leaves room for the query tile
# within the 99 KiB of shared memory of an sm_86/sm_89 block.
ONE_TILE_KV_BYTES = 64 * 1024
MAX_ONE_TILE_KEYS = 256  # its score tile [64, 256] in fp32 is 64 registers a thread at 8 warps


def one_tile_keys(d: int, dtype: torch.dtype) -> int:
    """The most attended rows the forward takes as one key tile (the one-pass path) for head dim d and dtype."""
    block_d = max(16, triton.next_power_of_2(d))
    itemsize = 4 if dtype == torch.float32 else 2
    return min(MAX_ONE_TILE_KEYS, ONE_TILE_KV_BYTES // (2 * block_d * itemsize))


def forward_config(m: int, d: int, dtype: torch.dtype, scores: bool, max_one_tile: int | None = None
                   ) -> dict[str, object]:
    """The forward kernel's configuration for M attended rows (see the module docstring for the three paths).

    Args:
        m: attended rows (N, or K with a token index).
        d: head dim.
        dtype: q/k/v dtype.
        scores: whether the column sums are wanted.
        max_one_tile: the most rows taken as one key tile (default `one_tile_keys`; the tests lower it to run the
            two-phase path on small shapes).
    """
    cfg = _config(d, dtype, torch.device("cuda"))
    limit = one_tile_keys(d, dtype) if max_one_tile is None else max_one_tile
    one_tile = triton.next_power_of_2(m) <= limit
    if one_tile:
        cfg["BLOCK_N"] = max(16, triton.next_power_of_2(m))
        cfg["num_warps"] = 8 if cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 64 * 128 else 4
        cfg["num_stages"] = 1  # no key loop to pipeline
    return {**cfg, "SCORES": scores, "ONE_TILE": one_tile}


def _device_of(x: torch.Tensor):
    """Makes x's GPU the current one while launching (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _index_args(token_index: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if token_index is None:
        return q, 0, 0  # never read: HAS_INDEX is False
    return token_index, token_index.stride(0), token_index.stride(1)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      token_index: torch.Tensor | None = None, scores: bool = False, max_one_tile: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Runs the forward kernel, with the A-MoD scores from the same launch when asked.

    Args:
        q: [B, Hq, N, d]; k, v: [B, Hkv, N, d] (any strides).
        scale: score scale.
        token_index: optional [B, K] int64 rows to attend among.
        scores: also return the routing scores (column means of the probabilities over heads and query rows).
        max_one_tile: see `forward_config`.

    Returns:
        out [B, Hq, M, d] (q's dtype, contiguous), lse [B, Hq, M] float32 (natural log), and scores [B, M] float32
        (None without ``scores``); M = K or N.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    m = n if token_index is None else token_index.shape[1]
    out = torch.empty(b, hq, m, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, m, dtype=torch.float32, device=q.device)
    cfg = forward_config(m, d, q.dtype, scores, max_one_tile)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), hq, b)
    # per (row block, head) column sums, added up below: no atomics, the same sum in the same order every run
    part = torch.empty(b, hq, grid[0], m, dtype=torch.float32, device=q.device) if scores else lse
    idx, sib, sik = _index_args(token_index, q)
    with _device_of(q):
        _kernels()["_fwd_kernel"][grid](
            q, k, v, idx, out, lse, part, *q.stride(), *k.stride(), *v.stride(), sib, sik,
            m, d, hq, hq // hkv, scale * LOG2E, HAS_INDEX=token_index is not None, **cfg)
    if not scores:
        return out, lse, None
    return out, lse, part.sum(dim=(1, 2))  # the partial sums are scaled by 1 / (Hq·M) in the kernel


def _head_splits(blocks: int, b: int, hkv: int, group: int, device: torch.device) -> int:
    """How many programs share a key block's query heads in the dK/dV kernel: the fewest that give every GPU
    multiprocessor two programs (multi-query attention at ViT lengths has few key blocks); partial sums are added in
    PyTorch (deterministic)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    for splits in range(1, group + 1):
        if group % splits == 0 and blocks * b * hkv * splits >= target:
            return splits
    return group


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float, token_index: torch.Tensor | None = None,
                       head_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the backward kernels.

    Args:
        grad_out, out: [B, Hq, M, d]; q: [B, Hq, N, d]; k, v: [B, Hkv, N, d]; lse: [B, Hq, M] float32.
        scale: score scale used in the forward.
        token_index: optional [B, K] int64 (the same as in the forward).
        head_splits: programs per key block and kv head in the dK/dV kernel (a divisor of Hq / Hkv); default
            chosen from the GPU's size.

    Returns:
        (dq, dk, dv) shaped like q, k, v; with an index, rows that were not selected get zeros (duplicate indices
        add up).
    """
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    m = lse.shape[-1]
    cfg = _config(d, q.dtype, q.device)
    splits = head_splits or _head_splits(triton.cdiv(m, cfg["BLOCK_N"]), b, hkv, group, q.device)
    if group % splits != 0:
        raise ValueError(f"head_splits ({splits}) must divide the query heads per kv head ({group})")
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(dim=-1)  # (B, Hq, M)
    dq = torch.empty(b, hq, m, d, dtype=q.dtype, device=q.device)
    part_dtype = k.dtype if splits == 1 else torch.float32
    dk = torch.empty(b, hkv, splits, m, d, dtype=part_dtype, device=k.device)
    dv = torch.empty(b, hkv, splits, m, d, dtype=part_dtype, device=v.device)
    idx, sib, sik = _index_args(token_index, q)
    strides = (*q.stride(), *k.stride(), *v.stride(), sib, sik)
    flags = {"HAS_INDEX": token_index is not None, **cfg}
    kernels = _kernels()
    with _device_of(q):
        kernels["_bwd_dkdv_kernel"][(triton.cdiv(m, cfg["BLOCK_N"]), hkv * splits, b)](
            q, k, v, grad_out, idx, lse, delta, dk, dv, *strides, m, d, hq, hkv, group, splits, scale * LOG2E, scale,
            **flags)
        kernels["_bwd_dq_kernel"][(triton.cdiv(m, cfg["BLOCK_M"]), hq, b)](
            q, k, v, grad_out, idx, lse, delta, dq, *strides, m, d, hq, group, scale * LOG2E, scale, **flags)
    dk = dk.sum(dim=2).to(k.dtype) if splits > 1 else dk.view(b, hkv, m, d)  # (B, Hkv, M, d)
    dv = dv.sum(dim=2).to(v.dtype) if splits > 1 else dv.view(b, hkv, m, d)
    if token_index is None:
        return dq, dk, dv
    return tuple(_scatter_rows(g, token_index, x.shape[2]) for g, x in ((dq, q), (dk, k), (dv, v)))


def _scatter_rows(grad: torch.Tensor, token_index: torch.Tensor, n: int) -> torch.Tensor:
    """Adds compact row gradients [B, H, K, d] into zeros [B, H, N, d] at the indexed rows."""
    b, h, k, d = grad.shape
    full = torch.zeros(b, h, n, d, dtype=grad.dtype, device=grad.device)
    return full.scatter_add_(2, token_index[:, None, :, None].expand(b, h, k, d), grad)
