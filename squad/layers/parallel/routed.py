"""The routed layers' expert computation across an expert-parallel group: the same plan → experts → combine as a
single-process layer, with `ExpertExchange` between the plan and the experts and again before the combine.

Every rank plans its own tokens over all E experts (global indices, the replicated routers' choices), sends the
rows to the ranks that hold their experts, runs its E/P local experts as grouped matmuls over what it received
(grouped by local expert: `ExpertExchange.local_plan`), sends the outputs back ungated, and combines them with the
gates exactly as the single-process layer does. Outputs and gradients equal the single-process layer's
(tests/test_expert_parallel.py, float64 on 2 and 4 gloo ranks).

The local experts run the ops of `squad.layers.experts` unchanged on the received rows — `expert_mlp`,
`dispatch_matmul`, `matmul_combine` with (token, slot) order = received order, k = 1, unit gates — so the CUDA path's
grouped-GEMM kernels serve them as they serve a single-process layer; the one host read of a layer is the count
exchange (`ExpertExchange`).
"""

from __future__ import annotations

import torch

from squad.layers.experts import (
    Dispatch,
    combine,
    dispatch_matmul,
    dispatch_tokens,
    from_slots,
    matmul_combine,
    plan_dispatch,
    to_slots,
)
from squad.layers.experts import (
    expert_mlp as local_expert_mlp,
)
from squad.layers.parallel.exchange import ExpertExchange
from squad.layers.parallel.groups import ExpertGroups


def plan_exchange(experts: torch.Tensor, num_experts: int, ep: ExpertGroups,
                  noop: bool = True) -> tuple[Dispatch, ExpertExchange]:
    """The layer's plan over all ``num_experts`` experts and its exchange (one count exchange: the layer's wait).

    Args:
        experts: [M, k] global expert of every (token, slot); indices >= num_experts are no-op or dropped slots.
        num_experts: E, divisible by ``ep.size``.
        ep: the expert-parallel layout.
        noop: slots may name no-op experts.
    """
    plan = plan_dispatch(experts, num_experts, host_sizes=False, noop=noop)
    return plan, ExpertExchange(plan, ep)


def expert_mlp(x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
               b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, ep: ExpertGroups,
               noop: bool = True, backend: str = "triton") -> torch.Tensor:
    """An MoE MLP whose experts are spread over an expert-parallel group.

    Args:
        x: [M, D] this rank's tokens.
        gates, experts: [M, k] the routers' decision (global expert indices; >= E: no-op/dropped slots).
        w1: [E/P, D, H], b1 [E/P, H] | None, w2 [E/P, H, D], b2 [E/P, D] | None: this rank's experts.
        ep: the layout (P = ep.size).
        noop: slots may name no-op experts.
        backend: the local experts' GEMMs on the kernel path (`squad.layers.experts.ops.expert_mlp`).

    Returns:
        [M, D] = Σ_slots gate · expert(x), as the single-process layer computes it.
    """
    plan, ex = plan_exchange(experts, w1.shape[0] * ep.size, ep, noop)
    rows = ex.to_experts(dispatch_tokens(x, plan))  # [A', D] received, source-major
    y = local_expert_mlp(rows, w1, b1, w2, b2, ex.unit_gates(rows), ex.local_plan,
                         backend)  # [A', D] received order, ungated
    return combine(ex.to_tokens(y), gates, plan)  # [M, D]


def head_queries(x: torch.Tensor, q: torch.Tensor, plan: Dispatch, ex: ExpertExchange) -> torch.Tensor:
    """MoE attention's query projections on the heads' ranks.

    Args:
        x: [M, D] tokens; q: [E/P, D, d] this rank's heads; plan, ex: `plan_exchange` of the layer.

    Returns:
        [M, k, d] the query of every (token, slot), in (token, slot) order.
    """
    rows = ex.to_experts(dispatch_tokens(x, plan))  # [A', D]
    qr = dispatch_matmul(rows, q, ex.local_plan, slot_order=True)  # [A', d] in received order
    return to_slots(ex.to_tokens(qr), plan)  # [M, k, d]


def head_outputs(out: torch.Tensor, o: torch.Tensor, gates: torch.Tensor, plan: Dispatch,
                 ex: ExpertExchange) -> torch.Tensor:
    """MoE attention's output projections on the heads' ranks, combined with the gates.

    Args:
        out: [M, k, d] attention output of every (token, slot); o: [E/P, d, D] this rank's heads; gates: [M, k];
            plan, ex: `plan_exchange` of the layer.

    Returns:
        [M, D] = Σ_slots gate · out · W_o[e] (no output bias).
    """
    rows = ex.to_experts(from_slots(out, plan))  # [A', d] received, source-major
    y = matmul_combine(rows, o, ex.unit_gates(rows), ex.local_plan, slot_order=True)  # [A', D] received order
    return combine(ex.to_tokens(y), gates, plan)  # [M, D]
