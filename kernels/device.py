"""Which algorithm a tensor's device takes: the one device predicate of squad's layers and kernels.

squad runs two kinds of algorithms for its routed layers and attention: the CUDA path (Triton kernels where SDPA
cannot serve, grouped-GEMM custom ops, nothing that reads the device from the host) and the CPU path (PyTorch ops
that are fastest there, reading group sizes on the host when that is free). Every such branch asks `cuda_path`, so
tests and the traffic recorder can force the CUDA path on any device (`force_cuda_path`) and see, on a CPU, exactly
the ops a GPU would run — including the ones that break `torch.compile` on CUDA only.

What the CUDA path may NOT do on a tensor that is not really on a GPU is launch a Triton kernel (there is no GPU to
run it, unless Triton's CPU interpreter is on): `triton_runs_on` says where a kernel can run, and a forced CPU run
falls back to the kernels' PyTorch reference implementation.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

import torch

_FORCED = False
_TRITON = importlib.util.find_spec("triton") is not None  # once: torch.compile traces a constant, not importlib


def cuda_path(device: torch.device | str) -> bool:
    """Whether code for tensors on ``device`` takes the CUDA algorithm: on CUDA devices, and everywhere inside
    `force_cuda_path`."""
    return _FORCED or torch.device(device).type == "cuda"


def forced() -> bool:
    """Whether `force_cuda_path` is active."""
    return _FORCED


@contextlib.contextmanager
def force_cuda_path(enabled: bool = True) -> Iterator[None]:
    """Inside the block every device takes the CUDA algorithm (`cuda_path` is True); restored on exit.

    Args:
        enabled: False forces nothing (the block runs each device's own algorithm).
    """
    global _FORCED
    saved = _FORCED
    _FORCED = enabled or saved
    try:
        yield
    finally:
        _FORCED = saved


def triton_available() -> bool:
    """Whether the `triton` package can be imported."""
    return _TRITON


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` before torch was imported)."""
    if not _TRITON:
        return False
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return not isinstance(tl.zeros, JITFunction)


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether a Triton kernel can run on tensors of ``device``: a CUDA device, or any CPU tensor under the
    interpreter. (Meta and fake tensors never run a kernel: the ops' fake implementations serve them.)"""
    kind = torch.device(device).type
    return _TRITON and (kind == "cuda" or (kind == "cpu" and triton_interpreting()))


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (host memory) page-locked for an asynchronous copy to the GPU.

    Without a GPU (the CUDA path forced on a CPU) there is nothing to pin and ``t`` is returned, except inside a
    compiled region, where it is pinned regardless and fails as it fails on CUDA ("NYI: aten._pin_memory"): a CPU
    test of compiled CUDA-path code then sees the bug a GPU would.
    """
    if torch.cuda.is_available() or torch.compiler.is_compiling():
        return t.pin_memory()
    return t
