"""Task heads on the backbone's final normed tokens (Mod-Squad: one linear layer per task).

``dense``: Linear(D, p·p·C) per patch token, rearranged to a [B, C, H, W] map at the input resolution (the default,
``decoder: linear``); or, with ``decoder: light``, a small convolutional decoder on the token grid (`LightDecoder`:
a 3×3 conv, then progressive ×2 bilinear upsampling, each step followed by a 3×3 conv whose width halves, then a 1×1
conv to C channels) — in the spirit of the SETR-PUP heads M3ViT, and so Mod-Squad's PASCAL-Context runs, used, at a
fraction of their cost.
``class``: mean of the patch tokens → LayerNorm → Linear(C) logits (also timm's ``global_pool="avg"`` head, its
``fc_norm`` being the LayerNorm).
``token``: the class token → Linear(C) (timm's ViT head, so a timm classifier loads with its head).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config.model import HeadConfig


class LightDecoder(nn.Module):
    """Token grid [B, D, g, g] → [B, C, g·p, g·p]: conv3×3 (D → w), then ceil(log2 p) steps of ×2 bilinear
    upsampling + conv3×3 (the width halving each step, down to min(w, 16)), each conv followed by GroupNorm and
    ReLU, then a 1×1 conv to C channels at the full resolution. The last upsampling lands exactly on g·p pixels
    (any patch size, not only powers of two).

    Args:
        dim: token width D.
        channels: output channels C.
        patch: patch size p (the upsampling factor from the token grid to pixels).
        grid: token grid side g.
        width: w, the first conv's output width.
    """

    def __init__(self, dim: int, channels: int, patch: int, grid: int, width: int):
        super().__init__()
        self.grid, self.patch = grid, patch
        steps = math.ceil(math.log2(patch)) if patch > 1 else 0
        widths = [max(width >> i, min(width, 16)) for i in range(steps + 1)]
        # the side each conv runs at: g, 2g, 4g, ..., and g·p for the last (2^i < p for every i < steps)
        self.sizes = [grid * 2**i for i in range(steps)] + [grid * patch] if steps else [grid]
        self.convs = nn.ModuleList([nn.Conv2d(dim, widths[0], 3, padding=1)]
                                   + [nn.Conv2d(widths[i], widths[i + 1], 3, padding=1) for i in range(steps)])
        self.norms = nn.ModuleList([nn.GroupNorm(math.gcd(8, w), w) for w in widths])
        self.out = nn.Conv2d(widths[-1], channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D, g, g] → [B, C, g·p, g·p]."""
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
            if i:
                x = F.interpolate(x, size=(self.sizes[i], self.sizes[i]), mode="bilinear", align_corners=False)
            x = F.relu(norm(conv(x)))
        return self.out(x)

    def macs(self) -> int:
        """Multiply-accumulates of the convolutions per image (norms, ReLU and interpolation not counted)."""
        total = 0
        for conv, side in zip(self.convs, self.sizes, strict=True):
            total += side * side * conv.in_channels * conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        return total + self.sizes[-1] ** 2 * self.out.in_channels * self.out.out_channels


class DenseHead(nn.Module):
    """Per-pixel prediction from the patch tokens: a per-patch linear map of a p×p×C pixel block (``linear``, the
    paper's head) or a `LightDecoder` on the token grid (``light``).

    Attributes:
        channels: output channels C.
        decoder: ``"linear"`` or ``"light"``.
        proj: the linear map (``linear``), else absent.
        decoder_net: the `LightDecoder` (``light``), else absent.
    """

    def __init__(self, dim: int, channels: int, patch: int, grid: int, prefix_tokens: int,
                 decoder: str = "linear", width: int = 64):
        super().__init__()
        self.channels, self.patch, self.grid, self.prefix = channels, patch, grid, prefix_tokens
        self.decoder = decoder
        if decoder == "linear":
            self.proj = nn.Linear(dim, patch * patch * channels)
        elif decoder == "light":
            self.decoder_net = LightDecoder(dim, channels, patch, grid, width)
        else:
            raise ValueError(f"unknown dense decoder {decoder!r} (choose linear or light)")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        g, p, c = self.grid, self.patch, self.channels
        x = tokens[:, self.prefix :]
        if self.decoder == "light":
            return self.decoder_net(x.transpose(1, 2).reshape(b, -1, g, g))
        y = self.proj(x)  # [B, g·g, p·p·C]
        y = y.view(b, g, g, p, p, c).permute(0, 5, 1, 3, 2, 4)  # [B, C, g, p, g, p]
        return y.reshape(b, c, g * p, g * p)

    def macs(self, n_patches: int) -> int:
        if self.decoder == "light":
            return self.decoder_net.macs()
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
        return DenseHead(dim, cfg.channels, patch, grid, prefix, cfg.decoder, cfg.decoder_width)
    if cfg.kind == "class":
        return ClassHead(dim, cfg.channels, prefix)
    if not class_token:
        raise ValueError(f"head {cfg.name!r}: kind 'token' needs model.class_token=true")
    return TokenHead(dim, cfg.channels)
