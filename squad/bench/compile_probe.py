"""Why a compiled training step is slower than the eager one: the bench's step (`squad.bench.step.TrainStep`),
eager and compiled side by side on one GPU, with what dynamo made of it and where the device time went.

For each mode the probe reports the step time (median of a few steps, CUDA events), the peak memory, the device time
per kind of kernel (attention by backend, cuBLAS/CUTLASS GEMMs, squad's Triton kernels, inductor's generated
kernels, ATen's elementwise/copy/index kernels) and the longest kernels; for the compiled mode also dynamo's graphs,
graph breaks and recompilations. A compiled step that lost time shows it as a kind that grew (e.g. attention leaving
flash for the math backend's GEMMs and softmax) or as graphs beyond one.

Run it on a GPU (about a minute at the default depth of 4 blocks; the paper widths otherwise)::

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
import time

import torch
from torch._dynamo.utils import counters

from squad.bench.step import CPU_WIDTH, QUICK_WIDTH, GPU_IMAGES, StepSetup, TrainStep, load_step_config
from squad.kernels.device import force_cuda_path

# kinds of device kernel, first match wins: (kind, substrings of the kernel's name)
KERNEL_KINDS = (
    ("attention: flash", ("flash_fwd", "flash_bwd", "flash::", "pytorch_flash")),
    ("attention: cuDNN", ("cudnn", "sdpa")),
    ("attention: mem-efficient", ("fmha", "efficient_attention", "attention_kernel")),
    ("softmax (ATen)", ("softmax",)),
    ("squad Triton kernels", ("_kernel",)),
    ("inductor Triton kernels", ("triton_",)),
    ("GEMM (cuBLAS / CUTLASS)", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "cublas")),
    ("index / scatter / gather (ATen)", ("index", "scatter", "gather", "sort", "radix", "topk")),
    ("elementwise / copy / reduce (ATen)", ("elementwise", "copy", "reduce", "vectorized", "fill")),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel by its name (`KERNEL_KINDS`; "other" when none matches)."""
    low = name.lower()
    if low.startswith("triton_"):  # inductor's generated kernels (names start triton_poi/red/per/tem_...)
        return "inductor Triton kernels"
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
    p.add_argument("--depth", type=int, default=4, help="blocks (the paper's 12 compile for longer)")
    p.add_argument("--images", type=int, default=None, help=f"images per step (default {GPU_IMAGES}; 2 on a CPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--quick", action="store_true", help="CPU: the tiny widths and the aot_eager backend")
    p.add_argument("--json", default=None, help="also write the reports here")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    width = [] if cuda else (QUICK_WIDTH if args.quick else CPU_WIDTH)
    model_cfg, loss_cfg = load_step_config(args.config, [*width, f"model.depth={args.depth}"])
    images = args.images or (GPU_IMAGES if cuda else 2)
    backend = "aot_eager" if args.quick and not cuda else args.backend
    setup = StepSetup(model_cfg, loss_cfg, images, device, torch.bfloat16)
    with force_cuda_path(not cuda):
        reports = [probe_mode(setup, None, args.steps),
                   probe_mode(dataclasses.replace(setup, compiled=True), backend, args.steps)]
    name = torch.cuda.get_device_name() if cuda else "cpu (forced CUDA path)"
    title = (f"{args.config}, depth {args.depth}, {images} images, bf16, AdamW, on {name}; torch {torch.__version__}, "
             f"backend {backend}")
    print(format_reports(reports, title))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "reports": [dataclasses.asdict(r) for r in reports]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
