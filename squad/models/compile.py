"""torch.compile for squad models: what `train.compile: true` and the inference tools' ``--compile`` do.

`compile_model` compiles a module in place (`nn.Module.compile`): it keeps its class, parameters and state-dict
names, so checkpoints, resumption, ZeRO partitioning, extraction and export see the same module. Training compiles
the step's forward — model and losses — through DeepSpeed's ``engine.compile`` (the same in-place compile);
evaluation and prediction compile the model they run. The first calls pay the compilation (seconds on a GPU,
minutes for inductor on a CPU); a new input shape (a last, smaller batch) compiles once more, then shapes are
dynamic.

What the compiler sees of squad:
- attention: SDPA, or one opaque custom op per call (``squad::triton_attention`` / ``squad::chunked_attention``,
  `squad.kernels.library`) with a fake implementation and a registered backward — never a graph break;
- MoE attention and MoE MLP: data-dependent routing with static shapes (the sort, the group offsets by binary
  search) and the expert matmuls as opaque grouped-GEMM custom ops (``squad::grouped_mm`` / ``squad::grouped_wgrad``,
  `squad.kernels.grouped`: Triton on CUDA, their PyTorch reference elsewhere) in every dtype; compiled code takes
  them on any device (`squad.layers.experts.takes_kernel_path`), nothing in it pins memory or reads the device;
- MoNE's capacity distribution (an SLSQP solve on constants) runs while tracing and becomes a constant; its nested
  projections trace whole (no strided ``out=``).

Every shipped config's training step is one graph (`graph_breaks` at the tests' widths, torch 2.14; with the CUDA
path forced on a CPU too, tests/test_compile.py). The graph breaks that remain: MoD threshold inference
(``--mod-inference threshold``) reads the widest row's token count on the host; a training step with
``train.tasks_per_image`` splits at the assignment's per-task image lists and compiles again for each new batch
composition (`tasks_per_image_note`: the run warns).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn

BACKEND = "inductor"  # what train.compile and --compile use (the tests swap in a cheaper one)


def compile_model(module: nn.Module, backend: str | Callable | None = None, mode: str | None = None) -> nn.Module:
    """Compiles ``module`` in place with `torch.compile` and returns it (same object, same parameters).

    Args:
        module: a `SquadViT`, a `SingleTaskModel`, or any module that calls one.
        backend: the torch.compile backend (default `BACKEND`, inductor; "aot_eager" traces without generating
            code).
        mode: torch.compile's mode (None, "reduce-overhead", "max-autotune", ...).
    """
    module.compile(backend=backend or BACKEND, mode=mode)
    return module


def tasks_per_image_note(tasks_per_image: int, compile: bool) -> str | None:
    """What ``train.compile`` with ``train.tasks_per_image`` costs (the run logs it as a warning), or None.

    The forward turns each step's sampled assignment into per-task image lists (``nonzero``: a graph break) whose
    lengths it specialises on — a task with 0 or 1 images is common at a few tasks per image — so a new batch
    composition compiles the forward again, until dynamo's recompile limit sends the rest of the run to eager code
    (tests/test_compile.py holds it as a known failure).
    """
    if not (compile and tasks_per_image):
        return None
    import torch._dynamo

    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)
    return (f"train.compile with train.tasks_per_image={tasks_per_image}: each new batch composition (which tasks "
            f"get 0 or 1 images) compiles the forward again, up to dynamo's recompile limit ({limit}), after which "
            f"the step runs eagerly; set train.tasks_per_image=0 to compile once, or train.compile=false")


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """Where and why dynamo split a graph: ``where`` is "file.py:line" of the innermost squad frame."""

    where: str
    reason: str


def graph_breaks(fn: Callable[..., object], *args) -> tuple[int, list[GraphBreak]]:
    """Runs `torch._dynamo.explain` on ``fn(*args)``: the number of graphs and the breaks between them.

    Args:
        fn: a function or module; ``fn(*args)`` is traced (and run) once, nothing is compiled to code.
        args: its inputs.

    Returns:
        (graphs, breaks), each break once per (place, reason).
    """
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    seen: dict[tuple[str, str], GraphBreak] = {}
    for item in explained.break_reasons:
        frames = [f for f in item.user_stack if "site-packages" not in f.filename] or item.user_stack
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        reason = str(item.reason).strip().splitlines()[0] if str(item.reason).strip() else "?"
        seen.setdefault((where, reason), GraphBreak(where, reason))
    torch._dynamo.reset()
    return explained.graph_count, list(seen.values())
