"""Task heads on the backbone's final normed tokens (Mod-Squad: one linear layer per task).

``dense``: Linear(D, p·p·C) per patch token, rearranged to a [B, C, H, W] map at the input resolution.
``class``: mean of the patch tokens → LayerNorm → Linear(C) logits (also timm's ``global_pool="avg"`` head, its
``fc_norm`` being the LayerNorm).
``token``: the class token → Linear(C) (timm's ViT head, so a timm classifier loads with its head).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.config.model import HeadConfig


class DenseHead(nn.Module):
    """Per-patch linear prediction of a p×p×C pixel block."""

    def __init__(self, dim: int, channels: int, patch: int, grid: int, prefix_tokens: int):
        super().__init__()
        self.channels, self.patch, self.grid, self.prefix = channels, patch, grid, prefix_tokens
        self.proj = nn.Linear(dim, patch * patch * channels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        g, p, c = self.grid, self.patch, self.channels
        y = self.proj(tokens[:, self.prefix :])  # [B, g·g, p·p·C]
        y = y.view(b, g, g, p, p, c).permute(0, 5, 1, 3, 2, 4)  # [B, C, g, p, g, p]
        return y.reshape(b, c, g * p, g * p)

    def macs(self, n_patches: int) -> int:
        return n_patches * self.proj.in_features * self.proj.out_features


class ClassHead(nn.Module):
    """Mean-pooled patch tokens → LayerNorm → Linear."""

    def __init__(self, dim: int, channels: int, prefix_tokens: int):
        super().__init__()
        self.prefix = prefix_tokens
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc = nn.Linear(dim, channels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(tokens[:, self.prefix :].mean(1)))

    def macs(self, n_patches: int) -> int:
        return self.fc.in_features * self.fc.out_features


class TokenHead(nn.Module):
    """Class token → Linear (timm ``head`` with global_pool='token')."""

    def __init__(self, dim: int, channels: int):
        super().__init__()
        self.fc = nn.Linear(dim, channels)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(tokens[:, 0])

    def macs(self, n_patches: int) -> int:
        return self.fc.in_features * self.fc.out_features


def build_head(cfg: HeadConfig, dim: int, patch: int, grid: int, class_token: bool) -> nn.Module:
    """The head module for one task."""
    prefix = int(class_token)
    if cfg.kind == "dense":
        return DenseHead(dim, cfg.channels, patch, grid, prefix)
    if cfg.kind == "class":
        return ClassHead(dim, cfg.channels, prefix)
    if not class_token:
        raise ValueError(f"head {cfg.name!r}: kind 'token' needs model.class_token=true")
    return TokenHead(dim, cfg.channels)
