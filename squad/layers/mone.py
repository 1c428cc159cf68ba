"""Mixture of Nested Experts (Jain et al. 2024): every token goes through a nested slice of each block.

Expert j of E uses the first d_j = D / 2^(E-1-j) features of every in- and out-projection (attention qkv/proj,
MLP fc1/fc2) and pads its output back to D; QKᵀV runs at full width and the MLP hidden stays at full width. One
router (per task) at the first MoNE block assigns tokens with Expert Preferred Routing under a capacity
distribution solved from the effective capacity e_c; its decision is reused by every later MoNE block. Tokens are
permuted ONCE so each expert's tokens are contiguous in every row (the group sizes are static for a given N and
e_c), so each width runs dense matmuls; the model undoes the permutation before the heads.

Update (paper Eq. 1): ``z = x + SA_j(x)``, ``x' = z + (α · r_ij + 1) · FFN_j(z)``, α learnable from 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config import MoNEConfig
from squad.layers.attention import attend
from squad.layers.routing import ForwardContext, RouterStats, TaskLinear


@functools.lru_cache(maxsize=256)
def capacity_distribution(e_c: float, num_experts: int = 4, beta: float = 10.0, delta: float = 2.0) -> tuple:
    """Share of tokens per nested expert (smallest first) for an effective capacity e_c (paper Eq. 3).

    Maximises ``Σ_i c_i / δ^(i-1) − β Σ_i c_i log c_i`` subject to ``Σ c_i = 1``, ``Σ c_i / 2^(E-i) = e_c``,
    ``0 ≤ c_i ≤ 1`` with SLSQP. We use the formula as printed (dividing by δ^(i−1), i = 1 the smallest expert);
    at β = 10 it differs from the multiplying variant by < 0.01 per entry (FACTS §4).

    Returns:
        c as a tuple of E floats (smallest expert first), summing to 1.
    """
    from scipy.optimize import minimize

    widths = np.array([1.0 / 2 ** (num_experts - 1 - i) for i in range(num_experts)])  # d_i / D
    if e_c >= 1.0 - 1e-9:
        return tuple([0.0] * (num_experts - 1) + [1.0])
    if e_c <= widths[0] + 1e-9:
        return tuple([1.0] + [0.0] * (num_experts - 1))
    if num_experts == 1:
        return (1.0,)
    reward = 1.0 / delta ** np.arange(num_experts)
    eps = 1e-12

    def objective(c):
        c = np.clip(c, eps, 1.0)
        return -(np.sum(reward * c) - beta * np.sum(c * np.log(c)))

    def grad(c):
        c = np.clip(c, eps, 1.0)
        return -(reward - beta * (np.log(c) + 1.0))

    cons = [
        {"type": "eq", "fun": lambda c: np.sum(c) - 1.0, "jac": lambda c: np.ones_like(c)},
        {"type": "eq", "fun": lambda c: np.dot(c, widths) - e_c, "jac": lambda c: widths},
    ]
    x0 = np.full(num_experts, 1.0 / num_experts)
    res = minimize(objective, x0, jac=grad, method="SLSQP", bounds=[(0.0, 1.0)] * num_experts, constraints=cons,
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        raise RuntimeError(f"capacity solver failed for e_c={e_c}: {res.message}")
    c = np.clip(res.x, 0.0, 1.0)
    return tuple(float(v) for v in c / c.sum())


def group_sizes(n: int, capacity: tuple) -> list[int]:
    """Tokens per expert (smallest first): k_j = floor(c_j · N) for all but the smallest, which takes the rest."""
    sizes = [math.floor(c * n + 1e-9) for c in capacity]
    sizes[0] = n - sum(sizes[1:])
    return sizes


def expert_preferred_routing(probs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Expert Preferred Routing (paper Algorithm 1), batched over rows.

    Args:
        probs: [R, N, E] router probabilities (expert 0 smallest).
        sizes: tokens per expert (smallest first), summing to N.

    Returns:
        order [R, N]: token indices grouped by expert, largest expert first (each group's tokens in decreasing
        preference); token ``order[r, i]`` goes to the expert whose group contains position i.
    """
    r, n, e = probs.shape
    taken = torch.zeros(r, n, dtype=torch.bool, device=probs.device)
    groups = []
    for j in range(e - 1, 0, -1):
        if sizes[j] == 0:
            continue
        p = probs[..., j].masked_fill(taken, -1.0)
        idx = p.topk(sizes[j], dim=1).indices  # [R, k_j]
        taken.scatter_(1, idx, True)
        groups.append(idx)
    if sizes[0]:
        rest = (~taken).float()
        groups.append(rest.topk(sizes[0], dim=1, sorted=False).indices)  # all remaining tokens
    return torch.cat(groups, dim=1)


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

    def unpermute(self, x: torch.Tensor) -> torch.Tensor:
        """[R, N, ...] in routed order → original token order."""
        idx = self.order.view(*self.order.shape, *([1] * (x.dim() - 2))).expand_as(x)
        return torch.empty_like(x).scatter(1, idx, x)


class MoNERouter(nn.Module):
    """Per-task router ``softmax(W x + b)`` over the E nested experts, with EPR under the capacity budget."""

    def __init__(self, dim: int, cfg: MoNEConfig, num_tasks: int):
        super().__init__()
        self.cfg = cfg
        self.dim = dim
        self.proj = TaskLinear(num_tasks, dim, cfg.num_experts, bias=True)
        self.layer_name = "mone"

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Routes x [R, N, D], stores the `MoNEState` in ``ctx`` and returns x permuted into expert groups."""
        r, n, d = x.shape
        e = self.cfg.num_experts
        cap = ctx.mone_capacity if ctx.mone_capacity is not None else self.cfg.capacity
        c = capacity_distribution(round(float(cap), 6), e, self.cfg.beta, self.cfg.delta)
        sizes = group_sizes(n, c)
        probs = self.proj(x, ctx.task_ids).float().softmax(-1)  # [R, N, E]
        order = expert_preferred_routing(probs.detach(), sizes)
        slices, start = [], 0
        for j in range(e - 1, -1, -1):
            slices.append((start, start + sizes[j], d // 2 ** (e - 1 - j)))
            start += sizes[j]
        expert = torch.cat([torch.full((sizes[j],), j, device=x.device) for j in range(e - 1, -1, -1)])  # [N]
        p_sorted = probs.gather(1, order.unsqueeze(-1).expand(r, n, e))  # [R, N, E] in routed order
        gate = p_sorted.gather(2, expert.view(1, n, 1).expand(r, n, 1)).squeeze(-1)  # [R, N]
        ctx.mone = MoNEState(order, slices, gate.to(x.dtype))
        hard = F.one_hot(expert, e).float().sum(0).expand(r, e)  # [R, E] tokens per expert
        tokens = ctx.per_task_sum(torch.full((r,), float(n), device=x.device))
        ctx.stats.append(RouterStats(self.layer_name, "mone", ctx.per_task_sum(probs.sum(1)),
                                     ctx.per_task_sum(hard), tokens, 1))
        return x.gather(1, order.unsqueeze(-1).expand(r, n, d))

    def macs(self, n: int) -> int:
        return n * self.dim * self.cfg.num_experts


def _nested_linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slices) -> torch.Tensor:
    """Per group: first ``width`` input features × the matching weight columns; full output width."""
    return torch.cat([F.linear(x[:, s:e, :w], weight[:, :w], bias) for s, e, w in slices], dim=1)


def _nested_linear_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slices) -> torch.Tensor:
    """Per group: full input × the first ``width`` weight rows, padded back to full width."""
    full = weight.shape[0]
    outs = []
    for s, e, w in slices:
        y = F.linear(x[:, s:e], weight[:w], None if bias is None else bias[:w])
        outs.append(F.pad(y, (0, full - w)) if w < full else y)
    return torch.cat(outs, dim=1)


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
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, mlp_hidden)
        self.mlp.fc2 = nn.Linear(mlp_hidden, dim)
        self.alpha = nn.Parameter(torch.zeros(()))
        self.router = MoNERouter(dim, cfg, num_tasks) if has_router else None
        self.want_scores = False

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.router is not None:
            x = self.router(x, ctx)
        st: MoNEState = ctx.mone
        if st is None:
            raise RuntimeError("MoNE block before its router: no routing decision in this forward pass")
        r, n, d = x.shape
        h = self.norm1(x)
        qkv = _nested_linear_in(h, self.attn.qkv.weight, self.attn.qkv.bias, st.slices)  # [R, N, 3D]
        q, k, v = qkv.view(r, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        out, scores = attend(q, k, v, want_scores=self.want_scores, key_mask=key_mask)  # [R, H, N, d/H]
        if self.want_scores:
            ctx.attn_scores = scores
        out = out.transpose(1, 2).reshape(r, n, d)
        x = x + _nested_linear_out(out, self.attn.proj.weight, self.attn.proj.bias, st.slices)
        h = self.norm2(x)
        hidden = F.gelu(_nested_linear_in(h, self.mlp.fc1.weight, self.mlp.fc1.bias, st.slices))  # [R, N, 4D]
        y = _nested_linear_out(hidden, self.mlp.fc2.weight, self.mlp.fc2.bias, st.slices)
        return x + (self.alpha * st.gate + 1.0).unsqueeze(-1) * y

    def macs(self, n: int, capacity: tuple | None = None) -> int:
        """Multiply-accumulates per sequence of n tokens at a capacity distribution (default: the config's)."""
        d = self.attn.qkv.in_features
        hid = self.mlp.fc1.out_features
        e = len(capacity)
        sizes = group_sizes(n, capacity)
        proj = sum(sizes[j] * (d // 2 ** (e - 1 - j)) * (3 * d + d + 2 * hid) for j in range(e))
        router = self.router.macs(n) if self.router is not None else 0
        return proj + 2 * n * n * d + router
