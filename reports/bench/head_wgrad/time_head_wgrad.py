"""Times MoE attention's head weight gradient on a CUDA GPU: the kernel as it was at c2d6ce1 (one program per
(head, N tile), each looping over every row: 144 programs; the bias sum inside the dot loop) against the split
launch of `squad.kernels.triton_heads.head_wgrad` at 1, 2, 4, 8, 16 and 32 row chunks (`tiles.head_wgrad_config`
picks 8 here), at modsquad_vit_b's MoE attention (12 images × 13 tasks × 197 tokens = 30,732 rows, 24 heads, top-12,
d 64, D 768, bf16). Each variant runs both launches of a training step (W_q's transposed gradient; W_o's gated one
with the bias's), timed by CUDA events (median of 30 interleaved rounds), and is checked against the float32
reference. Run from the checkout root:

    python reports/bench/head_wgrad/time_head_wgrad.py        # prints a table; writes $OUT/head_wgrad.json if set

(``ROWS=300 REPEATS=1 TRITON_INTERPRET=1`` runs it on the CPU in Triton's interpreter: a check of the script.)
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from squad.kernels import heads as HK
from squad.kernels import tiles
from squad.kernels import triton_heads as T
from squad.kernels.triton_common import wrap_kernels
from squad.kernels.triton_heads import _head_rows  # noqa: F401  (the old kernel calls it)
from squad.layers.experts.heads import head_slots

M, E, K, D, DIM = int(os.environ.get("ROWS", 12 * 13 * 197)), 24, 12, 64, 768
REPEATS = int(os.environ.get("REPEATS", 30))


def _old_head_wgrad_kernel(C, SLOTS, GATES, B, DW, DB, M, N, DH,
                           stride_cm, stride_cj, stride_cd, stride_sm, stride_se, stride_gm, stride_gj,
                           stride_bm, stride_bn, stride_we, stride_wd, stride_wn,
                           GATED: tl.constexpr, HAS_DB: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """`_head_wgrad_kernel` at c2d6ce1, verbatim."""
    head = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < DH
    acc = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, M, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)
        a = _head_rows(C, SLOTS, GATES, rows, mask_m, head, offs_d, mask_d, stride_cm, stride_cj, stride_cd,
                       stride_sm, stride_se, stride_gm, stride_gj, GATED)
        b = tl.load(B + rows[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                    mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        if HAS_DB:
            if head == 0:
                db += tl.sum(b.to(tl.float32), axis=0)
    tl.store(DW + head.to(tl.int64) * stride_we + offs_d[:, None] * stride_wd + offs_n[None, :] * stride_wn,
             acc.to(DW.dtype.element_ty), mask=mask_d[:, None] & mask_n[None, :])
    if HAS_DB:
        if head == 0:
            tl.store(DB + offs_n, db.to(DB.dtype.element_ty), mask=mask_n)


OLD = wrap_kernels(_old_head_wgrad_kernel)["_old_head_wgrad_kernel"]


def old_head_wgrad(c, slots, gates, b, num_heads, transpose, bias_grad, dtype):
    cfg, launch = tiles.launch_settings(tiles.head_wgrad_config(c.shape[0], num_heads, b.shape[1], c.shape[2],
                                                                c.dtype))
    m, _, d = c.shape
    n = b.shape[1]
    dw = torch.empty((num_heads, n, d) if transpose else (num_heads, d, n), dtype=dtype, device=c.device)
    strides = (dw.stride(0), dw.stride(2), dw.stride(1)) if transpose else dw.stride()
    db = torch.empty(n if bias_grad else 0, dtype=dtype, device=c.device)
    OLD[(num_heads, triton.cdiv(n, cfg["BLOCK_N"]))](
        c, slots, slots if gates is None else gates, b, dw, db if bias_grad else slots, m, n, d,
        *c.stride(), *slots.stride(), *(gates.stride() if gates is not None else (0, 0)), *b.stride(), *strides,
        GATED=gates is not None, HAS_DB=bool(bias_grad), **T._flags(c.dtype), **cfg, **launch)
    return dw, db


def main() -> None:
    dev, bf16 = ("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    experts = torch.rand(M, E, generator=g, device=dev).argsort(1)[:, :K]
    slots = head_slots(experts, E)
    dq, o = (torch.randn(M, K, D, generator=g, device=dev).to(bf16) for _ in range(2))
    x, dy = (torch.randn(M, DIM, generator=g, device=dev).to(bf16) for _ in range(2))
    gates = torch.rand(M, K, generator=g, device=dev)
    calls = [(dq, None, x, True, False), (o, gates, dy, False, True)]  # W_q's gradient; W_o's with the bias's
    refs = [HK.head_wgrad_reference(c, slots, gt, b, tr, bg, torch.float32) for c, gt, b, tr, bg in calls]
    base = tiles.head_wgrad_config(M, E, DIM, D, bf16)
    tiles_n = -(-DIM // base["BLOCK_N"])
    variants = {"old (c2d6ce1)": (lambda c, gt, b, tr, bg: old_head_wgrad(c, slots, gt, b, E, tr, bg, bf16), 1)}
    for s in (1, 2, 4, 8, 16, 32):
        cfg = {**base, "splits": s}
        chunks = tiles.split_rows(M, base["BLOCK_M"], s)[1]
        label = f"split {chunks}" + (" (config)" if s == base["splits"] else "")
        variants[label] = (lambda c, gt, b, tr, bg, cfg=cfg: T.head_wgrad(c, slots, gt, b, E, tr, bg, bf16, cfg),
                           chunks)
    rows = {}
    for label, (fn, chunks) in variants.items():  # correctness first (and compile)
        err = 0.0
        for (c, gt, b, tr, bg), ref in zip(calls, refs, strict=True):
            got = fn(c, gt, b, tr, bg)
            for x_, y_ in zip(got, ref, strict=True):
                err = max(err, ((x_.float() - y_).norm() / y_.norm().clamp_min(1e-30)).item())
        rows[label] = {"programs": E * tiles_n * chunks, "rel_err": err, "ms": []}
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    for _ in range(REPEATS):  # interleaved rounds
        for label, (fn, _) in variants.items():
            if dev == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for c, gt, b, tr, bg in calls:
                fn(c, gt, b, tr, bg)
            if dev == "cuda":
                end.record()
                sync()
                rows[label]["ms"].append(start.elapsed_time(end))
            else:
                rows[label]["ms"].append((time.perf_counter() - t0) * 1e3)
    old = statistics.median(rows["old (c2d6ce1)"]["ms"])
    flops = 2 * 2.0 * M * E * D * DIM
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton's interpreter)"
    print(f"{name}: head_wgrad, both launches of a step, {M} rows, E {E}, d {D}, D {DIM}, bf16")
    print(f"{'variant':20s} {'programs':>8s} {'ms':>8s} {'vs old':>7s} {'TFLOP/s':>8s} {'rel err':>9s}")
    for label, r in rows.items():
        r["median_ms"] = statistics.median(r["ms"])
        print(f"{label:20s} {r['programs']:8d} {r['median_ms']:8.3f} {old / r['median_ms']:6.2f}x "
              f"{flops / r['median_ms'] / 1e9:8.1f} {r['rel_err']:9.2e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "head_wgrad.json"), "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
