"""MoE MLP: E two-layer experts behind one noisy top-k router per task (Mod-Squad), with optional no-op experts
(MoDE, integrated variant) and optional capacity dropping.

Expert weights are stacked ([E, D, H] and [E, H, D]) and applied with grouped matmuls over tokens grouped by
expert once per layer (squad.layers.experts): the first projection gathers each expert's tokens itself
(`dispatch_matmul`), the second folds the gates in and sums the outputs back to the tokens (`matmul_combine`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config.model import MoEConfig
from squad.layers.base import RoutedLayer
from squad.layers.context import ForwardContext
from squad.layers.experts import dispatch_matmul, matmul_combine, plan_dispatch
from squad.layers.routing import Routing, TaskRouter


class ExpertMLP(nn.Module):
    """E two-layer GELU MLPs applied to routed tokens: experts take ``(x, gates, experts)``.

    Args:
        num_experts: E real experts (indices >= E in ``experts`` are no-op slots that contribute nothing).
        dim: token width D.
        hidden: hidden width per expert.
        bias: biases on both layers.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, dim)) if bias else None
        nn.init.trunc_normal_(self.w1, std=0.02)
        nn.init.trunc_normal_(self.w2, std=0.02)

    def forward(self, x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [M, D], gates/experts [M, k] → [M, D] = Σ_slots gate · expert(x)."""
        plan = plan_dispatch(experts, self.num_experts, host_sizes=False)
        h = F.gelu(dispatch_matmul(x, self.w1, plan, self.b1))  # [M·k, H], rows grouped by expert
        return matmul_combine(h, self.w2, gates, plan, self.b2)  # [M, D]


def apply_capacity(routing: Routing, num_experts: int, capacity_factor: float) -> Routing:
    """Drops slots beyond each expert's capacity ceil(cf · M·k / E) (earlier tokens first).

    Dropped slots are redirected to the no-op index ``num_experts`` (their gate stays but the output is zero),
    so the token keeps only its residual for that slot.
    """
    m, k = routing.experts.shape
    cap = math.ceil(capacity_factor * m * k / num_experts)
    flat = routing.experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    counts = torch.bincount(sorted_e, minlength=num_experts + 1)
    starts = counts.cumsum(0) - counts
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - starts[sorted_e]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    dropped = (pos >= cap) & (flat < num_experts)
    experts = torch.where(dropped, torch.full_like(flat, num_experts), flat).view(m, k)
    return Routing(routing.gates, experts, routing.probs)


class MoEMlp(RoutedLayer):
    """Mixture-of-experts MLP with one router per task.

    Args:
        dim: token width D.
        hidden: per-expert hidden width.
        cfg: the `MoEConfig` (experts, top-k, no-op experts, capacity, router settings).
        num_tasks: T routers.
    """

    kind = "moe"

    def __init__(self, dim: int, hidden: int, cfg: MoEConfig, num_tasks: int):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.router = TaskRouter(num_tasks, dim, cfg.num_experts + cfg.noop_experts, cfg.top_k, cfg.router)
        self.experts = ExpertMLP(cfg.num_experts, dim, hidden, cfg.bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        r, n, d = x.shape
        routing = self.router(x, ctx)
        ctx.stats.append(self.router.stats(self.layer_name, self.kind, routing, ctx, n))
        if self.cfg.capacity_factor > 0:
            routing = apply_capacity(routing, self.num_experts, self.cfg.capacity_factor)
        y = self.experts(x.reshape(r * n, d), routing.gates, routing.experts)
        return y.view(r, n, d)

    def macs(self, n: int) -> int:
        """Multiply-accumulates per sequence of n tokens (router + k experts per token; no-op slots counted)."""
        d = self.experts.w1.shape[1]
        h = self.experts.w1.shape[2]
        return n * d * self.router.num_experts + n * self.cfg.top_k * 2 * d * h
