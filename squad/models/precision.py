"""Inference precision: the dtype evaluate, predict, extract and export run a model in (``--precision``).

``bf16`` is the default on CUDA — the dtype squad trains in there, and the faster one for the routed layers' grouped
GEMM kernels (which take fp32 too, with no host sync either way) — and ``fp32`` everywhere else (the CPU has no fast
bf16 matmul on most machines, and fp32 is exact there).

Example::

    dtype = cast_model(model, precision=None, device="cuda")   # bfloat16: the model is moved and cast in place
    runner = cast_copy(model, torch.bfloat16)                 # a bf16 copy; the fp32 weights stay untouched
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from squad.config.tools import PRECISIONS

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def default_precision(device: str | torch.device) -> str:
    """``"bf16"`` on a CUDA device, ``"fp32"`` elsewhere."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def precision_dtype(precision: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype of ``precision`` (``"bf16"``, ``"fp32"``, or None for `default_precision` on ``device``).

    Raises:
        ValueError: an unknown precision (the message lists the known ones).
    """
    name = default_precision(device) if precision is None else precision
    if name not in _DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return _DTYPES[name]


def precision_name(dtype: torch.dtype) -> str:
    """``"bf16"`` or ``"fp32"`` for a dtype of `PRECISIONS` (the dtype's own name otherwise)."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def cast_model(model: nn.Module, precision: str | None, device: str | torch.device) -> torch.dtype:
    """Moves ``model`` to ``device`` and casts its floating parameters and buffers to ``precision``, in place.

    Returns:
        The dtype it now runs in (its inputs must be cast to it too).
    """
    dtype = precision_dtype(precision, device)
    model.to(device=device, dtype=dtype)
    return dtype


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` itself when its parameters already have ``dtype``, else a copy cast to it (the original's weights —
    e.g. fp32 weights about to be pruned and saved — are left as they are)."""
    first = next(model.parameters(), None)
    if first is None or first.dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype=dtype)
