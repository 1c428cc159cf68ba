"""Benchmarks of routed attention for `tools/bench.py` (rows of `squad.timing.BenchResult`).

CPU (always):
- ``routed_attention_scores_vs_sdpa``: the reference path WITH routing scores against SDPA WITHOUT scores, forward,
  ViT-S shapes (B 8, H 6, N 197, d 64), timed interleaved; contract ≤ 1.3.
- ``routed_attention_scores_fwd_bwd_vs_sdpa``: the same, forward + backward (informational).
- ``routed_attention_peak_memory_n4096``: peak CPU allocation of the reference with scores at N = 4096 against the
  explicit softmax(QKᵀ)V that forms the N×N map, both measured with the PyTorch profiler's allocation events
  (bytes in the details); the value is their ratio.

GPU (only when CUDA is present): Triton against PyTorch's flash SDPA in bf16 at N ∈ {197, 1024, 4096}, forward and
forward + backward, with and without scores; TFLOP/s in the details (attention FLOPs 4·B·H·N²·d forward,
2.5× that backward, the score pass not counted as useful work).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.timing import BenchResult, check, ratio_row, time_interleaved

from .op import routed_attention
from .reference import explicit_attention

VIT_S = {"batch": 8, "heads": 6, "tokens": 197, "head_dim": 64}


def peak_cpu_bytes(fn) -> int:
    """Peak bytes allocated on the CPU by PyTorch while ``fn()`` runs, above what was allocated before.

    Uses the allocation/free events of `torch.profiler` (profile_memory=True): their running sum in time order is
    the live allocation, and its maximum the peak. Kineto may print a few lines on stderr.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and _is_cpu(e)]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _is_cpu(event) -> bool:
    return str(event.device_type()).endswith("CPU")


def _qkv(batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, tokens, head_dim, generator=gen).to(device=device, dtype=dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def bench_cpu_speed(quick: bool) -> list[BenchResult]:
    """Reference with scores vs SDPA without scores at ViT-S shapes: forward (contract) and forward + backward."""
    repeats = 10 if quick else 30
    shape = (VIT_S["batch"], VIT_S["heads"], VIT_S["tokens"], VIT_S["head_dim"])
    q, k, v = _qkv(*shape)
    with torch.inference_mode():
        t_scores, t_sdpa = time_interleaved([
            lambda: routed_attention(q, k, v, return_scores=True, backend="reference"),
            lambda: F.scaled_dot_product_attention(q, k, v),
        ], repeats=repeats, warmup=3)
    rows = [ratio_row("routed_attention_scores_vs_sdpa", t_scores, t_sdpa, "<= 1.3", shape=list(shape),
                      threads=torch.get_num_threads())]

    qg, kg, vg = _qkv(*shape, requires_grad=True)
    grad = torch.randn(shape)

    def with_scores():
        out, _ = routed_attention(qg, kg, vg, return_scores=True, backend="reference")
        out.backward(grad)

    def sdpa():
        F.scaled_dot_product_attention(qg, kg, vg).backward(grad)

    t_scores, t_sdpa = time_interleaved([with_scores, sdpa], repeats=max(5, repeats // 2), warmup=2)
    rows.append(ratio_row("routed_attention_scores_fwd_bwd_vs_sdpa", t_scores, t_sdpa, "", shape=list(shape)))
    return rows


def bench_cpu_memory(quick: bool) -> list[BenchResult]:
    """Peak allocation at N = 4096: reference with scores vs the explicit N×N computation (forward)."""
    batch, heads, tokens, head_dim = 1, (1 if quick else VIT_S["heads"]), 4096, VIT_S["head_dim"]
    q, k, v = _qkv(batch, heads, tokens, head_dim)
    with torch.inference_mode():
        peak_ref = peak_cpu_bytes(lambda: routed_attention(q, k, v, return_scores=True, backend="reference"))
        peak_explicit = peak_cpu_bytes(lambda: explicit_attention(q, k, v))
    map_bytes = batch * heads * tokens * tokens * 4
    value = peak_ref / peak_explicit
    return [BenchResult("routed_attention_peak_memory_n4096", value, "<= 0.1", "x memory", check(value, "<= 0.1"),
                        {"reference_with_scores_bytes": peak_ref, "explicit_nxn_bytes": peak_explicit,
                         "one_nxn_map_bytes": map_bytes, "shape": [batch, heads, tokens, head_dim]})]


def _tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def _bench_gpu_tokens(tokens: int, repeats: int) -> list[BenchResult]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads, head_dim = 8, 12, 64
    q, k, v = _qkv(batch, heads, tokens, head_dim, torch.bfloat16, "cuda", requires_grad=True)
    grad = torch.randn_like(q)

    def sdpa(backward: bool) -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v)
        if backward:
            out.backward(grad)

    def triton_op(backward: bool, scores: bool) -> None:
        res = routed_attention(q, k, v, return_scores=scores, backend="triton")
        out = res[0] if scores else res
        if backward:
            out.backward(grad)

    rows = []
    fwd_flops = 4.0 * batch * heads * tokens * tokens * head_dim
    for backward in (False, True):
        fns = [lambda: sdpa(backward), lambda: triton_op(backward, False), lambda: triton_op(backward, True)]  # noqa: B023
        with torch.set_grad_enabled(backward):
            t_sdpa, t_plain, t_scores = time_interleaved(fns, repeats=repeats, warmup=3)
        flops = fwd_flops * (3.5 if backward else 1.0)
        kind = "fwd_bwd" if backward else "fwd"
        details = {"shape": [batch, heads, tokens, head_dim], "dtype": "bfloat16",
                   "sdpa_tflops": _tflops(flops, t_sdpa), "triton_tflops": _tflops(flops, t_plain),
                   "triton_with_scores_tflops": _tflops(flops, t_scores)}
        rows.append(ratio_row(f"triton_attention_{kind}_n{tokens}_vs_sdpa", t_plain, t_sdpa, "", **details))
        rows.append(ratio_row(f"triton_attention_scores_{kind}_n{tokens}_vs_sdpa", t_scores, t_sdpa,
                              "" if backward else "<= 1.15", **details))
    return rows


def bench_gpu(quick: bool) -> list[BenchResult]:
    """Triton vs flash SDPA on CUDA (bf16, B 8, H 12, d 64): forward and forward + backward, with and without
    scores, at N = 197, 1024, 4096."""
    repeats = 10 if quick else 30
    return [row for tokens in (197, 1024, 4096) for row in _bench_gpu_tokens(tokens, repeats)]


def bench_routed_attention(quick: bool) -> list[BenchResult]:
    """All routed-attention rows: CPU speed and memory, and GPU throughput when CUDA is present.

    Args:
        quick: fewer repeats and a smaller memory case (for CI).
    """
    rows = bench_cpu_speed(quick) + bench_cpu_memory(quick)
    if torch.cuda.is_available():
        rows += bench_gpu(quick)
    return rows
