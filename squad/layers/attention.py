"""Dense multi-head self-attention, weight-compatible with timm's VisionTransformer (``qkv``, ``proj``).

All attention in squad goes through `attend`, which calls the routed-attention op (squad.kernels): plain SDPA
when no routing scores are needed, the flash-style pass that also returns A-MoD scores (column means of the
attention probabilities) when the next block routes on attention.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.kernels import routed_attention
from squad.layers.context import ForwardContext


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, want_scores: bool = False,
           key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention q [B, Hq, N, d] over k, v [B, Hkv, N, d] (Hkv divides Hq).

    Args:
        q, k, v: queries, keys and values.
        want_scores: also return the A-MoD scores [B, N] (mean over heads and query rows of the probabilities).
        key_mask: [B, N] bool, keys to attend to (False = ignored); only for MoD threshold inference.

    Returns:
        (out [B, Hq, N, d], scores [B, N] or None).
    """
    if key_mask is not None:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = key_mask[:, None, None, :]  # [B, 1, 1, N]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out, None

    if want_scores:
        return routed_attention(q, k, v, return_scores=True)
    return routed_attention(q, k, v), None


class Attention(nn.Module):
    """Multi-head self-attention (timm layout: ``qkv`` Linear(D, 3·H·d), ``proj`` Linear(H·d, D)).

    Args:
        dim: token width D.
        num_heads: H.
        head_dim: per-head width d (default D / H; a larger d gives the authors' wide dense attention).
        qkv_bias: bias on the qkv projection.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim or dim // num_heads
        inner = self.num_heads * self.head_dim
        self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        self.proj = nn.Linear(inner, dim)
        self.want_scores = False  # set by the model when the next block routes on this layer's attention

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None, key_mask: torch.Tensor | None = None):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, B, H, N, d]
        q, k, v = qkv.unbind(0)
        want = self.want_scores and ctx is not None
        out, scores = attend(q, k, v, want_scores=want, key_mask=key_mask)
        if want:
            ctx.attn_scores = scores
        out = out.transpose(1, 2).reshape(b, n, -1)  # [B, N, H·d]
        return self.proj(out)

    def macs(self, n: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of n tokens (``capacity`` is unused)."""
        inner = self.num_heads * self.head_dim
        d = self.qkv.in_features
        return n * d * 3 * inner + 2 * n * n * inner + n * inner * d
