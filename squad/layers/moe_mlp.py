"""MoE MLP: E two-layer experts behind one noisy top-k router per task (Mod-Squad), with optional no-op experts
(MoDE, integrated variant) and optional capacity dropping.

Expert weights are stacked ([E, D, H] and [E, H, D]) and applied with grouped matmuls over tokens grouped by
expert once per layer (squad.layers.experts): the first projection gathers each expert's tokens itself
(`dispatch_matmul`), the second folds the gates in and sums the outputs back to the tokens (`matmul_combine`).
With ``expert_parallel`` P > 1 a training run shards the experts over P ranks (`squad.layers.parallel`): each rank
holds E/P of them and tokens travel to their experts' ranks and back (`squad.layers.parallel.routed.expert_mlp`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from squad.config.model import MoEConfig
from squad.kernels.choice import resolve
from squad.layers.base import ExpertLayer, select_rows
from squad.layers.context import ForwardContext
from squad.layers.experts import expert_mlp, plan_dispatch, takes_kernel_path
from squad.layers.experts.permuted import library_runs
from squad.layers.parallel import SINGLE, routed
from squad.layers.routing import Routing, TaskRouter


class ExpertMLP(nn.Module):
    """E two-layer GELU MLPs applied to routed tokens: experts take ``(x, gates, experts)``.

    Args:
        num_experts: E real experts (indices >= E in ``experts`` are no-op slots that contribute nothing).
        dim: token width D.
        hidden: hidden width per expert.
        bias: biases on both layers.
        expert_parallel: P, the ranks a training run spreads the experts over (`squad.layers.parallel.shard_model`;
            the layer is built whole and sharded then).
        kernel: the expert GEMMs on the kernel path, ``auto | grouped_mm | triton`` (``model.moe.kernel``;
            `backend` resolves ``auto``).

    Attributes:
        ep: the expert-parallel layout once sharded (`SINGLE` before): ``w1`` ... then hold this rank's E/P experts.
    """

    expert_params = ("w1", "w2", "b1", "b2")  # stacked [E, ...] expert weights (what expert parallelism shards)
    expert_parallel_key = "model.moe.expert_parallel"

    def __init__(self, num_experts: int, dim: int, hidden: int, bias: bool = True, expert_parallel: int = 1,
                 kernel: str = "auto"):
        super().__init__()
        self.num_experts = num_experts
        self.expert_parallel = expert_parallel
        self.kernel = kernel
        self.ep = SINGLE
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.b1 = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, dim)) if bias else None
        nn.init.trunc_normal_(self.w1, std=0.02)
        nn.init.trunc_normal_(self.w2, std=0.02)

    def select(self, index: torch.Tensor) -> None:
        """Keeps experts ``index`` [K] only, in that order (new parameters; real or meta tensors)."""
        if self.ep.size > 1:
            raise ValueError("a sharded MoE MLP cannot drop experts: load the run as one single-process model "
                             "(squad.load) first")
        for name in ("w1", "w2", "b1", "b2"):
            setattr(self, name, select_rows(getattr(self, name), index))
        self.num_experts = index.numel()

    def backend(self, x: torch.Tensor, k: int) -> str:
        """The expert GEMMs ``x`` [M, D] with k slots per token take on the kernel path: ``kernel`` unless it is
        ``auto``, else what a GPU of this kind measured faster at this shape (`squad.kernels.choice`), else
        ``grouped_mm`` where the library op runs these operands, else ``triton``. (The CPU algorithm has one.)"""
        d, h = self.w1.shape[1:]
        dims = {"E": self.num_experts, "D": d, "H": h, "k": k}
        return resolve("moe_mlp", self.kernel, dims, x.dtype, x.device, library_runs(x.device, x.dtype, d, h))

    def forward(self, x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, noop: bool = True) -> torch.Tensor:
        """x [M, D], gates/experts [M, k] → [M, D] = Σ_slots gate · expert(x); ``noop=False`` promises that no slot
        names a no-op expert.

        Three separable steps, the seam expert parallelism cuts at: the plan (`plan_dispatch`: the (token, slot)
        pairs grouped by expert, ``plan.counts`` rows per expert), the experts on grouped rows, and the combine (each
        token's k outputs, gated and summed). `expert_mlp` runs them fused on one device (the gather inside the first
        grouped GEMM, the gate and the way back to (token, slot) order inside the second). With the experts sharded
        over ``self.ep`` the same steps run apart (`squad.layers.parallel.routed.expert_mlp`): the rows go to their
        experts' ranks by the plan's counts, the local experts run `expert_mlp` on what arrived, the outputs come
        back and are combined here."""
        backend = self.backend(x, experts.shape[1]) if takes_kernel_path(x.device) else "triton"
        if self.ep.size > 1:  # float32 master shards, used in the tokens' dtype
            w = [None if t is None else t.to(x.dtype) for t in (self.w1, self.b1, self.w2, self.b2)]
            return routed.expert_mlp(x, gates, experts, *w, self.ep, noop, backend)
        plan = plan_dispatch(experts, self.num_experts, host_sizes=False, noop=noop)
        return expert_mlp(x, self.w1, self.b1, self.w2, self.b2, gates, plan, backend)  # [M, D]


def apply_capacity(routing: Routing, num_experts: int, capacity_factor: float) -> Routing:
    """Drops slots beyond each expert's capacity ceil(cf · M·k / E) (earlier tokens first).

    Dropped slots are redirected to the no-op index ``num_experts`` (their gate stays but the output is zero),
    so the token keeps only its residual for that slot. A slot's place in its expert's queue is its position in
    the sorted order minus the first position of its expert (a binary search): no histogram, no host read.
    """
    m, k = routing.experts.shape
    cap = math.ceil(capacity_factor * m * k / num_experts)
    flat = routing.experts.reshape(-1)
    sorted_e, order = torch.sort(flat, stable=True)
    pos_sorted = torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(sorted_e, sorted_e)
    pos = torch.empty_like(pos_sorted).scatter_(0, order, pos_sorted)
    dropped = (pos >= cap) & (flat < num_experts)
    experts = torch.where(dropped, torch.full_like(flat, num_experts), flat).view(m, k)
    return Routing(routing.gates, experts, routing.probs)


class MoEMlp(ExpertLayer):
    """Mixture-of-experts MLP with one router per task.

    Args:
        dim: token width D.
        hidden: per-expert hidden width.
        cfg: the `MoEConfig` (experts, top-k, no-op experts, capacity, router settings). The layer keeps it as
            built; `num_experts` and `top_k` give the current counts (fewer after `keep_experts`).
        num_tasks: T routers.
    """

    kind = "moe"

    def __init__(self, dim: int, hidden: int, cfg: MoEConfig, num_tasks: int):
        super().__init__()
        self.cfg = cfg
        self.router = TaskRouter(num_tasks, dim, cfg.num_experts + cfg.noop_experts, cfg.top_k, cfg.router)
        self.experts = ExpertMLP(cfg.num_experts, dim, hidden, cfg.bias, cfg.expert_parallel, cfg.kernel)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def _select_experts(self, index: torch.Tensor) -> None:
        self.experts.select(index)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        r, n, d = x.shape
        routing = self.route(x, ctx)
        if self.cfg.capacity_factor > 0:
            routing = apply_capacity(routing, self.num_experts, self.cfg.capacity_factor)
        noop = self.router.choices > self.num_experts or self.cfg.capacity_factor > 0  # slots that skip the MLP
        y = self.experts(x.reshape(r * n, d), routing.gates, routing.experts, noop)
        return y.view(r, n, d)

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of ``tokens`` tokens: the router plus k experts per token (no-op slots
        and capacity drops counted as computed). ``capacity`` is unused (the layer has no token budget)."""
        d, h = self.experts.w1.shape[1:]  # a shard's too
        return self.router.macs(tokens) + tokens * self.top_k * 2 * d * h
