"""Exact GELU's derivative in PyTorch: the reference of the kernels' epilogue (`triton_common.gelu_grad`), used by
the grouped GEMMs' reference (`grouped`) and the ``grouped_mm`` backend's backward (`squad.layers.experts.permuted`).
"""

from __future__ import annotations

import math

import torch


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """d gelu(x) / dx (exact GELU) = Φ(x) + x · φ(x)."""
    return 0.5 * (1.0 + torch.erf(x * 0.5 ** 0.5)) + x * torch.exp(-0.5 * x * x) * (2 * math.pi) ** -0.5
