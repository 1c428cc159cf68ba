"""``make gpu-check``'s ``kernels`` stage: every backend of each routed op timed on this GPU at the shapes the
shipped configs build, the faster one recorded in the kernel choice file (`squad.kernels.choice`) that runs read
when a config says ``auto``.

- MoE MLP (``model.moe.kernel``): one expert layer (`squad.layers.moe_mlp.ExpertMLP`) forward + backward in bf16 on
  ``images × tasks × tokens`` routed tokens (the bench's modsquad_vit_b shape: 12 × 13 × 197), top-k of random
  scores, each backend (``grouped_mm``, ``triton``) on the same routing;
- MoE attention (``model.moa.kernel``): one layer (`squad.layers.moe_attention.MoEAttention`) forward + backward
  in bf16 on the same shape, each backend (``cublas``, ``heads``, ``routed``) on the same routing;
- MoNE (``model.mone.kernel``): the config's model in bf16, inference on a batch of images, with every MoNE block on
  ``cublas`` and then on ``triton``.

Times are CUDA-event medians after warm-up (the first calls compile Triton kernels). Only `measure` needs a GPU;
`moe_shapes`, `moa_shapes` and `mone_configs` read the configs anywhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
IMAGES, TASKS = 12, 13  # the bench's GPU shape: 12 images × 13 tasks
MONE_IMAGES = 64


def _model_configs() -> list[Path]:
    return sorted(p for p in (REPO / "configs" / "model").glob("*.yaml") if not p.name.startswith("_"))


def moe_shapes() -> dict[tuple[int, int, int, int], list[str]]:
    """(E, D, H, k) of every shipped config's MoE MLP → the configs that build it."""
    import squad

    shapes: dict[tuple[int, int, int, int], list[str]] = {}
    for path in _model_configs():
        cfg = squad.load_config(path).model
        if any(block.mlp == "moe" for block in cfg.blocks()):
            key = (cfg.moe.num_experts, cfg.embed_dim, cfg.moe_hidden(), cfg.moe.top_k)
            shapes.setdefault(key, []).append(path.stem)
    return shapes


def moa_shapes() -> dict[tuple[int, int, int, int], list[str]]:
    """(E, D, d, k) of every shipped config's MoE attention → the configs that build it."""
    import squad

    shapes: dict[tuple[int, int, int, int], list[str]] = {}
    for path in _model_configs():
        cfg = squad.load_config(path).model
        if any(block.attn == "moa" for block in cfg.blocks()):
            key = (cfg.moa.num_experts, cfg.embed_dim, cfg.moa.head_dim, cfg.moa.top_k)
            shapes.setdefault(key, []).append(path.stem)
    return shapes


def mone_configs() -> list[str]:
    """The shipped configs with MoNE blocks."""
    import squad

    return [p.stem for p in _model_configs()
            if any(block.mone for block in squad.load_config(p).model.blocks())]


def time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _moe_times(e: int, d: int, h: int, k: int, tokens: int) -> dict[str, float]:
    from squad.layers.moe_mlp import ExpertMLP

    torch.manual_seed(0)
    layer = ExpertMLP(e, d, h).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(tokens, e, device="cuda")
    gates, experts = scores.topk(k, dim=1)
    gates = gates.to(torch.bfloat16).requires_grad_()
    grad = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    out = {}
    for backend in ("grouped_mm", "triton"):
        layer.kernel = backend

        def step():
            x.grad = gates.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x, gates, experts, noop=False).backward(grad)

        out[backend] = time_ms(step)
    return out


def _moa_times(e: int, d: int, dh: int, k: int, images: int, tasks: int, device: str = "cuda",
               timer: Callable[[Callable[[], object]], float] = time_ms) -> dict[str, float]:
    """Milliseconds of one MoE attention layer's forward + backward per backend, on one routing decision
    (``device`` and ``timer`` let a CPU test run the same code under `force_cuda_path`)."""
    import dataclasses

    from squad.config.model import MoAConfig, RouterConfig
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.routing import Routing

    from .cases import _segment_context

    torch.manual_seed(0)
    cfg = MoAConfig(num_experts=e, top_k=k, head_dim=dh, router=RouterConfig(noise=False))
    layer = MoEAttention(d, cfg, tasks).to(device, torch.bfloat16)
    x = torch.randn(images * tasks, 197, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    ctx = _segment_context(images, tasks, device)
    with torch.no_grad():
        decided = layer.router(x, ctx())  # one routing for every backend (bf16 logits could flip near ties)
    gates = decided.gates.detach().requires_grad_()
    layer.router.forward = lambda *a: Routing(gates, decided.experts, decided.probs)
    grad = torch.randn_like(x)
    out = {}
    for backend in ("cublas", "heads", "routed"):
        layer.cfg = dataclasses.replace(cfg, kernel=backend)

        def step():
            x.grad = gates.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x, ctx()).backward(grad)

        out[backend] = timer(step)
    return out


def _mone_times(name: str) -> dict[str, float]:
    import squad
    from squad.layers.mone import MoNEBlock

    cfg = squad.load_config(REPO / "configs" / "model" / f"{name}.yaml").model
    torch.manual_seed(0)
    model = squad.build_model(cfg).eval().to("cuda", torch.bfloat16)
    x = torch.randn(MONE_IMAGES, 3, cfg.img_size, cfg.img_size, device="cuda", dtype=torch.bfloat16)
    tasks = model.task_names[:1]
    blocks = [m for m in model.modules() if isinstance(m, MoNEBlock)]
    out = {}
    for backend in ("cublas", "triton"):
        for block in blocks:
            block.cfg.kernel = backend  # the blocks share the model's MoNE config

        @torch.no_grad()
        def forward():
            model(x, tasks)

        out[backend] = time_ms(forward)
    return out


def _row(op: str, dims: dict[str, int], configs: list[str], times: Callable[[], dict[str, float]], gpu: str,
         path: Path | None, **extra) -> dict:
    """One shape's row: ``times()`` (milliseconds per backend) and the winner recorded in the choice file, or the
    error that stopped it (one shape failing leaves the others measured)."""
    from squad.kernels import choice

    row = {"op": op, "dims": dims, "configs": configs, **extra}
    try:
        row["ms"] = times()
        row["choice"] = choice.record(op, dims, torch.bfloat16, gpu, row["ms"], path)
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"
    torch.cuda.empty_cache()
    return row


def measure(path: Path | None = None) -> list[dict]:
    """Times every backend at every shipped shape on this GPU and records each winner in the choice file
    (``path``, default `squad.kernels.choice.choices_path`). Returns one row per shape: op, dims, the configs, the
    milliseconds of each backend, the choice (or the error that stopped the row)."""
    import squad

    gpu = torch.cuda.get_device_name(0)
    tokens = IMAGES * TASKS * 197
    rows = [_row("moe_mlp", {"E": e, "D": d, "H": h, "k": k}, configs,
                 lambda e=e, d=d, h=h, k=k: _moe_times(e, d, h, k, tokens), gpu, path, tokens=tokens)
            for (e, d, h, k), configs in moe_shapes().items()]
    rows += [_row("moa", {"E": e, "D": d, "d": dh, "k": k}, configs,
                  lambda e=e, d=d, dh=dh, k=k: _moa_times(e, d, dh, k, IMAGES, TASKS), gpu, path, tokens=tokens)
             for (e, d, dh, k), configs in moa_shapes().items()]
    for name in mone_configs():
        cfg = squad.load_config(REPO / "configs" / "model" / f"{name}.yaml").model
        dims = {"D": cfg.embed_dim, "H": int(cfg.embed_dim * cfg.mlp_ratio), "heads": cfg.num_heads}
        rows.append(_row("mone", dims, [name], lambda name=name: _mone_times(name), gpu, path, images=MONE_IMAGES))
    return rows
