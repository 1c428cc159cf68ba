"""A pre-norm transformer block whose attention and MLP are chosen by the layer plan (dense or routed).

Layout matches timm's ``Block`` (``norm1``, ``attn``, ``norm2``, ``mlp``) so dense blocks load timm weights.

A task embedding the model hands the block (``ctx.pending_embed``, on the CUDA path in inference) is added in the
block's own passes: the first norm reads ``x + e`` and the attention's residual add writes ``x + e + attention``
(`squad.kernels.rows`), so it costs no pass of its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.config.model import BlockSpec, ModelConfig
from squad.kernels.rows import row_add, row_norm
from squad.layers.attention import Attention
from squad.layers.context import ForwardContext
from squad.layers.mlp import Mlp
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp


class Block(nn.Module):
    """``x + attn(norm1(x))`` then ``+ mlp(norm2(x))``; either part may be dense, routed or absent.

    When the model adds task embeddings only at MoE inputs, the routed sublayers see ``norm(x) + e_task``
    (``ctx`` carries the per-row embedding); the residual stream itself is untouched.
    """

    def __init__(self, cfg: ModelConfig, spec: BlockSpec, num_tasks: int):
        super().__init__()
        d = cfg.embed_dim
        self.spec = spec
        self.norm1 = nn.LayerNorm(d, eps=1e-6) if spec.attn != "none" else None
        if spec.attn == "dense":
            self.attn = Attention(d, cfg.num_heads, cfg.head_dim, cfg.qkv_bias)
        elif spec.attn == "moa":
            self.attn = MoEAttention(d, cfg.moa, num_tasks, cfg.qkv_bias)
        else:
            self.attn = None
        self.norm2 = nn.LayerNorm(d, eps=1e-6) if spec.mlp != "none" else None
        if spec.mlp == "dense":
            self.mlp = Mlp(d, int(d * cfg.mlp_ratio))
        elif spec.mlp == "moe":
            self.mlp = MoEMlp(d, cfg.moe_hidden(), cfg.moe, num_tasks)
        else:
            self.mlp = None

    def _routed_input(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        emb = ctx.moe_task_embed
        return h if emb is None else h + emb[:, None, :]

    def takes_pending_embed(self) -> bool:
        """Whether the block can add a pending embedding in its own passes (it has an attention sublayer)."""
        return self.attn is not None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, N, D] → [R, N, D]; ``key_mask`` [R, N] restricts attention (MoD threshold inference); with
        ``ctx.pending_embed`` [R, D] (set by the model only where `takes_pending_embed`) the block's input is
        ``x + e``."""
        emb = ctx.pending_embed if ctx is not None else None
        if self.attn is not None:
            if emb is not None:  # x + e normed and added in the passes the block makes anyway
                ctx.pending_embed = None
                h, _ = row_norm(x, None, emb, self.norm1.weight, self.norm1.bias, self.norm1.eps)
            else:
                h = self.norm1(x)
            if isinstance(self.attn, MoEAttention):
                h = self._routed_input(h, ctx)
            a = self.attn(h, ctx, key_mask=key_mask)
            x = x + a if emb is None else row_add(x, a, emb)
        if self.mlp is not None:
            h = self.norm2(x)
            if isinstance(self.mlp, MoEMlp):
                h = self._routed_input(h, ctx)
            x = x + self.mlp(h, ctx)
        return x

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of ``tokens`` tokens (``capacity`` is unused: a block processes every
        token it is given)."""
        return sum(m.macs(tokens) for m in (self.attn, self.mlp) if m is not None)
