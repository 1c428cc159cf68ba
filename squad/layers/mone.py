"""Mixture of Nested Experts (Jain et al. 2024): every token goes through a nested slice of each block.

Expert j of E uses the first d_j = D / 2^(E-1-j) features of every in- and out-projection (attention qkv/proj,
MLP fc1/fc2) and pads its output back to D; QKᵀV runs at full width and the MLP hidden stays at full width. One
router (per task) at the first MoNE block assigns tokens with Expert Preferred Routing under a capacity
distribution solved from the effective capacity e_c; its decision is reused by every later MoNE block. Tokens are
permuted ONCE so each expert's tokens are contiguous in every row (the group sizes are static for a given N and
e_c), so each width runs dense matmuls. The model undoes the permutation before the heads and before any
non-MoNE block (and redoes it before the next MoNE block), so every other layer sees tokens in their original
positions: the class token stays at 0 (MoD's keep_cls), A-MoD scores and routing records are per original token.

Memory layout: the blocks keep the routed tokens token-major ([N, R, D] in memory, handed between blocks as the
[R, N, D] view), so the rows of one expert group over the whole batch form ONE contiguous [n_j·R, D] block. Each
nested projection is then one matmul per group that reads its feature slice in place (`nested_linear_in`), and each
output projection adds its group's w_j features straight into the residual (`nested_linear_out` with a residual,
scaled per token for the MLP): no concatenation, padding or slicing copies, and nothing of full width for tokens that
use a slice. Norms and residual adds run over the routed order as it is. The block never writes into its input: the
attention's projections add into one copy of it, and in inference (no autograd record) the MLP's add into that
copy in place.

Update (paper Eq. 1): ``z = x + SA_j(x)``, ``x' = z + (α · r_ij + 1) · FFN_j(z)``, α learnable from 0.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config.model import MoNEConfig
from squad.kernels.choice import resolve
from squad.kernels.nested import nested_linear, nested_linear_, nested_mlp_, nested_mlp_config, nested_norm
from squad.layers.attention import attend
from squad.layers.base import RoutedLayer
from squad.layers.context import ForwardContext
from squad.layers.experts import host_ints, takes_kernel_path
from squad.layers.mone_capacity import capacity_distribution, expert_preferred_routing, group_sizes
from squad.layers.nested import nested_linear_in, nested_linear_out
from squad.layers.routing import TaskLinear


@dataclasses.dataclass
class MoNEState:
    """A routing decision reused by all MoNE blocks of one forward pass.

    Attributes:
        order: [R, N] original token index at each position of the permuted sequence.
        slices: (start, end, width) per expert group in the permuted sequence, largest expert first.
        gate: [R, N] router probability of each (permuted) token's assigned expert.
    """

    order: torch.Tensor
    slices: list[tuple[int, int, int]]
    gate: torch.Tensor
    _inverse: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def unpermute(self, x: torch.Tensor) -> torch.Tensor:
        """[R, N, ...] in routed order → original token order: one gather by the inverse permutation, written
        straight into the new tensor."""
        if self._inverse is None:  # position in routed order of each original token, once per pass
            positions = torch.arange(self.order.shape[1], device=self.order.device).expand_as(self.order)
            self._inverse = torch.empty_like(self.order).scatter_(1, self.order, positions)
        idx = self._inverse.view(*self.order.shape, *([1] * (x.dim() - 2))).expand_as(x)
        return torch.gather(x, 1, idx)

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """[R, N, D] in original token order → routed order, token-major in memory (as the MoNE blocks want)."""
        r, n, d = x.shape
        xt = x.transpose(0, 1)  # [N, R, D] view
        return torch.gather(xt, 0, self.order.t().unsqueeze(-1).expand(n, r, d)).transpose(0, 1)


@functools.lru_cache(maxsize=16)
def nested_layout(blocks: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """[2, G] int32 on ``device``: the end row and the width of each token group (`squad.kernels.nested`'s layout).
    Cached: every MoNE block of a pass, and every pass at one batch size, share it (compiled code calls
    ``nested_layout.__wrapped__``)."""
    with torch.inference_mode(False):  # a cached tensor outlives the call (see `segment_groups`)
        return host_ints([e for _, e, _ in blocks] + [w for _, _, w in blocks], device).to(torch.int32).view(2, -1)


def _alpha_as_saved_now(value):
    """α as saved today: a 0-dim tensor (files written before α became shape [1]) reshaped to [1]."""
    return value.reshape(1) if isinstance(value, torch.Tensor) and value.dim() == 0 else value


def upgrade_legacy_alpha(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each MoNE α saved 0-dim (files written before α became shape [1]) reshaped to [1].

    Every other entry is returned as it is; the input dict is not changed. (`MoNEBlock` applies the same rule to
    its own α when a state dict is loaded into it; this form serves readers that check shapes before loading.)
    """
    return {k: _alpha_as_saved_now(v) if k == "alpha" or k.endswith(".alpha") else v for k, v in state.items()}


class MoNERouter(RoutedLayer):
    """Per-task router ``softmax(W x + b)`` over the E nested experts, with EPR under the capacity budget."""

    kind = "mone"

    def __init__(self, dim: int, cfg: MoNEConfig, num_tasks: int):
        super().__init__()
        self.cfg = cfg
        self.dim = dim
        self.proj = TaskLinear(num_tasks, dim, cfg.num_experts, bias=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Routes x [R, N, D], stores the `MoNEState` in ``ctx`` and returns x permuted into expert groups."""
        r, n, d = x.shape
        e = self.cfg.num_experts
        cap = ctx.mone_capacity if ctx.mone_capacity is not None else self.cfg.capacity
        c = capacity_distribution(round(float(cap), 6), e, self.cfg.beta, self.cfg.delta)
        sizes = group_sizes(n, c)
        probs = self.proj(x, ctx.task_ids, ctx.segments).float().softmax(-1)  # [R, N, E]
        order = expert_preferred_routing(probs.detach(), sizes)
        slices, start = [], 0
        for j in range(e - 1, -1, -1):
            slices.append((start, start + sizes[j], d // 2 ** (e - 1 - j)))
            start += sizes[j]
        expert = torch.cat([torch.full((sizes[j],), j, device=x.device) for j in range(e - 1, -1, -1)])  # [N]
        p_sorted = probs.gather(1, order.unsqueeze(-1).expand(r, n, e))  # [R, N, E] in routed order
        gate = p_sorted.gather(2, expert.view(1, n, 1).expand(r, n, 1)).squeeze(-1)  # [R, N]
        ctx.mone = MoNEState(order, slices, gate.to(x.dtype))
        if ctx.collect_stats:
            hard = F.one_hot(expert, e).float().sum(0).expand(r, e)  # [R, E] tokens per expert
            chosen = None
            if ctx.record_routing:  # [R·N, 1] every token's nested expert, in original token order
                chosen = torch.empty_like(order).scatter_(1, order, expert.expand(r, n)).reshape(r * n, 1)
            self.report(ctx, n, hard, probs.sum(1), experts=chosen)
        return ctx.mone.permute(x)  # [R, N, D] in routed order, [N, R, D] token-major memory

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates of routing ``tokens`` tokens (``capacity`` changes nothing: every token is
        scored)."""
        return tokens * self.dim * self.cfg.num_experts


class MoNEBlock(nn.Module):
    """A ViT block (timm weight layout) running nested experts per token group.

    Args:
        dim: D.
        num_heads: attention heads (attention at full width).
        mlp_hidden: MLP hidden width (full for every expert).
        cfg: MoNE settings.
        num_tasks: T (for the router, if this block holds it).
        has_router: whether this block routes (the first MoNE block) or reuses ``ctx.mone``.
        qkv_bias: bias on qkv.
    """

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, cfg: MoNEConfig, num_tasks: int,
                 has_router: bool, qkv_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, mlp_hidden)
        self.mlp.fc2 = nn.Linear(mlp_hidden, dim)
        # [1], not 0-dim: DeepSpeed broadcasts parameters as byte views, which a 0-dim tensor cannot give.
        # Files written while α was 0-dim load through `_load_from_state_dict`.
        self.alpha = nn.Parameter(torch.zeros(1))
        self.router = MoNERouter(dim, cfg, num_tasks) if has_router else None
        self.want_scores = False

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Accepts α saved 0-dim (files written before α became shape [1])."""
        key = prefix + "alpha"
        if key in state_dict:
            state_dict[key] = _alpha_as_saved_now(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [R, N, D] in routed order → [R, N, D], laid out token-major in memory (see the module docstring).
        ``ctx.pending_embed`` [R, D], when the model set it, is added to x first (and cleared)."""
        emb, ctx.pending_embed = ctx.pending_embed, None
        if self.router is not None:
            if emb is not None:  # the router scores the embedded tokens
                x, emb = x + emb[:, None, :], None
            x = self.router(x, ctx)
        st: MoNEState = ctx.mone
        if st is None:
            raise RuntimeError("MoNE block before its router: no routing decision in this forward pass")
        r, n, d = x.shape
        xt = x.transpose(0, 1)  # [N, R, D]: each expert group's tokens are one contiguous block of rows
        if not xt.is_contiguous():
            xt = xt.contiguous()
        x2 = xt.view(n * r, d)  # [T, D], T = N·R token-major
        blocks = [(s * r, e * r, w) for s, e, w in st.slices if e > s]
        if not torch.is_grad_enabled() and takes_kernel_path(x.device) and self.backend(x) == "triton":
            return self._forward_kernels(x2, blocks, st, ctx, key_mask, emb).view(n, r, d).transpose(0, 1)
        if emb is not None:
            x2 = (x2.view(n, r, d) + emb).view(n * r, d)
        h = self.norm1(x2)
        qkv = nested_linear_in(h, self.attn.qkv.weight, self.attn.qkv.bias, blocks)  # [T, 3D]
        q, k, v = qkv.view(n, r, 3, self.num_heads, d // self.num_heads).permute(2, 1, 3, 0, 4).unbind(0)
        out, scores = attend(q, k, v, want_scores=self.want_scores, key_mask=key_mask)  # [R, H, N, d/H]
        if self.want_scores:
            ctx.attn_scores = scores
        out = out.permute(2, 0, 1, 3).reshape(n * r, d)  # [T, D] token-major
        # z = x + SA(x) and x' = z + (α·r + 1)·FFN(z): each nested output projection adds its w_g features into a
        # copy of the residual (x is never written); with no autograd record the second adds into z, the block's own
        z = nested_linear_out(out, self.attn.proj.weight, self.attn.proj.bias, blocks, residual=x2)
        h = self.norm2(z)
        hidden = F.gelu(nested_linear_in(h, self.mlp.fc1.weight, self.mlp.fc1.bias, blocks))  # [T, 4D]
        scale = (self.alpha * st.gate.t() + 1.0).reshape(n * r, 1)  # [T, 1] = α · r + 1
        y = nested_linear_out(hidden, self.mlp.fc2.weight, self.mlp.fc2.bias, blocks, residual=z, scale=scale,
                              inplace=not torch.is_grad_enabled())
        return y.view(n, r, d).transpose(0, 1)

    def backend(self, x: torch.Tensor) -> str:
        """What inference on the kernel path takes for tokens like ``x``: ``model.mone.kernel`` unless it is
        ``auto``, else what a GPU of this kind measured faster at this width (`squad.kernels.choice`), else
        ``cublas`` (the width slices, as training runs them)."""
        dims = {"D": self.attn.qkv.in_features, "H": self.mlp.fc1.out_features, "heads": self.num_heads}
        return resolve("mone", self.cfg.kernel, dims, x.dtype, x.device)

    def _forward_kernels(self, x2: torch.Tensor, blocks: list[tuple[int, int, int]], st: MoNEState,
                         ctx: ForwardContext, key_mask: torch.Tensor | None, emb: torch.Tensor | None) -> torch.Tensor:
        """Inference on the kernel path (`squad.kernels.nested`): x2 [T, D] token-major (+ emb [R, D] per row) →
        [T, D], in four launches besides the attention — the first norm writes only each token's width, the
        attention's output projection adds into the residual in its epilogue (and the embedding) and reads the
        attention output where SDPA wrote it, and the whole MLP sublayer (norm, both projections, GELU, the scaled
        residual add) is one launch into the block's own tensor that never writes the hidden layer (where D fits the
        fused kernel; else a norm, the first projection with GELU inside and the second adding in place)."""
        t, d = x2.shape
        r = st.order.shape[0]
        n = t // r
        layout = (nested_layout.__wrapped__ if torch.compiler.is_compiling() else nested_layout)(tuple(blocks),
                                                                                                 x2.device)
        groups = [e for _, e, _ in blocks] + [w for _, _, w in blocks]  # the layout as host ints
        h = nested_norm(x2, emb, self.norm1.weight, self.norm1.bias, self.norm1.eps, layout, groups, r)
        qkv = nested_linear(h, self.attn.qkv.weight, self.attn.qkv.bias, layout, groups, r, "in", False, None, None,
                            None)
        q, k, v = qkv.view(n, r, 3, self.num_heads, d // self.num_heads).permute(2, 1, 3, 0, 4).unbind(0)
        out, scores = attend(q, k, v, want_scores=self.want_scores, key_mask=key_mask)  # [R, H, N, d/H]
        if self.want_scores:
            ctx.attn_scores = scores
        rows = out.permute(2, 0, 1, 3)  # [N, R, H, d/H]: token-major rows of D features, a view of SDPA's output
        z = nested_linear(rows, self.attn.proj.weight, self.attn.proj.bias, layout, groups, r, "out", False, x2, emb,
                          None)  # x2 + emb + the projection: the block's own residual tensor
        fc1, fc2 = self.mlp.fc1, self.mlp.fc2
        if nested_mlp_config(d, fc1.out_features, z.dtype) is not None:
            nested_mlp_(z, self.norm2.weight, self.norm2.bias, self.norm2.eps, fc1.weight, fc1.bias, fc2.weight,
                        fc2.bias, layout, groups, st.gate, self.alpha)
            return z
        h = nested_norm(z, None, self.norm2.weight, self.norm2.bias, self.norm2.eps, layout, groups, r)
        hidden = nested_linear(h, fc1.weight, fc1.bias, layout, groups, r, "in", True, None, None, None)
        scale = torch.addcmul(torch.ones_like(self.alpha), self.alpha, st.gate.t().reshape(t))  # [T] = α · r + 1
        nested_linear_(hidden, fc2.weight, fc2.bias, layout, groups, z, scale)
        return z

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of ``tokens`` tokens: each nested width at its group size (the
        projections), attention at full width, and the router if this block holds it.

        Args:
            tokens: N.
            capacity: effective capacity e_c (default: the config's ``capacity``); the groups come from its
                capacity distribution as the router makes them.
        """
        d = self.attn.qkv.in_features
        hid = self.mlp.fc1.out_features
        e = self.cfg.num_experts
        e_c = self.cfg.capacity if capacity is None else capacity
        sizes = group_sizes(tokens, capacity_distribution(round(float(e_c), 6), e, self.cfg.beta, self.cfg.delta))
        proj = sum(sizes[j] * (d // 2 ** (e - 1 - j)) * (3 * d + d + 2 * hid) for j in range(e))
        router = self.router.macs(tokens) if self.router is not None else 0
        return proj + 2 * tokens * tokens * d + router
