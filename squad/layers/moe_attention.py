"""MoE attention (MoA, Zhang et al. 2022, as Mod-Squad uses it).

Each expert is one attention head's query projection [D → d] and output projection [d → D]; the key and value
projections are shared (one head of width d). Each token's task router picks k heads, so attention runs as
multi-query attention: k query heads per token over one shared K/V head, and the outputs are mixed by the gates:

    y_i = Σ_{j ≤ k} g_ij · W_o^{e_ij} · Attn(W_q^{e_ij} x_i, K, V)

The query and output projections are grouped matmuls over tokens grouped by expert once (squad.layers.experts),
in (token, slot) order on both sides of the attention: slot j of every token is query head j.

On the CUDA path a layer takes one of two forms of these projections: routed (grouped GEMMs over the expert-sorted
(token, slot) rows that read a token once per selected head and write k rows of width D per token,
`squad.layers.experts.ops`) or dense all-head (every head's query by one GEMM, only the selected ones kept; one
output GEMM over the [M, E·d] operand of the gated heads: `squad.layers.experts.heads`), the latter on plain GEMMs
(``cublas``) or on squad's Triton head kernels (``heads``). ``model.moa.kernel`` names one, or ``auto`` takes the one
`make gpu-check` measured faster at the layer's shape on this GPU (`squad.kernels.choice`), and until a GPU has
measured it the form a cost model prices lower for its E, k, d and D (`projection_costs`; the dense form on
``cublas``). On the CPU the routed form's CPU algorithm runs.

With ``expert_parallel`` P > 1 a training run shards the heads over P ranks (`squad.layers.parallel`) and the routed
form runs across them: each token's rows travel to their heads' ranks for the query projection and back, the
attention runs where the token is, and the head outputs travel again for the output projection (one count exchange
serves both).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from squad.config.model import MoAConfig
from squad.kernels.choice import resolve
from squad.layers.attention import attend
from squad.layers.base import ExpertLayer, select_rows
from squad.layers.context import ForwardContext
from squad.layers.experts import dispatch_matmul, matmul_combine, plan_dispatch, takes_kernel_path
from squad.layers.experts.heads import (
    HeadIndex,
    dense_gated_output,
    dense_query_kv,
    head_slots,
    library_gated_output,
    library_query_kv,
)
from squad.layers.parallel import SINGLE, routed
from squad.layers.routing import TaskRouter

GPU_MATMUL_FLOPS = 600e12
"""Matmul FLOP/s of the GPU cost model that chooses the projections' form (an H100's bf16 dense rate, derated)."""
GPU_BANDWIDTH = 2.8e12
"""Bytes/s of the same model (an H100's HBM3, derated)."""
GPU_LAUNCH = 4e-6
"""Seconds per kernel launch of the same model."""


def projection_costs(num_experts: int, top_k: int, head_dim: int, dim: int, tokens: int,
                     itemsize: int = 2) -> dict[str, float]:
    """Modelled GPU seconds of MoE attention's query and output projections, forward and backward, in each form
    (with the key/value head's input gradient, which the dense form adds in its input-gradient GEMM).

    Each launch costs max(FLOPs / `GPU_MATMUL_FLOPS`, bytes / `GPU_BANDWIDTH`) + `GPU_LAUNCH`, its bytes every
    operand read and every result written once, a token's row read through an index once per row that reads it:
    the prices `squad.bench.traffic` gives the same launches (tests/test_layer_traffic.py checks that this model
    ranks the two forms as the recorder does).

    Args:
        num_experts, top_k, head_dim, dim: E, k, d, D.
        tokens: M tokens in the call.
        itemsize: bytes per element (2 for bf16).

    Returns:
        {"routed": seconds, "dense": seconds}.
    """
    e, k, d, big_d, m = num_experts, top_k, head_dim, dim, tokens

    def launch(flops_per_token: float, elements_per_token: float, weights: float = 0.0) -> float:
        elements = m * elements_per_token + weights * e * d * big_d  # ``weights``: how many [E, d, D] read/written
        return max(m * flops_per_token / GPU_MATMUL_FLOPS, elements * itemsize / GPU_BANDWIDTH) + GPU_LAUNCH

    head = 2 * k * d * big_d  # FLOPs of one routed projection direction per token
    k_sum = launch(0, k * big_d + big_d) if k > 1 else 0.0  # each token's k rows of width D summed
    routed = (launch(head, k * big_d + k * d, 1)  # queries: each token's row read once per head
              + 2 * (launch(head, k * d + k * big_d, 1) + k_sum)  # output forward, query input gradient: k rows each
              + launch(head, k * big_d + 2 * k * d, 1)  # output projection's input gradient (and the gate's)
              + 2 * launch(head, k * big_d + k * d, 1)  # the two weight gradients
              + 2 * launch(0, 3 * big_d)  # the output bias added, and one more input-gradient sum (x read twice)
              + launch(0, big_d)  # the output bias's gradient
              + launch(4 * d * big_d, 2 * d + big_d)  # the key/value head's input gradient (dense: in its dx GEMM)
              + 13 * GPU_LAUNCH)  # the plan (sort, permutations, group ends) and the gates' permutations
    full = 2 * e * d * big_d  # FLOPs of one all-head GEMM per token
    slots, gates, ids = e * 4 / itemsize, k * 4 / itemsize, k * 8 / itemsize  # int32 slot map, fp32 gates, int64 ids
    dense = (launch(full, big_d + slots + k * d, 1)  # queries of the selected heads
             + launch(full, k * d + gates + slots + big_d, 1)  # one output GEMM over the gated heads, + bias
             + launch(full, big_d + slots + 2 * gates + 2 * k * d, 1)  # the heads' input gradient, with the gates'
             + launch(full, k * d + gates + slots + big_d, 1)  # the output weights' gradient, with the bias's
             + launch(full + 4 * d * big_d, k * d + slots + 2 * d + big_d, 1)  # dx: the queries' + key/value head's
             + launch(full, k * d + slots + big_d, 1)  # the query weights' gradient
             + launch(0, slots) + launch(0, ids + 2 * slots) + GPU_LAUNCH)  # the slot map: fill, scatter, arange
    return {"routed": routed, "dense": dense}


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

    def projections(self, tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
        """The projections' backend for ``tokens`` tokens of ``dtype`` on ``device``: ``routed`` off the kernel path
        (the CPU algorithm), else ``model.moa.kernel`` — ``auto`` resolved by `squad.kernels.choice` (a GPU's
        measurement at this shape, else ``cublas`` where `projection_costs` prices the dense form lower, else
        ``routed``)."""
        if not takes_kernel_path(device):
            return "routed"
        e, k, dh, d = self.num_experts, self.top_k, self.head_dim, self.kv.in_features
        costs = projection_costs(e, k, dh, d, tokens, dtype.itemsize)
        modelled = "cublas" if costs["dense"] < costs["routed"] else "routed"
        return resolve("moa", self.cfg.kernel, {"E": e, "D": d, "d": dh, "k": k}, dtype, device, unmeasured=modelled)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        r, n, d = x.shape
        k, dh = self.top_k, self.head_dim
        routing = self.route(x, ctx)
        if self.ep.size > 1:
            return self._forward_parallel(x, ctx, routing, key_mask)
        xs = x.reshape(r * n, d)
        form = self.projections(r * n, x.device, x.dtype)
        if form == "cublas":
            index = HeadIndex.of(routing.experts, self.num_experts)  # the gathers of the all-head GEMMs
            q, kv = library_query_kv(xs, self.q, self.kv.weight, self.kv.bias, index)  # [M, k, d], [M, 2d]
        elif form == "heads":
            slots = head_slots(routing.experts, self.num_experts)  # [M, E]: each head's slot in a token, or -1
            q, kv = dense_query_kv(xs, self.q, self.kv.weight, self.kv.bias, slots, k)  # [M, k, d], [M, 2d]
        else:
            plan = plan_dispatch(routing.experts, self.num_experts, host_sizes=False, noop=False)  # heads only
            q = dispatch_matmul(xs, self.q, plan, slot_order=True)  # [M·k, d] in (token, slot) order
            kv = self.kv(xs)  # [M, 2d]
        q = q.view(r, n, k, dh).transpose(1, 2)  # [R, k, N, d]: slot j of every token is query head j
        kv = kv.view(r, n, 2, 1, dh).permute(2, 0, 3, 1, 4)  # [2, R, 1, N, d]
        want = self.want_scores
        out, scores = attend(q, kv[0], kv[1], want_scores=want, key_mask=key_mask)  # [R, k, N, d]
        if want:
            ctx.attn_scores = scores
        out = out.transpose(1, 2).reshape(r * n, k, dh)  # [M, k, d] in (token, slot) order
        if form == "cublas":
            return library_gated_output(out, self.o, routing.gates, self.proj_bias, index).view(r, n, d)
        if form == "heads":
            return dense_gated_output(out, self.o, routing.gates, self.proj_bias, slots).view(r, n, d)
        y = matmul_combine(out.view(r * n * k, dh), self.o, routing.gates, plan, slot_order=True)  # [M, D], fresh
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
