"""MoE attention (MoA, Zhang et al. 2022, as Mod-Squad uses it).

Each expert is one attention head's query projection [D → d] and output projection [d → D]; the key and value
projections are shared (one head of width d). Each token's task router picks k heads, so attention runs as
multi-query attention: k query heads per token over one shared K/V head, and the outputs are mixed by the gates:

    y_i = Σ_{j ≤ k} g_ij · W_o^{e_ij} · Attn(W_q^{e_ij} x_i, K, V)

The query and output projections are grouped matmuls over tokens grouped by expert once (squad.layers.experts).
With ``expert_parallel`` P > 1 a training run shards the heads over P ranks (`squad.layers.parallel`): each token's
rows travel to their heads' ranks for the query projection and back, the attention runs where the token is, and the
head outputs travel again for the output projection (one count exchange serves both).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.config.model import MoAConfig
from squad.layers.attention import attend
from squad.layers.base import ExpertLayer, select_rows
from squad.layers.context import ForwardContext
from squad.layers.experts import dispatch_matmul, from_slots, matmul_combine, plan_dispatch, to_slots
from squad.layers.parallel import SINGLE, routed
from squad.layers.routing import TaskRouter


class MoEAttention(ExpertLayer):
    """MoA with per-task routers.

    Args:
        dim: token width D.
        cfg: experts, top-k, head width, router settings. The layer keeps it as built; `num_experts` and `top_k`
            give the current counts (fewer after `keep_experts`).
        num_tasks: T routers.
        qkv_bias: bias on the shared key/value projection.

    Attributes:
        ep: the expert-parallel layout once a training run sharded the heads (`SINGLE` before; ``cfg.expert_parallel``
            says how many ranks share them): ``q`` and ``o`` then hold this rank's E/P heads.
    """

    kind = "moa"
    expert_params = ("q", "o")  # stacked [E, ...] head weights (what expert parallelism shards)
    expert_parallel_key = "model.moa.expert_parallel"

    def __init__(self, dim: int, cfg: MoAConfig, num_tasks: int, qkv_bias: bool = True):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.router = TaskRouter(num_tasks, dim, cfg.num_experts, cfg.top_k, cfg.router)
        self.q = nn.Parameter(torch.empty(cfg.num_experts, dim, cfg.head_dim))  # [E, D, d]
        self.kv = nn.Linear(dim, 2 * cfg.head_dim, bias=qkv_bias)
        self.o = nn.Parameter(torch.empty(cfg.num_experts, cfg.head_dim, dim))  # [E, d, D]
        self.proj_bias = nn.Parameter(torch.zeros(dim))
        nn.init.trunc_normal_(self.q, std=0.02)
        nn.init.trunc_normal_(self.o, std=0.02)
        self.want_scores = False  # set by the model when the next block routes on this layer's attention
        self.expert_parallel = cfg.expert_parallel
        self.ep = SINGLE

    @property
    def num_experts(self) -> int:
        return self.q.shape[0] * self.ep.size

    def _select_experts(self, index: torch.Tensor) -> None:
        if self.ep.size > 1:
            raise ValueError(f"{self.layer_name}: a sharded MoE attention cannot drop heads: load the run as one "
                             f"single-process model (squad.load) first")
        self.q = select_rows(self.q, index)  # [K, D, d]
        self.o = select_rows(self.o, index)  # [K, d, D]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        r, n, d = x.shape
        k, dh = self.top_k, self.head_dim
        routing = self.route(x, ctx)
        if self.ep.size > 1:
            return self._forward_parallel(x, ctx, routing, key_mask)
        plan = plan_dispatch(routing.experts, self.num_experts, host_sizes=False, noop=False)  # heads only

        q = to_slots(dispatch_matmul(x.reshape(r * n, d), self.q, plan), plan)  # [M, k, d]
        q = q.view(r, n, k, dh).transpose(1, 2)  # [R, k, N, d]: slot j of every token is query head j
        kv = self.kv(x).view(r, n, 2, 1, dh).permute(2, 0, 3, 1, 4)  # [2, R, 1, N, d]
        want = self.want_scores
        out, scores = attend(q, kv[0], kv[1], want_scores=want, key_mask=key_mask)  # [R, k, N, d]
        if want:
            ctx.attn_scores = scores
        out = from_slots(out.transpose(1, 2).reshape(r * n, k, dh), plan)  # [M·k, d] grouped by head
        y = matmul_combine(out, self.o, routing.gates, plan)  # [M, D], a fresh tensor nobody saved
        return y.add_(self.proj_bias).view(r, n, d)

    def _forward_parallel(self, x: torch.Tensor, ctx: ForwardContext, routing, key_mask: torch.Tensor | None):
        """The forward with the heads spread over ``self.ep`` (`squad.layers.parallel.routed`): the same result."""
        r, n, d = x.shape
        k, dh = self.top_k, self.head_dim
        plan, ex = routed.plan_exchange(routing.experts, self.num_experts, self.ep, noop=False)
        q = routed.head_queries(x.reshape(r * n, d), self.q.to(x.dtype), plan, ex)  # [M, k, d]
        q = q.view(r, n, k, dh).transpose(1, 2)  # [R, k, N, d]
        kv = self.kv(x).view(r, n, 2, 1, dh).permute(2, 0, 3, 1, 4)  # [2, R, 1, N, d]
        out, scores = attend(q, kv[0], kv[1], want_scores=self.want_scores, key_mask=key_mask)  # [R, k, N, d]
        if self.want_scores:
            ctx.attn_scores = scores
        out = out.transpose(1, 2).reshape(r * n, k, dh)  # [M, k, d]
        y = routed.head_outputs(out, self.o.to(x.dtype), routing.gates, plan, ex)  # [M, D]
        return (y + self.proj_bias).view(r, n, d)

    def macs(self, tokens: int, capacity: float | None = None) -> int:
        """Multiply-accumulates per sequence of ``tokens`` tokens: router, k query heads, the shared key/value
        head, attention over the k heads and their output projections. ``capacity`` is unused."""
        n, d = tokens, self.kv.in_features
        k, dh = self.top_k, self.head_dim
        return self.router.macs(n) + n * k * d * dh + n * d * 2 * dh + 2 * n * n * k * dh + n * k * dh * d
