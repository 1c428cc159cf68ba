"""Why a compiled training step is slower than the eager one: the bench's step (`squad.bench.step.TrainStep`),
eager and compiled side by side on one GPU, with what dynamo made of it and where the device time went.

For each mode the probe reports the step time (median of a few steps, CUDA events), the peak memory, the device time
per kind of kernel (attention by backend, cuBLAS/CUTLASS GEMMs, squad's Triton kernels, inductor's generated
kernels, ATen's elementwise/copy/index kernels) and the longest kernels; for the compiled mode also dynamo's graphs,
graph breaks and recompilations. A compiled step that lost time shows it as a kind that grew (e.g. attention leaving
flash for the math backend's GEMMs and softmax) or as graphs beyond one.

Run it on a GPU (about a minute at the default depth of 2 blocks, one of each kind in the plan; the paper widths
otherwise)::

    python -m squad.bench.compile_probe                       # modsquad_vit_b, 12 images, bf16
    python -m squad.bench.compile_probe --depth 12 --config mtl_vit_b

On a CPU it runs the forced CUDA path (`squad.kernels.device.force_cuda_path`) at the tests' widths, which checks the
probe itself (``--quick``: the tiny widths, the ``aot_eager`` backend, no code generation).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import time

import torch
from torch._dynamo.utils import counters

from squad.bench.step import CPU_WIDTH, GPU_IMAGES, QUICK_WIDTH, StepSetup, TrainStep, load_step_config
from squad.kernels.device import force_cuda_path

# kinds of device kernel, first match wins: (kind, substrings of the kernel's name)
KERNEL_KINDS = (
    ("attention: flash", ("flash_fwd", "flash_bwd", "flash::", "pytorch_flash")),
    ("attention: cuDNN", ("cudnn", "sdpa")),
    ("attention: mem-efficient", ("fmha", "efficient_attention", "attention_kernel")),
    ("softmax (ATen)", ("softmax",)),
    ("inductor Triton kernels", ("triton_",)),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "cublas")),
    ("index / scatter / gather (ATen)", ("index", "scatter", "gather", "sort", "radix", "topk")),
    ("elementwise / copy / reduce (ATen)", ("elementwise", "copy", "reduce", "vectorized", "fill")),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel by its name: inductor's and squad's Triton kernels, then `KERNEL_KINDS`
    ("other" when none matches)."""
    low = name.lower()
    if low.startswith("triton_"):  # inductor's generated kernels (names start triton_poi/red/per/tem_...)
        return "inductor Triton kernels"
    if re.fullmatch(r"_\w+_kernel", name):  # squad's own (kernels/triton_*.py: _grouped_mm_kernel, ...)
        return "squad Triton kernels"
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


@dataclasses.dataclass
class ModeReport:
    """One mode's step: median ms, peak GiB, device ms per kernel kind and per kernel (one profiled step)."""

    mode: str
    step_ms: float
    peak_gib: float | None
    kinds_ms: dict[str, float]
    top_kernels: list[tuple[str, float, int]]  # (name, ms, calls)
    dynamo: dict[str, int] = dataclasses.field(default_factory=dict)


def dynamo_summary() -> dict[str, int]:
    """dynamo's counters since the last reset: frames compiled, graphs, graph breaks, recompilations."""
    return {"frames": counters["frames"].get("ok", 0), "graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(counters["recompiles"].values())}


def _device_times(prof: torch.profiler.profile, cuda: bool) -> list[tuple[str, float, int]]:
    """(kernel name, total ms, calls) of one profiled step: device kernels on a GPU, CPU ops elsewhere."""
    out = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            out.append((e.key, us / 1e3, e.count))
    return sorted(out, key=lambda r: -r[1])


def probe_mode(setup: StepSetup, backend: str | None, steps: int = 5) -> ModeReport:
    """Builds the bench's step for ``setup`` (compiled with ``backend`` when ``setup.compiled``), warms it up
    (compiles), times ``steps`` steps and profiles one."""
    cuda = setup.device.type == "cuda"
    torch._dynamo.reset()
    counters.clear()
    step = TrainStep(dataclasses.replace(setup, compiled=False))
    if setup.compiled:
        step.forward = torch.compile(step.model, backend=backend or "inductor")
    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync()
    kernels = _device_times(prof, cuda)
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, ms, _ in kernels:
        kinds[kernel_kind(name)] += ms
    return ModeReport("compiled" if setup.compiled else "eager", sorted(times)[len(times) // 2] * 1e3, peak,
                      dict(kinds), kernels[:15], dynamo_summary() if setup.compiled else {})


def _median_ms(fn, steps: int, cuda: bool) -> float:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def _kinds(fn, cuda: bool) -> dict[str, float]:
    """Device ms per kernel kind of one call of ``fn``."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, ms, _ in _device_times(prof, cuda):
        kinds[kernel_kind(name)] += ms
    return {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def probe_parts(setup: StepSetup, backend: str, steps: int = 5) -> list[dict]:
    """Forward + backward of the step's parts alone, eager against compiled, at the step's shapes: each distinct
    block of the model's plan (on its R = images × tasks task rows) and the attention call of an MoE-attention
    layer (multi-query SDPA, ``enable_gqa``). Which part loses time under compile, and (kernel kinds) to what."""
    from squad.layers.attention import attend
    from squad.layers.context import ForwardContext
    from squad.layers.moe_attention import MoEAttention

    cuda = setup.device.type == "cuda"
    torch.manual_seed(0)
    model = TrainStep(setup).model
    cfg = model.cfg
    t, n, d = len(model.task_names), cfg.num_tokens, cfg.embed_dim
    rows = setup.images * t
    task_ids = torch.arange(t, device=setup.device).repeat_interleave(setup.images)
    segments = [(i, i * setup.images, (i + 1) * setup.images) for i in range(t)]
    x = torch.randn(rows, n, d, device=setup.device, dtype=setup.dtype, requires_grad=True)
    parts = {}
    for i, block in enumerate(model.blocks[: len(cfg.plan)]):
        def run(x, block=block):
            return block(x, ForwardContext(task_ids=task_ids, num_tasks=t, segments=segments))
        parts[f"block {i} ({cfg.plan[i].attn} attention, {cfg.plan[i].mlp} MLP)"] = run
    moa = next((m for m in model.modules() if isinstance(m, MoEAttention)), None)
    if moa is not None:
        q = torch.randn(rows, moa.top_k, n, moa.head_dim, device=setup.device, dtype=setup.dtype, requires_grad=True)
        kv = torch.randn(2, rows, 1, n, moa.head_dim, device=setup.device, dtype=setup.dtype, requires_grad=True)
        parts[f"MoE-attention SDPA (q {moa.top_k} heads, k/v 1 head, d {moa.head_dim})"] = (
            lambda x, q=q, kv=kv: attend(q, kv[0], kv[1])[0])
    out = []
    for name, fn in parts.items():
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend=backend)
        row = {"part": name}
        for mode, f in (("eager", fn), ("compiled", compiled)):
            def step(f=f):
                y = f(x)
                y.float().square().mean().backward()
            row[f"{mode}_ms"] = _median_ms(step, steps, cuda)
            row[f"{mode}_kinds"] = _kinds(step, cuda)
        row["dynamo"] = dynamo_summary()
        out.append(row)
    return out


def format_parts(parts: list[dict]) -> str:
    lines = ["", "parts alone, forward + backward (ms):"]
    for p in parts:
        lines.append(f"  {p['part']:70s} eager {p['eager_ms']:8.2f}  compiled {p['compiled_ms']:8.2f}  "
                     f"(x{p['compiled_ms'] / p['eager_ms']:.2f})  dynamo {p['dynamo']}")
        for mode in ("eager", "compiled"):
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(p[f"{mode}_kinds"].items())[:6])
            lines.append(f"      {mode:9s} {top}")
    return "\n".join(lines)


def format_reports(reports: list[ModeReport], title: str) -> str:
    """The reports as text: step time and memory, device ms per kind side by side, the longest kernels per mode."""
    lines = [title, ""]
    for r in reports:
        mem = "—" if r.peak_gib is None else f"{r.peak_gib:.2f} GiB"
        extra = "" if not r.dynamo else "  dynamo: " + ", ".join(f"{k} {v}" for k, v in r.dynamo.items())
        lines.append(f"{r.mode:9s} step {r.step_ms:9.2f} ms  peak {mem}{extra}")
    kinds = sorted({k for r in reports for k in r.kinds_ms}, key=lambda k: -max(r.kinds_ms.get(k, 0) for r in reports))
    lines += ["", f"{'device ms per kernel kind (one step)':40s}" + "".join(f"{r.mode:>12s}" for r in reports)]
    for k in kinds:
        lines.append(f"{k:40s}" + "".join(f"{r.kinds_ms.get(k, 0.0):12.2f}" for r in reports))
    lines.append(f"{'total':40s}" + "".join(f"{sum(r.kinds_ms.values()):12.2f}" for r in reports))
    for r in reports:
        lines += ["", f"longest kernels, {r.mode}:"]
        lines += [f"  {ms:9.2f} ms {calls:5d}x  {name[:110]}" for name, ms, calls in r.top_kernels]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="modsquad_vit_b", help="a shipped model config (configs/model/NAME.yaml)")
    p.add_argument("--depth", type=int, default=2, help="blocks: 2 holds one of each of the plan's kinds "
                   "(the paper's 12 compile for longer)")
    p.add_argument("--images", type=int, default=None, help=f"images per step (default {GPU_IMAGES}; 2 on a CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--quick", action="store_true", help="CPU: the tiny widths and the aot_eager backend")
    p.add_argument("--no-parts", action="store_true", help="leave out the parts alone (blocks, MoE-attention SDPA)")
    p.add_argument("--json", default=None, help="also write the reports here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    width = [] if cuda else (QUICK_WIDTH if args.quick else CPU_WIDTH)
    model_cfg, loss_cfg = load_step_config(args.config, [*width, f"model.depth={args.depth}"])
    images = args.images or (GPU_IMAGES if cuda else 2)
    backend = "aot_eager" if args.quick and not cuda else args.backend
    setup = StepSetup(model_cfg, loss_cfg, images, device, torch.bfloat16)
    with force_cuda_path(not cuda):
        parts = [] if args.no_parts else probe_parts(setup, backend, args.steps)
        reports = [probe_mode(setup, None, args.steps),
                   probe_mode(dataclasses.replace(setup, compiled=True), backend, args.steps)]
    name = torch.cuda.get_device_name() if cuda else "cpu (forced CUDA path)"
    title = (f"{args.config}, depth {args.depth}, {images} images, bf16, AdamW, on {name}; torch {torch.__version__}, "
             f"backend {backend}")
    print(format_reports(reports, title) + (format_parts(parts) if parts else ""))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "reports": [dataclasses.asdict(r) for r in reports], "parts": parts}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
