"""The ops MoE layers call: each runs the CPU algorithm (`squad.layers.experts.cpu`) or the kernel path
(`squad.layers.experts.scatter`), as the layer's `Dispatch` plan says (``plan.sync_free``).

An MoE layer is three separable steps: the plan (`plan_dispatch`: (token, slot) pairs grouped by expert), the
expert computation (grouped matmuls over the grouped rows) and the combine (each token's k outputs, gated, summed).
`dispatch_matmul` fuses the dispatch into the first expert matmul and `matmul_combine` the combine into the last;
`expert_mlp` is a whole MoE MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.layers.experts import cpu, permuted, scatter
from squad.layers.experts.plan import Dispatch


def dispatch_matmul(x: torch.Tensor, w: torch.Tensor, plan: Dispatch, bias: torch.Tensor | None = None,
                    slot_order: bool = False) -> torch.Tensor:
    """Tokens to their experts and through one projection: ``grouped_matmul(dispatch_tokens(x), w, bias)`` fused.

    Args:
        x: [M, Din] tokens.
        w: [E, Din, Dout] expert weights.
        plan: the layer's `Dispatch`.
        bias: [E, Dout] or None.
        slot_order: return the rows in (token, slot) order ([M, k, Dout] flattened) instead of expert order.

    Returns:
        [M·k, Dout] rows (rows of no-op slots are zero).
    """
    if plan.sync_free:
        return scatter.dispatch_matmul(x, w, plan, bias, slot_order)
    rows = cpu.dispatch_matmul(x, w, plan, bias)
    return cpu.to_slots(rows, plan).flatten(0, 1) if slot_order else rows


def matmul_combine(rows: torch.Tensor, w: torch.Tensor, gates: torch.Tensor, plan: Dispatch,
                   bias: torch.Tensor | None = None, slot_order: bool = False) -> torch.Tensor:
    """One grouped projection of routed rows, then back to the tokens mixed by the gates:
    ``combine(grouped_matmul(rows, w, bias), gates)`` fused.

    Args:
        rows: [M·k, Din] in expert-sorted order, or in (token, slot) order with ``slot_order``.
        w: [E, Din, Dout] expert weights.
        gates: [M, k] gate weight of each slot.
        plan: the layer's `Dispatch`.
        bias: [E, Dout] or None.
        slot_order: ``rows`` are in (token, slot) order.

    Returns:
        [M, Dout] = Σ_slots gate · (row @ w[e] + b[e]); no-op slots contribute nothing.
    """
    if plan.sync_free:
        return scatter.matmul_combine(rows, w, gates, plan, bias, slot_order)
    if slot_order:
        rows = cpu.from_slots(rows.view(-1, plan.k, rows.shape[1]), plan)
    return cpu.matmul_combine(rows, w, gates, plan, bias)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
               b2: torch.Tensor | None, gates: torch.Tensor, plan: Dispatch, backend: str = "triton") -> torch.Tensor:
    """E two-layer GELU MLPs on routed tokens: Σ_slots gate · (gelu(x W1[e] + b1[e]) W2[e] + b2[e]).

    Args:
        x: [M, D] tokens; w1 [E, D, H], b1 [E, H] | None, w2 [E, H, D], b2 [E, D] | None.
        gates: [M, k]; plan: the layer's `Dispatch`.
        backend: the kernel path's expert GEMMs (``plan.sync_free``): ``triton`` (`scatter`: two launches forward,
            four backward, bias, GELU and the gate inside them) or ``grouped_mm`` (`permuted`: torch's grouped GEMM
            on permuted rows); the CPU algorithm ignores it. Layers resolve ``auto`` first (`squad.kernels.choice`).

    Returns:
        [M, D].
    """
    if backend not in ("triton", "grouped_mm"):
        raise ValueError(f"expert_mlp: backend must be 'triton' or 'grouped_mm', got {backend!r}")
    if plan.sync_free and backend == "grouped_mm":
        return permuted.permuted_mlp(x, w1, b1, w2, b2, gates, plan)
    if plan.sync_free:
        return scatter.scatter_mlp(x, w1, b1, w2, b2, gates, plan)
    h = F.gelu(cpu.dispatch_matmul(x, w1, plan, b1))  # [M·k, H], rows grouped by expert
    return cpu.matmul_combine(h, w2, gates, plan, b2)  # [M, D]
