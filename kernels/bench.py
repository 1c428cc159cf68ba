"""Benchmarks of routed attention for `tools/bench.py` (rows of `squad.timing.BenchResult`).

CPU (``device="cpu"``):
- ``routed_attention_scores_vs_sdpa``: the reference path WITH routing scores against SDPA WITHOUT scores, forward,
  ViT-S shapes (B 8, H 6, N 197, d 64), timed interleaved; contract ≤ 1.3.
- ``routed_attention_scores_fwd_bwd_vs_sdpa``: the same, forward + backward (informational).
- ``routed_attention_peak_memory_n4096``: peak CPU allocation of the reference with scores at N = 4096 against the
  explicit softmax(QKᵀ)V that forms the N×N map, both measured with the PyTorch profiler's allocation events
  (bytes in the details); the value is their ratio.

GPU (``device="cuda"``, the default when CUDA is present; `bench_device`): bf16, B 8, H 12, d 64, at N = 197, 1024
and 4096, every candidate timed interleaved with `F.scaled_dot_product_attention` (PyTorch's pick of flash / cuDNN /
efficient) by CUDA events, medians; the GPU's name in every row's details:
- ``attention_fwd_bwd_n{N}_vs_sdpa``: `routed_attention` without scores (what every dense layer runs); contract
  ≤ 1.02 at N = 197 (it dispatches to SDPA: the ratio is the op's own overhead).
- ``attention_scores_fwd_n{N}_vs_sdpa``: with the A-MoD scores, forward, against SDPA without; contract ≤ 1.3 at
  N = 197, ≤ 1.15 at N ≥ 1024. ``attention_scores_fwd_bwd_n{N}_vs_sdpa``: the same with the backward.
- ``triton_attention_fwd[_bwd]_n{N}_vs_sdpa``: the Triton kernel without scores over all tokens (the kernel that
  routed token subsets run).
- ``attention_subset_fwd_bwd_n{N}_vs_gather_sdpa``: half the tokens selected by index: the Triton kernel reading
  them in place against gathering them and running SDPA (the reference backend).
TFLOP/s in the details count attention FLOPs 4·B·H·N²·d forward and 2.5× that backward (the scores not counted).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

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


def time_events(fns: list[Callable[[], object]], repeats: int, warmup: int) -> list[float]:
    """Median seconds of each callable, run interleaved (A, B, A, B, ...).

    On a GPU each run is bracketed by CUDA events recorded on the current stream, without a synchronisation between
    runs (the host queues the next while the GPU works, as in training); one synchronisation at the end. Elsewhere
    each run is timed by the host clock.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    if not torch.cuda.is_available():
        return time_interleaved(fns, repeats=repeats, warmup=0)
    torch.cuda.synchronize()
    marks = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
             for _ in fns]
    for r in range(repeats):
        for fn, pairs in zip(fns, marks, strict=True):
            pairs[r][0].record()
            fn()
            pairs[r][1].record()
    torch.cuda.synchronize()
    return [statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3 for pairs in marks]


def device_name(device: torch.device) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _device_rows(device: torch.device, tokens: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype,
                 repeats: int) -> list[BenchResult]:
    q, k, v = _qkv(batch, heads, tokens, head_dim, dtype, device, requires_grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    half = torch.stack([torch.randperm(tokens, generator=torch.Generator().manual_seed(2 + b))[:tokens // 2]
                        for b in range(batch)]).to(device)
    triton = device.type == "cuda"  # the explicit Triton rows need a GPU (the interpreter is not timed)

    def call(fn, backward: bool) -> Callable[[], None]:
        def run() -> None:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            if backward:
                torch.autograd.grad(out, (q, k, v), grad[:, :, :out.shape[2]])  # no .grad accumulation

        return run

    candidates = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "auto": lambda: routed_attention(q, k, v),
        "scores": lambda: routed_attention(q, k, v, return_scores=True),
        "subset": lambda: routed_attention(q, k, v, token_index=half, backend="triton" if triton else "auto"),
        "gather_sdpa": lambda: routed_attention(q, k, v, token_index=half, backend="reference"),
    }
    if triton:
        candidates["triton"] = lambda: routed_attention(q, k, v, backend="triton")
    names = list(candidates)
    fwd_flops = 4.0 * batch * heads * tokens * tokens * head_dim
    details = {"shape": [batch, heads, tokens, head_dim], "dtype": str(dtype).removeprefix("torch."),
               "device": device_name(device), "timing": "CUDA events" if device.type == "cuda" else "host clock",
               "repeats": repeats}
    rows = []
    for backward in (False, True):
        with torch.set_grad_enabled(backward):
            times = dict(zip(names, time_events([call(candidates[n], backward) for n in names], repeats, 3),
                             strict=True))
        kind = "fwd_bwd" if backward else "fwd"
        flops = fwd_flops * (3.5 if backward else 1.0)
        tflops = {f"{n}_tflops": _tflops(flops, t) for n, t in times.items() if n not in ("subset", "gather_sdpa")}

        def row(case: str, candidate: str, target: str = "", baseline: str = "sdpa", times=times, tflops=tflops):
            return ratio_row(case, times[candidate], times[baseline], target, **details, **tflops)

        if backward:
            rows.append(row(f"attention_fwd_bwd_n{tokens}_vs_sdpa", "auto", "<= 1.02" if tokens == 197 else ""))
        rows.append(row(f"attention_scores_{kind}_n{tokens}_vs_sdpa", "scores",
                        "" if backward else ("<= 1.3" if tokens <= 197 else "<= 1.15")))
        if triton:
            rows.append(row(f"triton_attention_{kind}_n{tokens}_vs_sdpa", "triton"))
        if backward:
            rows.append(row(f"attention_subset_fwd_bwd_n{tokens}_vs_gather_sdpa", "subset", baseline="gather_sdpa"))
    return rows


def bench_device(device: str | torch.device, quick: bool, tokens: tuple[int, ...] = (197, 1024, 4096),
                 batch: int = 8, heads: int = 12, head_dim: int = 64, dtype: torch.dtype = torch.bfloat16
                 ) -> list[BenchResult]:
    """The accelerator rows (module docstring) at each sequence length; the defaults are the GPU contract's shapes.

    Args:
        device: where to run ("cuda" for the contract; "cpu" runs the same rows, host-timed, without the explicit
            Triton ones — a dry run for the tests).
        quick: fewer repeats.
        tokens, batch, heads, head_dim, dtype: the shapes.
    """
    device = torch.device(device)
    repeats = 10 if quick else 30
    return [row for n in tokens for row in _device_rows(device, n, batch, heads, head_dim, dtype, repeats)]


def bench_routed_attention(quick: bool = False, device: str | None = None) -> list[BenchResult]:
    """All routed-attention rows for one device: the CPU rows (speed and memory) or the GPU rows.

    Args:
        quick: fewer repeats and a smaller memory case (for CI).
        device: "cpu" or "cuda"; default "cuda" when CUDA is present, else "cpu".
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cpu":
        return bench_cpu_speed(quick) + bench_cpu_memory(quick)
    return bench_device(device, quick)
