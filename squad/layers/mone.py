"""Mixture of Nested Experts (Jain et al. 2024): every token goes through a nested slice of each block.

Expert j of E uses the first d_j = D / 2^(E-1-j) features of every in- and out-projection (attention qkv/proj,
MLP fc1/fc2) and pads its output back to D; QKᵀV runs at full width and the MLP hidden stays at full width. One
router (per task) at the first MoNE block assigns tokens with Expert Preferred Routing under a capacity
distribution solved from the effective capacity e_c; its decision is reused by every later MoNE block. Tokens are
permuted ONCE so each expert's tokens are contiguous in every row (the group sizes are static for a given N and
e_c), so each width runs dense matmuls; the model undoes the permutation before the heads.

Memory layout: the blocks keep the routed tokens token-major ([N, R, D] in memory, handed between blocks as the
[R, N, D] view), so the rows of one expert group over the whole batch form ONE contiguous [n_j·R, D] block. Each
nested projection is then one matmul per group that reads its feature slice in place and writes into a
preallocated output (`nested_linear_in` / `nested_linear_out`): no concatenation, padding or slicing copies.

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
        hard = F.one_hot(expert, e).float().sum(0).expand(r, e)  # [R, E] tokens per expert
        tokens = ctx.per_task_sum(torch.full((r,), float(n), device=x.device))
        ctx.stats.append(RouterStats(self.layer_name, "mone", ctx.per_task_sum(probs.sum(1)),
                                     ctx.per_task_sum(hard), tokens, 1))
        xt = x.transpose(0, 1)  # [N, R, D] view
        routed = torch.gather(xt, 0, order.t().unsqueeze(-1).expand(n, r, d))  # [N, R, D] token-major memory
        return routed.transpose(0, 1)  # [R, N, D] in routed order

    def macs(self, n: int) -> int:
        return n * self.dim * self.cfg.num_experts


class _NestedLinearIn(torch.autograd.Function):
    """out[rows of group g] = x[rows of g, :w_g] @ W[:, :w_g]ᵀ + b: the first w_g input features, full output.

    Works on 2-D token-major blocks (each group's rows contiguous), reading the feature slice in place (a strided
    matmul operand) and writing each group's rows straight into one preallocated output.
    """

    @staticmethod
    def forward(ctx, x, w, b, blocks):  # x [T, Din], w [C, Din], b [C] | None, blocks: (row start, row end, width)
        out = x.new_empty(x.shape[0], w.shape[0])  # [T, C]
        for s, e, k in blocks:
            if b is None:
                torch.mm(x[s:e, :k], w[:, :k].t(), out=out[s:e])
            else:
                torch.addmm(b, x[s:e, :k], w[:, :k].t(), out=out[s:e])
        ctx.save_for_backward(x, w)
        ctx.blocks, ctx.has_bias = blocks, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [T, C]
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        for s, e, k in ctx.blocks:
            if dx is not None:
                torch.mm(grad[s:e], w[:, :k], out=dx[s:e, :k])
                if k < x.shape[1]:
                    dx[s:e, k:].zero_()
            if dw is not None:
                dw[:, :k].addmm_(grad[s:e].t(), x[s:e, :k])
        db = grad.sum(0) if (need_b and ctx.has_bias) else None
        return dx, dw, db, None


class _NestedLinearOut(torch.autograd.Function):
    """out[rows of group g, :w_g] = x[rows of g] @ W[:w_g]ᵀ + b[:w_g]; the features past w_g are zero (the pad)."""

    @staticmethod
    def forward(ctx, x, w, b, blocks):  # x [T, C], w [Dout, C], b [Dout] | None
        full = w.shape[0]
        out = x.new_empty(x.shape[0], full)  # [T, Dout]
        for s, e, k in blocks:
            if b is None:
                torch.mm(x[s:e], w[:k].t(), out=out[s:e, :k])
            else:
                torch.addmm(b[:k], x[s:e], w[:k].t(), out=out[s:e, :k])
            if k < full:
                out[s:e, k:].zero_()
        ctx.save_for_backward(x, w)
        ctx.blocks, ctx.has_bias = blocks, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [T, Dout]
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(w) if need_w else None
        db = w.new_zeros(w.shape[0]) if (need_b and ctx.has_bias) else None
        for s, e, k in ctx.blocks:
            g = grad[s:e, :k]
            if dx is not None:
                torch.mm(g, w[:k], out=dx[s:e])
            if dw is not None:
                dw[:k].addmm_(g.t(), x[s:e])
            if db is not None:
                db[:k] += g.sum(0)
        return dx, dw, db, None


def nested_linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Nested input projection: rows ``s:e`` use the first ``w`` input features (``nn.Linear`` weight layout).

    Args:
        x: [T, Din] token rows, each group's rows contiguous.
        weight: [C, Din]; bias: [C] or None.
        blocks: (row start, row end, width) per group, covering every row.

    Returns:
        [T, C].
    """
    return _NestedLinearIn.apply(x, weight, bias, blocks)


def nested_linear_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      blocks: list[tuple[int, int, int]]) -> torch.Tensor:
    """Nested output projection: rows ``s:e`` produce the first ``w`` output features, zero-padded to full width.

    Args:
        x: [T, C] token rows, each group's rows contiguous.
        weight: [Dout, C]; bias: [Dout] or None.
        blocks: (row start, row end, width) per group, covering every row.

    Returns:
        [T, Dout].
    """
    return _NestedLinearOut.apply(x, weight, bias, blocks)


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
        """x [R, N, D] in routed order → [R, N, D], laid out token-major in memory (see the module docstring)."""
        if self.router is not None:
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
        h = self.norm1(x2)
        qkv = nested_linear_in(h, self.attn.qkv.weight, self.attn.qkv.bias, blocks)  # [T, 3D]
        q, k, v = qkv.view(n, r, 3, self.num_heads, d // self.num_heads).permute(2, 1, 3, 0, 4).unbind(0)
        out, scores = attend(q, k, v, want_scores=self.want_scores, key_mask=key_mask)  # [R, H, N, d/H]
        if self.want_scores:
            ctx.attn_scores = scores
        out = out.permute(2, 0, 1, 3).reshape(n * r, d)  # [T, D] token-major
        z = x2 + nested_linear_out(out, self.attn.proj.weight, self.attn.proj.bias, blocks)
        h = self.norm2(z)
        hidden = F.gelu(nested_linear_in(h, self.mlp.fc1.weight, self.mlp.fc1.bias, blocks))  # [T, 4D]
        y = nested_linear_out(hidden, self.mlp.fc2.weight, self.mlp.fc2.bias, blocks)  # [T, D]
        scale = (self.alpha * st.gate.t() + 1.0).reshape(n * r, 1)  # [T, 1] = α · r + 1
        return torch.addcmul(z, y, scale).view(n, r, d).transpose(0, 1)

    def macs(self, n: int, capacity: tuple | None = None) -> int:
        """Multiply-accumulates per sequence of n tokens at a capacity distribution (default: the config's)."""
        d = self.attn.qkv.in_features
        hid = self.mlp.fc1.out_features
        e = len(capacity)
        sizes = group_sizes(n, capacity)
        proj = sum(sizes[j] * (d // 2 ** (e - 1 - j)) * (3 * d + d + 2 * hid) for j in range(e))
        router = self.router.macs(n) if self.router is not None else 0
        return proj + 2 * n * n * d + router
