"""Mixture-of-Depths: a block that only the top-k tokens of each sequence go through (Raposo et al. 2024), with
learned routing or attention routing (A-MoD, Gadhikar et al.).

Expert-choice over tokens with a static k = ceil(C · N): the selected tokens attend among themselves and go
through the MLP; the others pass unchanged. Learned routing scales the block's added term by the router weight
(``x + r · f(x)``, never the residual); attention routing uses the previous attention layer's column-mean
probabilities as scores, has no parameters and no scaling (``x + f(x)``).

Only the k tokens are gathered and processed; the output is one copy of the input with their results scattered in
(the input itself is never written: forward hooks and callers may hold it).

On the CUDA path in inference, around a dense block (`_forward_kernels`), the routed tokens take a few fused launches:
one reads the selected tokens (with a pending task embedding added) and normalises them, the attention, its
residual add, the whole MLP sublayer in one launch (`squad.kernels.nested.nested_mlp_`, hidden layer in registers),
and one write-back of ``lerp(x, y, r)`` into the residual stream — in place when the model says the block owns its
input (made in this pass, seen by no hook), the embedding then left pending for the next block.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from squad.config.model import MoDConfig
from squad.kernels.nested import nested_mlp_, nested_mlp_config
from squad.kernels.rows import row_add, row_norm, row_scatter_lerp_
from squad.layers.attention import Attention
from squad.layers.base import RoutedLayer, observed
from squad.layers.block import Block
from squad.layers.context import ForwardContext
from squad.layers.experts import takes_kernel_path
from squad.layers.mlp import Mlp
from squad.layers.mone import nested_layout
from squad.layers.routing import TaskLinear


@functools.lru_cache(maxsize=8)
def _first_token_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N] with +inf at token 0 and 0 elsewhere (cached: a constant of the sequence length; compiled code calls
    ``_first_token_bias.__wrapped__``, as dynamo warns that a traced cache could go stale)."""
    with torch.inference_mode(False):
        return torch.zeros(n, dtype=dtype, device=device).index_fill_(0, torch.zeros(1, dtype=torch.long,
                                                                                     device=device), float("inf"))


class MoDBlock(RoutedLayer):
    """Wraps any `Block` in Mixture-of-Depths routing.

    Args:
        block: the wrapped block (dense or routed).
        cfg: capacity, class-token handling, aux loss, inference mode.
        routing: ``"learned"`` (a per-task linear router) or ``"attention"`` (A-MoD scores from ``ctx``).
        dim: token width D.
        num_tasks: T.
        class_token: whether token 0 is a class token (kept when ``cfg.keep_cls``).
    """

    kind = "mod"

    def __init__(self, block: Block, cfg: MoDConfig, routing: str, dim: int, num_tasks: int, class_token: bool):
        super().__init__()
        self.block = block
        self.cfg = cfg
        self.routing = routing
        self.keep_cls = cfg.keep_cls and class_token
        self.router = TaskLinear(num_tasks, dim, 1) if routing == "learned" else None

    def capacity_tokens(self, n: int) -> int:
        """k = ceil(C · N), at least 1."""
        return max(1, min(n, math.ceil(self.cfg.capacity * n - 1e-9)))

    def _scores(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.router is not None:
            logits = self.router(x, ctx.task_ids, ctx.segments).squeeze(-1)  # [R, N]
            return logits.detach(), logits
        scores = ctx.attn_scores
        if scores is None or scores.shape != x.shape[:2]:
            got = None if scores is None else tuple(scores.shape)
            raise RuntimeError(f"{self.layer_name}: attention routing needs scores {tuple(x.shape[:2])} "
                               f"from the previous attention layer, got {got}")
        return scores.detach(), None

    def takes_pending_embed(self) -> bool:
        """Whether the block takes the fused inference path (`_forward_kernels`) and so adds a pending embedding
        itself: top-k selection (no threshold) around a dense block, not training."""
        inner = self.block
        return (not self.training and (self.router is None or self.cfg.inference != "threshold")
                and type(inner) is Block and type(inner.attn) is Attention and type(inner.mlp) is Mlp)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if (not torch.is_grad_enabled() and key_mask is None and takes_kernel_path(x.device)
                and self.takes_pending_embed() and not observed(self)):
            return self._forward_kernels(x, ctx)
        r, n, d = x.shape
        select, logits = self._scores(x, ctx)
        if self.keep_cls:  # the class token always first: +inf on its score (one add of a cached row)
            bias = _first_token_bias.__wrapped__ if torch.compiler.is_compiling() else _first_token_bias
            select = select + bias(n, select.dtype, select.device)
        threshold = logits is not None and not self.training and self.cfg.inference == "threshold"
        if threshold:
            keep = logits > 0
            if self.keep_cls:
                keep[:, 0] = True
            k = int(keep.sum(1).max().item())  # eval-only host read: the widest row decides the padded width
            if k == 0:
                self._record(ctx, r, n, keep.sum(1).float(), logits, None, None)
                return x
        else:
            k = self.capacity_tokens(n)
        idx = select.topk(k, dim=1).indices.sort(dim=1).values  # [R, k] in token order
        gather_idx = idx.unsqueeze(-1).expand(r, k, d)
        x_sel = x.gather(1, gather_idx)  # [R, k, D]
        valid = keep.gather(1, idx) if threshold else None  # [R, k]
        ctx.attn_scores = None
        y_sel = self.block(x_sel, ctx, key_mask=valid)
        if logits is not None:
            r_sel = logits.gather(1, idx).unsqueeze(-1).to(x.dtype)  # [R, k, 1]
            y_sel = torch.lerp(x_sel, y_sel, r_sel)  # x + r · (y - x): only the block's added term is scaled
        if valid is not None:
            y_sel = torch.where(valid.unsqueeze(-1), y_sel, x_sel)
        out = x.scatter(1, gather_idx, y_sel)  # one copy of x: the input is never written (hooks may hold it)
        if ctx.attn_scores is not None:  # the inner attention produced scores for the selected tokens only
            ctx.attn_scores = ctx.attn_scores.new_zeros(r, n).scatter(1, idx, ctx.attn_scores)
        if ctx.collect_stats:
            processed = valid.sum(1).float() if valid is not None else torch.full((r,), float(k), device=x.device)
            self._record(ctx, r, n, processed, logits, idx, valid)
        return out

    def _forward_kernels(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Inference on the CUDA path around a dense block: x [R, N, D] (lacking ``ctx.pending_embed`` e [R, D],
        when set) → the block's output, in eight launches past the router (module docstring). A learned router
        scores x without e: its logit of x + e differs by w_task · e, one number per row, which changes no row's
        top-k and is added to the selected logits where they scale the block's term."""
        r, n, d = x.shape
        emb, ctx.pending_embed = ctx.pending_embed, None
        owned, ctx.owns_input = ctx.owns_input, False
        k = self.capacity_tokens(n)
        select, logits = self._scores(x, ctx)
        if self.keep_cls:
            bias = _first_token_bias.__wrapped__ if torch.compiler.is_compiling() else _first_token_bias
            select = select + bias(n, select.dtype, select.device)
        idx = select.topk(k, dim=1).indices.sort(dim=1).values  # [R, k] in token order
        inner = self.block
        norm1, norm2, mlp = inner.norm1, inner.norm2, inner.mlp
        h, x_sel = row_norm(x, idx, emb, norm1.weight, norm1.bias, norm1.eps)  # [R, k, D]: LN(x + e), x + e
        ctx.attn_scores = None
        z = row_add(x_sel, inner.attn(h, ctx), None)  # [R, k, D]: the block's own tensor
        rows = z.view(r * k, d)
        if nested_mlp_config(d, mlp.fc1.out_features, z.dtype) is not None:  # the MLP sublayer, one launch
            layout = (nested_layout.__wrapped__ if torch.compiler.is_compiling() else nested_layout)(
                ((0, r * k, d),), x.device)
            nested_mlp_(rows, norm2.weight, norm2.bias, norm2.eps, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight,
                        mlp.fc2.bias, layout, [r * k, d], None, None)
        else:
            z = z + mlp(norm2(z))
        weight = shift = None
        if logits is not None:  # learned routing: x + r · (block(x) - x), r the logit of x + e
            weight = logits.gather(1, idx)  # [R, k]
            if emb is not None:
                shift = self.router(emb.unsqueeze(1), ctx.task_ids, ctx.segments).view(r)  # [R] = w_task · e
        if owned:  # write into the input; the output still lacks e, which stays pending for the next block
            out, ctx.pending_embed = x, emb
        else:
            out, emb = (x.clone() if emb is None else x + emb.unsqueeze(1)), None
        row_scatter_lerp_(out, idx, x_sel, z, weight, shift, emb)
        if ctx.attn_scores is not None:  # the inner attention produced scores for the selected tokens only
            ctx.attn_scores = ctx.attn_scores.new_zeros(r, n).scatter(1, idx, ctx.attn_scores)
        if ctx.collect_stats:
            self._record(ctx, r, n, torch.full((r,), float(k), device=x.device), logits, idx, None)
        return out

    def _record(self, ctx: ForwardContext, r: int, n: int, processed: torch.Tensor, logits: torch.Tensor | None,
                idx: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        """Statistics: per task, tokens processed vs skipped; the aux BCE when configured; with
        ``ctx.record_routing`` every token's choice ([R·N, 1]: 0 processed, 1 skipped, the columns of the counts).
        Nothing when the pass collects no statistics."""
        if not ctx.collect_stats:
            return
        aux = None
        if self.cfg.aux_loss and logits is not None and self.training and idx is not None:
            target = torch.zeros_like(logits).scatter(1, idx, 1.0)
            aux = F.binary_cross_entropy_with_logits(logits.float(), target.float())
        choice = None
        if ctx.record_routing:
            done = torch.zeros(r, n, dtype=torch.bool, device=processed.device)
            if idx is not None:
                done.scatter_(1, idx, True if valid is None else valid)  # [R, N] the tokens the block processed
            choice = (~done).long().reshape(r * n, 1)
        self.report(ctx, n, torch.stack([processed, n - processed], dim=1), aux_loss=aux,
                    experts=choice)  # counts [R, 2]

    def macs(self, tokens: int, capacity: float | None = None) -> float:
        """Multiply-accumulates per sequence of ``tokens`` tokens: the router plus the block on the tokens it
        processes.

        Args:
            tokens: N.
            capacity: share of the N tokens the block processes (e.g. measured under threshold inference: a mean
                over images, so the token count may be fractional and the block's count is interpolated between
                whole token counts); None: k = ceil(C · N), the configured top-k.
        """
        router = tokens * self.router.weight.shape[1] if self.router is not None else 0
        if capacity is None:
            return router + self.block.macs(self.capacity_tokens(tokens))
        processed = capacity * tokens
        lo = math.floor(processed)
        block = self.block.macs(lo)
        if processed > lo:
            block += (processed - lo) * (self.block.macs(lo + 1) - block)
        return router + block
