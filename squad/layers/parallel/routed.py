"""The routed layers' expert computation across an expert-parallel group: the same plan → experts → combine as a
single-process layer, with `ExpertExchange` between the plan and the experts and again before the combine.

Every rank plans its own tokens over all E experts (global indices, the replicated routers' choices), sends the
rows to the ranks that hold their experts, runs its E/P local experts as grouped matmuls over what it received
(grouped by local expert: `ExpertExchange.local_plan`), sends the outputs back ungated, and combines them with the
gates exactly as the single-process layer does. Outputs and gradients equal the single-process layer's
(tests/test_expert_parallel.py, float64 on 2 and 4 gloo ranks).

The local expert computation uses the ops of `squad.layers.experts` unchanged (CPU algorithm or the CUDA path, as the
plan says); the one host read of a layer is the count exchange (`ExpertExchange`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
               noop: bool = True) -> torch.Tensor:
    """An MoE MLP whose experts are spread over an expert-parallel group.

    Args:
        x: [M, D] this rank's tokens.
        gates, experts: [M, k] the routers' decision (global expert indices; >= E: no-op/dropped slots).
        w1: [E/P, D, H], b1 [E/P, H] | None, w2 [E/P, H, D], b2 [E/P, D] | None: this rank's experts.
        ep: the layout (P = ep.size).
        noop: slots may name no-op experts.

    Returns:
        [M, D] = Σ_slots gate · expert(x), as the single-process layer computes it.
    """
    plan, ex = plan_exchange(experts, w1.shape[0] * ep.size, ep, noop)
    rows = ex.to_experts(dispatch_tokens(x, plan))  # [A', D] received, source-major
    local = ex.local_plan
    h = F.gelu(dispatch_matmul(rows, w1, local, b1))  # [A', H] grouped by local expert
    y = matmul_combine(h, w2, ex.unit_gates(h), local, b2)  # [A', D] back in received order, ungated
    return combine(ex.to_tokens(y), gates, plan)  # [M, D]


def head_queries(x: torch.Tensor, q: torch.Tensor, plan: Dispatch, ex: ExpertExchange) -> torch.Tensor:
    """MoE attention's query projections on the heads' ranks.

    Args:
        x: [M, D] tokens; q: [E/P, D, d] this rank's heads; plan, ex: `plan_exchange` of the layer.

    Returns:
        [M, k, d] the query of every (token, slot), in (token, slot) order.
    """
    rows = ex.to_experts(dispatch_tokens(x, plan))  # [A', D]
    local = ex.local_plan
    qr = to_slots(dispatch_matmul(rows, q, local), local).flatten(0, 1)  # [A', d] in received order
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
    local = ex.local_plan
    y = matmul_combine(from_slots(rows.unsqueeze(1), local), o, ex.unit_gates(rows), local)  # [A', D]
    return combine(ex.to_tokens(y), gates, plan)  # [M, D]
