"""Dense all-head projections for MoE attention: every head computed by one GEMM, only the k selected ever stored.

MoE attention's experts are attention heads: a query projection [D → d] and an output projection [d → D] each,
k of E per token. Routed (`squad.layers.experts.ops`), a token's input is read once per selected head and its k
output rows of width D are written and summed; here instead

- queries: ``Q = x @ [Wq_1 … Wq_E]`` (one GEMM for every head) with only each token's k selected heads written,
  [M, k, d];
- outputs: ONE output GEMM with all heads' weights stacked ([E·d, D]) over the [M, E·d] operand of the gated heads
  (each token's gated heads at their experts' columns, zero elsewhere), plus the shared bias;
- backward: the same GEMMs transposed (the heads' input gradient with the gates' gradient, the queries' input
  gradient plus the key/value head's in one GEMM, both weight gradients with the bias's).

The [M, E·d] operands are never in memory: the ops of `squad.kernels.heads` read and write the compact [M, k, d]
tensors through a per-token slot map ([M, E] int32, `head_slots`). E/k times the routed projections' FLOPs, each
token read once; which form a layer takes is a cost model's choice (`squad.layers.moe_attention.projection_costs`).
No sort, no plan, no host read, no atomics.
"""

from __future__ import annotations

import torch

from squad.kernels.heads import head_gather_mm, head_select_mm, head_wgrad


def head_slots(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, k] selected heads → the slot map [M, E] int32: ``slots[m, e] = j`` when slot j of token m selected head
    e, −1 where token m did not select e."""
    m, k = experts.shape
    slots = torch.full((m, num_experts), -1, dtype=torch.int32, device=experts.device)
    return slots.scatter_(1, experts, torch.arange(k, dtype=torch.int32, device=experts.device).expand(m, k))


class _DenseQueryKV(torch.autograd.Function):
    """q[m, j] = x[m] @ Wq[e_mj] (every head's query by one GEMM, the selected ones stored) and kv = x Wkvᵀ + bkv.

    The backward's input gradient is one GEMM over [dQ of every head | dkv] (dQ zero at the heads not selected)."""

    @staticmethod
    def forward(ctx, x, wq, wkv, bkv, slots, top_k):  # x [M, D], wq [E, D, d], wkv [2d, D], bkv [2d] | None
        q, _ = head_select_mm(x, wq, slots, top_k, None, None)  # [M, k, d]
        kv = torch.nn.functional.linear(x, wkv, bkv)  # [M, 2d]
        ctx.save_for_backward(x, wq, wkv, slots)
        ctx.has_bias = bkv is not None
        return q, kv

    @staticmethod
    def backward(ctx, dq, dkv):  # dq [M, k, d], dkv [M, 2d]
        x, wq, wkv, slots = ctx.saved_tensors
        dx = head_gather_mm(dq, slots, None, wq.transpose(1, 2), dkv, wkv, None)  # [M, D]
        dwq, _ = head_wgrad(dq, slots, None, x, wq.shape[0], True, False, wq.dtype)  # [E, D, d]
        dwkv = dkv.t() @ x
        dbkv = dkv.sum(0) if ctx.has_bias else None
        return dx, dwq, dwkv, dbkv, None, None


class _DenseGatedOutput(torch.autograd.Function):
    """y[m] = Σ_j g[m, j] · o[m, j] @ Wo[e_mj] + b, as one GEMM over the virtual [M, E·d] operand of gated heads."""

    @staticmethod
    def forward(ctx, o, wo, gates, bias, slots):  # o [M, k, d], wo [E, d, D], gates [M, k], bias [D]
        y = head_gather_mm(o, slots, gates, wo, None, None, bias)  # [M, D]
        ctx.save_for_backward(o, wo, gates, slots)
        return y

    @staticmethod
    def backward(ctx, dy):  # dy [M, D]
        o, wo, gates, slots = ctx.saved_tensors
        do, dgates = head_select_mm(dy, wo.transpose(1, 2), slots, o.shape[1], gates, o)  # g · dy Woᵀ, <dy Woᵀ, o>
        dwo, dbias = head_wgrad(o, slots, gates, dy, wo.shape[0], False, True, wo.dtype)
        return do, dwo, dgates.to(gates.dtype), dbias, None


def dense_query_kv(x: torch.Tensor, wq: torch.Tensor, wkv: torch.Tensor, bkv: torch.Tensor | None,
                   slots: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of the selected heads and the shared key/value head.

    Args:
        x: [M, D] tokens; wq: [E, D, d] every head's query weight; wkv, bkv: the key/value ``nn.Linear``'s
            [2d, D] weight and [2d] bias; slots: [M, E] slot map (`head_slots`); top_k: k.

    Returns:
        (q [M, k, d] in (token, slot) order, kv [M, 2d]).
    """
    return _DenseQueryKV.apply(x, wq, wkv, bkv, slots, top_k)


def dense_gated_output(o: torch.Tensor, wo: torch.Tensor, gates: torch.Tensor, bias: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """Σ_j g[m, j] · o[m, j] @ Wo[e_mj] + bias: the heads' outputs mixed by the gates.

    Args:
        o: [M, k, d] attention outputs in (token, slot) order (any strides); wo: [E, d, D]; gates: [M, k];
            bias: [D]; slots: [M, E] slot map.

    Returns:
        [M, D].
    """
    return _DenseGatedOutput.apply(o, wo, gates, bias, slots)
