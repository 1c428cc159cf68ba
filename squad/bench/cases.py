"""The performance cases of `tools/bench.py` (DESIGN.md "Performance contract") and the registry that lists them.

Each case is a function ``case(quick: bool) -> list[BenchResult]`` that builds what it measures, times candidate
and baseline interleaved in this process (`squad.timing.time_interleaved`) and returns rows whose value is a
ratio of medians. `CASES` names every case by ``"module:function"``; a case's module is imported only when the case
runs, so a missing or broken module becomes an error row (`run_case`) instead of hiding the other cases. To add a
case, write the function anywhere under ``squad`` and append a `Case` to `CASES`.

Model cases here (ViT-S widths, D = 384, CPU float32):

- ``moe_mlp``: MoE MLP forward + backward (16 experts, top-4, expert width 4D/k) against the dense MLP with the same
  active FLOPs, on 8 × 197 tokens; DeepSpeed's ``deepspeed.moe.layer.MoE`` (k = 4) on the same input as an
  informational row.
- ``moa``: MoE attention forward + backward (15 heads, top-6, head width 64) against multi-query attention with the
  same active FLOPs (6 query heads over one shared K/V head, SDPA).
- ``fused_step``: a 13-task training step of a small Mod-Squad model, one fused backbone pass against one pass per
  task (the authors' design), at 4, 8 and 16 images per step.
- ``mod``: Mixture-of-Depths ViT-S (12.5 %, every other block) forward against the dense ViT-S.
- ``mone``: MoNE ViT-S at e_c = 0.3 forward against the dense ViT-S.

On a GPU (``tools/bench.py --device cuda``, the default where CUDA is present) the cases that take a ``device``
argument measure their GPU rows instead (bf16, CUDA events, medians, ``*_gpu`` rows naming the GPU): ``moe_mlp`` and
``moa`` at modsquad_vit_b's widths (12 images × 13 tasks × 197 tokens, task-major rows as the model lays them out)
against their dense / multi-query twins of equal active FLOPs, ``mod`` and ``mone`` at 224 px on 256 images. The
other cases run as on the CPU.

`profile_table` prints parameters and MACs of every paper config (built on the meta device, nothing allocated).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import squad
from squad import runtime
from squad.config.model import MoAConfig, MoEConfig, RouterConfig
from squad.distributed import has_process_group
from squad.layers.context import ForwardContext
from squad.layers.mlp import Mlp
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp
from squad.timing import BenchResult, ratio_row, time_interleaved

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
VIT_S_DIM = 384


# ------------------------------------------------------------------------------------------------------- registry
@dataclasses.dataclass(frozen=True)
class Case:
    """A named benchmark case.

    Attributes:
        name: what ``tools/bench.py --only`` selects.
        ref: ``"package.module:function"``; the function takes ``quick`` and returns ``list[BenchResult]``.
        help: one line for ``--help`` / ``--list``.
    """

    name: str
    ref: str
    help: str = ""

    def load(self) -> Callable[..., list[BenchResult]]:
        """Imports the case's function (ImportError / AttributeError when it is missing)."""
        module, _, func = self.ref.partition(":")
        return getattr(importlib.import_module(module), func)


CASES: list[Case] = [
    Case("moe_mlp", "squad.bench.cases:bench_moe_mlp",
         "MoE MLP fwd+bwd / dense MLP of equal active FLOPs (+ DeepSpeed MoE)"),
    Case("moa", "squad.bench.cases:bench_moa", "MoE attention fwd+bwd / multi-query attention of equal active FLOPs"),
    Case("fused_step", "squad.bench.cases:bench_fused_step", "13-task step: one fused pass vs one pass per task"),
    Case("train_step", "squad.bench.step:bench_train_step",
         "13-task AdamW step of modsquad_vit_b / mtl_vit_b: img/s, MFU, peak memory; eager/compiled, checkpointing"),
    Case("mod", "squad.bench.cases:bench_mod", "MoD ViT-S (12.5 %, every other block) forward vs dense ViT-S"),
    Case("mone", "squad.bench.cases:bench_mone", "MoNE ViT-S at e_c = 0.3 forward vs dense ViT-S"),
    Case("routed_attention", "squad.kernels.bench:bench_routed_attention", "routed attention with scores vs SDPA"),
    Case("traffic", "squad.bench.traffic_profile:bench_traffic",
         "routed layers' kernels, syncs, atomics, FLOPs, bytes vs dense twins (CPU, exact) + modelled H100 time"),
    Case("data", "squad.bench.data:bench_data",
         "loader samples/s per core at 224 px, 13 domains, augmented: shards, PNG tree; by stage; cores per GPU"),
    Case("engine", "squad.bench.engine:bench_engine",
         "training engine step and whole run / bare fwd+bwd+AdamW step (small STL run, 1 thread, CPU time)"),
    Case("extraction", "squad.bench.extract:bench_extraction",
         "extracted depth (θ=0.01) params / full, forward vs full"),
]


def case_names() -> list[str]:
    return [c.name for c in CASES]


def get_case(name: str) -> Case:
    """The registered case called ``name`` (ValueError listing the known ones otherwise)."""
    for case in CASES:
        if case.name == name:
            return case
    raise ValueError(f"unknown bench case {name!r}; known: {', '.join(case_names())}")


def error_row(case: str, message: str) -> BenchResult:
    """A row standing for a case (or part of one) that could not run."""
    return BenchResult(case, math.nan, "", "error", False, {"error": message})


def run_case(case: Case, quick: bool = False, device: str = "cpu", options: dict | None = None) -> list[BenchResult]:
    """Runs one case; any failure (missing module, exception, no rows) becomes one error row.

    ``device`` reaches the cases that take a ``device`` argument (their GPU rows on ``"cuda"``), and each of
    ``options`` (e.g. ``step_rate``, ``tools/bench.py --step-rate``) the cases that take it when it is not None; the
    others run as they always do.
    """
    try:
        fn = case.load()
    except (ImportError, AttributeError) as e:
        return [error_row(case.name, f"cannot import {case.ref}: {type(e).__name__}: {e}")]
    kwargs: dict = {"quick": quick}
    try:
        params = inspect.signature(fn).parameters
        kwargs.update({k: v for k, v in {"device": device, **(options or {})}.items()
                       if k in params and v is not None})
    except (TypeError, ValueError):  # no signature to read: call it the plain way
        pass
    try:
        rows = list(fn(**kwargs))
    except Exception as e:  # noqa: BLE001 - a broken case must not hide the others
        log.exception("bench case %s failed", case.name)
        return [error_row(case.name, f"{type(e).__name__}: {e}")]
    if not rows:
        return [error_row(case.name, f"{case.ref} returned no rows")]
    return rows


def run_cases(names: Sequence[str] | None = None, quick: bool = False,
              on_rows: Callable[[Case, list[BenchResult]], None] | None = None,
              device: str = "cpu", options: dict | None = None) -> list[BenchResult]:
    """Runs the named cases (all when None) in registry order; ``on_rows`` sees each case's rows as they come."""
    cases = CASES if not names else [get_case(n) for n in names]
    out: list[BenchResult] = []
    for case in cases:
        log.info("bench case %s", case.name)
        rows = run_case(case, quick, device, options)
        if on_rows is not None:
            on_rows(case, rows)
        out.extend(rows)
    return out


def gpu_present() -> bool:
    """Whether torch sees a CUDA GPU (`tools/bench.py --device` defaults to cuda then)."""
    return torch.cuda.is_available()


def device_name(device: str | torch.device) -> str:
    """``"cpu"``, or the GPU's name (``torch.cuda.get_device_name``) for a CUDA device."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def format_table(rows: Sequence[BenchResult], device: str | None = None) -> str:
    """The rows as a fixed-width text table: case, value, target, unit, ok (under a ``device:`` line naming the
    GPU when ``device`` is given)."""
    def ok_text(r: BenchResult) -> str:
        if r.unit == "error":
            return "ERROR"
        return "" if r.ok is None else ("yes" if r.ok else "NO")

    cells = [("case", "value", "target", "unit", "ok")]
    for r in rows:
        value = "-" if math.isnan(r.value) else f"{r.value:.3f}"
        cells.append((r.case, value, r.target, r.unit, ok_text(r)))
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(c[i].ljust(widths[i]) if i != 1 else c[i].rjust(widths[i]) for i in range(5)).rstrip()
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r.unit == "error":
            lines.append(f"{r.case}: {r.details.get('error', '')}")
    if device is not None:
        lines.insert(0, f"device: {device}")
    return "\n".join(lines)


def result_dict(row: BenchResult) -> dict:
    """A row as JSON-safe data (NaN → None)."""
    d = dataclasses.asdict(row)
    d["value"] = None if math.isnan(row.value) else row.value
    return d


def environment() -> dict:
    """What the figures depend on: torch version, threads, OpenMP wait policy, allocator tuning, CPU load."""
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(libgomp default)"),
           "malloc_tuned": runtime.malloc_tuned(),
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        env["load_average"] = list(os.getloadavg())
    except OSError:
        env["load_average"] = None
    return env


# ------------------------------------------------------------------------------------------------------- helpers
def _repeats(quick: bool, full: int) -> dict:
    return {"repeats": 3, "warmup": 1} if quick else {"repeats": full, "warmup": 2}


def _config(name: str, overrides: Sequence[str] = ()):
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} not found (the bench reads the repository's configs/model/)")

    return squad.load_config(path, list(overrides)).model


def _build(name: str, overrides: Sequence[str] = ()):
    torch.manual_seed(0)
    return squad.build_model(_config(name, overrides))


def _fwd_bwd(fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A callable running forward + backward of ``fn`` (gradients cleared every call)."""
    def step() -> None:
        for p in params:
            p.grad = None
        fn().sum().backward()

    return step


def _router_config():
    # random (not zero) router weights: zero-initialised routers send every token to the same first k experts
    return RouterConfig(noise=False, zero_init=False)


def _task_context(rows: int, num_tasks: int):
    ids = torch.arange(rows) % num_tasks
    return lambda: ForwardContext(task_ids=ids, num_tasks=num_tasks)


def _on_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _segment_context(rows_per_task: int, num_tasks: int, device: str | torch.device):
    """Contexts for task-major rows (``rows_per_task`` rows of each task in turn), as the model's forward lays
    them out: the per-task routers run as one grouped matmul."""
    ids = torch.arange(num_tasks, device=device).repeat_interleave(rows_per_task)
    segments = [(t, t * rows_per_task, (t + 1) * rows_per_task) for t in range(num_tasks)]
    return lambda: ForwardContext(task_ids=ids, num_tasks=num_tasks, segments=segments)


def _gpu_block_inputs(quick: bool, device: str | torch.device, overrides: Sequence[str] = ()):
    """modsquad_vit_b's widths (``overrides``: other widths, for the tests): the config, 12 images (2 with --quick) ×
    its 13 tasks × 197 tokens of width 768 (bf16, requiring gradients), and the task-major contexts."""
    cfg = _config("modsquad_vit_b", overrides)
    tasks, images = len(cfg.head_configs()), (2 if quick else 12)
    x = torch.randn(images * tasks, cfg.num_tokens, cfg.embed_dim, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    shape = {"images": images, "tasks": tasks, "tokens": images * tasks * cfg.num_tokens, "dim": cfg.embed_dim,
             "dtype": "bfloat16", "gpu": device_name(device)}
    return cfg, x, _segment_context(images, tasks, device), shape


# ---------------------------------------------------------------------------------------------------------- MoE MLP
def _deepspeed_moe(dim: int, hidden: int, num_experts: int, k: int) -> nn.Module:
    """DeepSpeed's MoE layer with the same experts, in this process (CPU accelerator, gloo, world size 1)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    if not has_process_group():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_RANK": "0"}.items():
            os.environ.setdefault(key, value)
        dist.init_process_group("gloo", rank=0, world_size=1)
    from deepspeed.moe.layer import MoE

    expert = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
    return MoE(hidden_size=dim, expert=expert, num_experts=num_experts, ep_size=1, k=k, capacity_factor=1.25)


def bench_moe_mlp(quick: bool = False, device: str = "cpu", compiled: str | None = None) -> list[BenchResult]:
    """MoE MLP fwd+bwd against the dense MLP of equal active FLOPs (D 384, 16 experts, top-4, width 4D/k = 384);
    on a GPU (``device="cuda"``) modsquad_vit_b's block in bf16 instead (`bench_moe_mlp_gpu`)."""
    if _on_gpu(device):
        return bench_moe_mlp_gpu(quick, device, compiled or "twins")

    d, e, k, tasks = VIT_S_DIM, 16, 4, 13
    rows, tokens = (2 if quick else 8), 197
    hidden = 4 * d // k
    torch.manual_seed(0)
    moe = MoEMlp(d, hidden, MoEConfig(num_experts=e, top_k=k, router=_router_config()), num_tasks=tasks)
    dense = Mlp(d, 4 * d)
    x = torch.randn(rows, tokens, d, requires_grad=True)
    ctx = _task_context(rows, tasks)
    fns = [_fwd_bwd(lambda: moe(x, ctx()), [x, *moe.parameters()]),
           _fwd_bwd(lambda: dense(x), [x, *dense.parameters()])]
    ds_error = None
    try:
        ds = _deepspeed_moe(d, hidden, e, k)
        fns.append(_fwd_bwd(lambda: ds(x)[0], [x, *ds.parameters()]))  # (output, aux loss, counts)
    except Exception as err:  # noqa: BLE001 - DeepSpeed is an informational comparison
        ds_error = f"DeepSpeed MoE: {type(err).__name__}: {err}"
    times = time_interleaved(fns, **_repeats(quick, 20))
    shape = {"tokens": rows * tokens, "dim": d, "experts": e, "top_k": k, "expert_hidden": hidden,
             "threads": torch.get_num_threads()}
    out = [ratio_row("moe_mlp_fwd_bwd_vs_dense", times[0], times[1], "<= 1.15", **shape)]
    if ds_error is None:
        out.append(ratio_row("deepspeed_moe_fwd_bwd_vs_dense", times[2], times[1], "", capacity_factor=1.25, **shape))
    else:
        out.append(error_row("deepspeed_moe_fwd_bwd_vs_dense", ds_error))
    return out


COMPILED = ("none", "twins", "both")  # `tools/bench.py --compiled`: which GPU rows also run under torch.compile


def _paired_rows(name: str, twin_name: str, routed: nn.Module, twin: nn.Module,
                 units: tuple[Callable[[nn.Module], Callable[[], None]], Callable[[nn.Module], Callable[[], None]]],
                 target: str, quick: bool, device: str | torch.device, compiled: str = "twins",
                 compile_backend: str = "inductor", faster: bool = False, repeats: int = 50,
                 **details) -> list[BenchResult]:
    """A routed layer or model against its dense twin, eager and under ``torch.compile``, timed interleaved
    (``units``: for the routed one and the twin, the timed unit on the module given, eager or compiled; on a GPU
    the rows end in ``_gpu``):

    - ``<name>_vs_<twin>``: both eager (the twin's bias, GELU, norms and their gradients separate passes);
    - ``<name>_vs_compiled_<twin>`` (``compiled`` "twins" or "both"): the routed one as it runs against the twin
      compiled, with the fusions a dense layer gets (bias + GELU in the GEMMs' epilogues or one generated kernel):
      the twin the cost model prices (`squad.bench.twins`), so this row carries ``target``;
    - ``compiled_<name>_vs_compiled_<twin>`` (``compiled`` "both"): both compiled (``train.compile``'s view).

    A form that fails to compile becomes an error row; the eager row stands.
    """
    if compiled not in COMPILED:
        raise ValueError(f"compiled={compiled!r}: expected one of {', '.join(COMPILED)}")
    suffix = "_gpu" if _on_gpu(device) else ""
    against, both = f"{name}_vs_compiled_{twin_name}{suffix}", f"compiled_{name}_vs_compiled_{twin_name}{suffix}"
    wanted = [(twin, units[1], against), (routed, units[0], both)][:COMPILED.index(compiled)]
    fns, failed = [units[0](routed), units[1](twin)], ""
    for module, unit, _ in wanted:
        try:
            fn = unit(torch.compile(module, backend=compile_backend))
            fn()  # compiles here, outside the timed rounds
        except Exception as err:  # noqa: BLE001 - reported as the row's error, the eager rows stand
            which = "twin" if module is twin else "routed one"
            failed = f"torch.compile ({compile_backend}) of the {which}: {type(err).__name__}: {err}"[:500]
            break
        fns.append(fn)
    times = time_interleaved(fns, **_repeats(quick, repeats), device=device if suffix else None)
    details = {**details, "compile_backend": compile_backend}
    rows = [ratio_row(f"{name}_vs_{twin_name}{suffix}", times[0], times[1], "", faster=faster, **details)]
    if len(times) > 2:  # the routed one as it runs, against the compiled twin
        rows.append(ratio_row(against, times[0], times[2], target, faster=faster, **details))
    if len(times) > 3:  # both compiled
        rows.append(ratio_row(both, times[3], times[2], "", faster=faster, **details))
    return rows + [error_row(form, failed) for _, _, form in wanted[len(times) - 2:]]


def _fwd_bwd_unit(x: torch.Tensor, call: Callable[[nn.Module], torch.Tensor]) -> Callable:
    """A unit of `_paired_rows`: forward + backward of ``call(module)`` (``x``'s and the module's gradients)."""
    return lambda module: _fwd_bwd(lambda: call(module), [x, *module.parameters()])


def bench_moe_mlp_gpu(quick: bool = False, device: str = "cuda", compiled: str = "twins",
                      overrides: Sequence[str] = (), compile_backend: str = "inductor") -> list[BenchResult]:
    """modsquad_vit_b's MoE MLP (D 768, 16 experts, top-4, width 768, its routers) fwd+bwd in bf16 on a GPU against
    the dense MLP of equal active FLOPs (hidden k·768), 12 images × 13 tasks × 197 tokens, timed with CUDA events;
    eager and compiled (`_paired_rows`). ``overrides`` and ``compile_backend`` are for the tests (the CPU runs it
    at small widths under the forced CUDA path)."""
    cfg, x, ctx, shape = _gpu_block_inputs(quick, device, overrides)
    torch.manual_seed(0)
    hidden = cfg.moe_hidden()
    moe = MoEMlp(cfg.embed_dim, hidden, cfg.moe, shape["tasks"]).to(device, torch.bfloat16)
    dense = Mlp(cfg.embed_dim, cfg.moe.top_k * hidden).to(device, torch.bfloat16)
    units = _fwd_bwd_unit(x, lambda m: m(x, ctx())), _fwd_bwd_unit(x, lambda m: m(x))
    return _paired_rows("moe_mlp_fwd_bwd", "dense", moe, dense, units, "<= 1.3", quick, device, compiled,
                        compile_backend,
                        experts=cfg.moe.num_experts, top_k=cfg.moe.top_k, expert_hidden=hidden, **shape)


# ------------------------------------------------------------------------------------------------------------- MoA
class MultiQueryAttention(nn.Module):
    """The MoA baseline with the same active FLOPs: k query heads of width d over one shared K/V head.

    q = Linear(D, k·d), kv = Linear(D, 2·d), SDPA (grouped-query with one K/V head), out = Linear(k·d, D).
    """

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim)
        self.kv = nn.Linear(dim, 2 * head_dim)
        self.proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)  # [B, k, N, d]
        kv = self.kv(x).view(b, n, 2, 1, self.head_dim).permute(2, 0, 3, 1, 4)  # [2, B, 1, N, d]
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)  # [B, k, N, d]
        return self.proj(out.transpose(1, 2).reshape(b, n, -1))


def bench_moa(quick: bool = False, device: str = "cpu", compiled: str | None = None) -> list[BenchResult]:
    """MoA fwd+bwd (15 experts, top-6, head dim 64) against multi-query attention of equal active FLOPs; on a GPU
    (``device="cuda"``) modsquad_vit_b's MoA in bf16 instead (`bench_moa_gpu`)."""
    if _on_gpu(device):
        return bench_moa_gpu(quick, device, compiled or "twins")

    d, e, k, dh, tasks = VIT_S_DIM, 15, 6, 64, 13
    rows, tokens = (2 if quick else 8), 197
    torch.manual_seed(0)
    moa = MoEAttention(d, MoAConfig(num_experts=e, top_k=k, head_dim=dh, router=_router_config()), num_tasks=tasks)
    mqa = MultiQueryAttention(d, k, dh)
    x = torch.randn(rows, tokens, d, requires_grad=True)
    ctx = _task_context(rows, tasks)
    t_moa, t_mqa = time_interleaved([_fwd_bwd(lambda: moa(x, ctx()), [x, *moa.parameters()]),
                                     _fwd_bwd(lambda: mqa(x), [x, *mqa.parameters()])], **_repeats(quick, 20))
    return [ratio_row("moa_fwd_bwd_vs_mqa", t_moa, t_mqa, "<= 1.25", tokens=rows * tokens, dim=d, experts=e,
                      top_k=k, head_dim=dh, threads=torch.get_num_threads())]


def bench_moa_gpu(quick: bool = False, device: str = "cuda", compiled: str = "twins", overrides: Sequence[str] = (),
                  compile_backend: str = "inductor") -> list[BenchResult]:
    """modsquad_vit_b's MoE attention (24 experts, top-12, head 64, its routers) fwd+bwd in bf16 on a GPU against
    multi-query attention of equal FLOPs (12 query heads over one K/V head), 12 images × 13 tasks × 197 tokens;
    eager and compiled (`_paired_rows`)."""
    cfg, x, ctx, shape = _gpu_block_inputs(quick, device, overrides)
    torch.manual_seed(0)
    moa = MoEAttention(cfg.embed_dim, cfg.moa, shape["tasks"], cfg.qkv_bias).to(device, torch.bfloat16)
    mqa = MultiQueryAttention(cfg.embed_dim, cfg.moa.top_k, cfg.moa.head_dim).to(device, torch.bfloat16)
    units = _fwd_bwd_unit(x, lambda m: m(x, ctx())), _fwd_bwd_unit(x, lambda m: m(x))
    return _paired_rows("moa_fwd_bwd", "mqa", moa, mqa, units, "<= 1.4", quick, device, compiled, compile_backend,
                        experts=cfg.moa.num_experts, top_k=cfg.moa.top_k, head_dim=cfg.moa.head_dim,
                        kernel=cfg.moa.kernel, **shape)


# ------------------------------------------------------------------------------------------------ fused 13-task step
FUSED_STEP_MODEL = ["model.img_size=64", "model.patch_size=8", "model.depth=4", "model.embed_dim=192",
                    "model.num_heads=3"]


def _head_loss(preds: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(p.float().square().mean() for p in preds.values())


def bench_fused_step(quick: bool = False) -> list[BenchResult]:
    """A 13-task training step (forward + backward) of a small Mod-Squad model: all tasks in one backbone pass
    against the authors' design, one backbone pass per task routing the batch with that task's routers (the
    same model called once per task, losses summed, one backward). Rows at 4, 8 and 16 images per step.
    """
    overrides = FUSED_STEP_MODEL + (["model.img_size=32", "model.depth=2"] if quick else [])
    model = _build("modsquad_vit_s", overrides).train()
    tasks = list(model.task_names)
    params = list(model.parameters())

    def fused(images: torch.Tensor) -> None:
        for p in params:
            p.grad = None
        _head_loss(model(images, tasks).preds).backward()

    def per_task(images: torch.Tensor) -> None:
        for p in params:
            p.grad = None
        loss = sum(_head_loss(model(images, [t]).preds) for t in tasks)
        loss.backward()

    rows = []
    for batch in ([2] if quick else [4, 8, 16]):
        images = torch.randn(batch, 3, model.cfg.img_size, model.cfg.img_size)
        t_fused, t_loop = time_interleaved([lambda: fused(images), lambda: per_task(images)],  # noqa: B023
                                           **_repeats(quick, 7))
        target = ">= 1.15" if batch == 4 else ""
        rows.append(ratio_row(f"fused_13_task_step_{batch}_images", t_fused, t_loop, target, faster=True,
                              images=batch, tasks=len(tasks), model="modsquad_vit_s " + " ".join(overrides),
                              threads=torch.get_num_threads()))
    return rows


# ------------------------------------------------------------------------------------------------------ MoD / MoNE
def _dense_vit_s(img_size: int):
    """A dense ViT-S with the MoD/MoNE configs' widths and heads (no task embedding, MTL-style plan)."""
    return _build("mod_vit_s", [f"model.img_size={img_size}", "model.plan=[{attn: dense, mlp: dense}]",
                                "model.task_embed=none", "model.name=vit_s_dense"]).eval()


class _Features(nn.Module):
    """``model.forward_features(images, task)`` as a module's forward, so that ``torch.compile`` compiles it."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.forward_features(images, self.task)


def _forward_speedup(case: str, conditional, dense, target: str, quick: bool, device: str = "cpu",
                     compiled: str | None = None, compile_backend: str = "inductor",
                     **details) -> list[BenchResult]:
    """Inference speed-up of ``conditional`` over ``dense`` (``forward_features``, no_grad): 8 images in float32
    on the CPU; on a GPU 256 images in bf16 timed with CUDA events (2 images with --quick), eager and compiled
    (`_paired_rows`: ``compiled``, "twins" on a GPU unless given; on the CPU only when given)."""
    gpu = _on_gpu(device)
    batch = 2 if quick else (256 if gpu else 8)
    size = conditional.cfg.img_size
    dtype = torch.bfloat16 if gpu else torch.float32
    conditional, dense = conditional.to(device, dtype), dense.to(device, dtype)
    images = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    task = conditional.task_names[0]

    def run(model) -> Callable[[], None]:
        def fwd() -> None:
            with torch.no_grad():
                model(images)

        return fwd

    details = {**details, "batch": batch, "image_size": size, "threads": torch.get_num_threads()}
    if gpu:
        details.update(dtype="bfloat16", gpu=device_name(device))
    if gpu or compiled:
        return _paired_rows(case.removesuffix("_vs_dense"), "dense", _Features(conditional, task),
                            _Features(dense, task), (run, run), target, quick, device, compiled or "twins",
                            compile_backend, faster=True, repeats=30 if gpu else 10, **details)
    t_cond, t_dense = time_interleaved([run(_Features(conditional, task)), run(_Features(dense, task))],
                                       **_repeats(quick, 10))
    return [ratio_row(case, t_cond, t_dense, target, faster=True, **details)]


def bench_mod(quick: bool = False, device: str = "cpu", compiled: str | None = None) -> list[BenchResult]:
    """MoD ViT-S (12.5 % capacity, learned routing every other block) forward vs the dense ViT-S, eval, batch 8 (on
    a GPU: 256 images, bf16)."""
    size = 64 if quick else 224
    mod = _build("mod_vit_s", [f"model.img_size={size}"]).eval()
    return _forward_speedup("mod_vit_s_forward_vs_dense", mod, _dense_vit_s(size), ">= 1.6", quick, device, compiled,
                            capacity=mod.cfg.mod.capacity)


def bench_mone(quick: bool = False, device: str = "cpu", compiled: str | None = None) -> list[BenchResult]:
    """MoNE ViT-S at e_c = 0.3 forward vs the dense ViT-S, eval, batch 8 (on a GPU: 256 images, bf16)."""
    size = 64 if quick else 224
    mone = _build("mone_vit_s", [f"model.img_size={size}"]).eval()
    mone.set_mone_capacity(0.3)
    target = ">= 1.7" if _on_gpu(device) else ">= 1.8"
    return _forward_speedup("mone_vit_s_forward_vs_dense", mone, _dense_vit_s(size), target, quick, device, compiled,
                            effective_capacity=0.3)


# ------------------------------------------------------------------------------------------------------- profile
PROFILE_CONFIGS = ["modsquad_vit_b", "modsquad_vit_s", "mtl_vit_b", "stl_vit_b", "m3vit_vit_b", "moe_mlp_only_vit_b",
                   "moe_attn_only_vit_b", "mod_vit_s", "amod_vit_s", "mone_vit_s"]


def profile_rows(names: Sequence[str] | None = None) -> list[dict]:
    """Parameters and MACs of the paper configs, counted on models built on the meta device.

    Returns:
        One dict per config: ``config``, ``params``, ``active_params`` (mean per task), ``macs`` (per image per
        task, mean over tasks; MoNE at its configured e_c), ``tasks``.
    """
    out = []
    for name in names or PROFILE_CONFIGS:
        cfg = _config(name)
        with torch.device("meta"):  # shapes only: nothing is allocated
            model = squad.build_model(cfg)
        prof = squad.profile(model)
        per_task = list(prof["tasks"].values())
        out.append({"config": name, "params": prof["params"], "tasks": len(per_task),
                    "active_params": sum(t["active_params"] for t in per_task) / len(per_task),
                    "macs": sum(t["macs"] for t in per_task) / len(per_task)})
    return out


def profile_table(names: Sequence[str] | None = None) -> str:
    """`profile_rows` as text: config, tasks, params (M), active params per task (M), GMACs per image per task."""
    rows = profile_rows(names)
    head = f"{'config':<22}{'tasks':>6}{'params M':>11}{'active M':>11}{'GMACs':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:<22}{r['tasks']:>6}{r['params'] / 1e6:>11.1f}{r['active_params'] / 1e6:>11.1f}"
                     f"{r['macs'] / 1e9:>9.2f}")
    return "\n".join(lines)
