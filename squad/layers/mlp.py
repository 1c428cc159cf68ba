"""The dense two-layer GELU MLP of a transformer block, weight-compatible with timm's ``Mlp`` (``fc1``, ``fc2``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.layers.context import ForwardContext


class Mlp(nn.Module):
    """Two-layer MLP with GELU (timm layout: ``fc1``, ``fc2``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of ``tokens`` tokens (``capacity`` is unused)."""
        return 2 * tokens * self.fc1.in_features * self.fc1.out_features
