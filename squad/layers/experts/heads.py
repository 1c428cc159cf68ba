"""Dense all-head projections for MoE attention: every head computed by one GEMM, the k selected kept.

MoE attention's experts are attention heads: a query projection [D → d] and an output projection [d → D] each,
k of E per token. Routed (`squad.layers.experts.ops`), a token's input is read once per selected head and its k
output rows of width D are written and summed; here instead

- queries: ``Q = x @ [Wq_1 … Wq_E]`` ([M, E·d], one GEMM for every head), then each token's k selected heads
  (``S @ Q`` per token, S [k, E] one-hot);
- outputs: each token's gated heads placed at their experts' columns of an [M, E·d] buffer (zero elsewhere:
  ``Gᵀ @ o`` per token, G = S · gates) and ONE output GEMM with all heads' weights stacked ([E·d, D]) plus the
  shared bias.

E/k times the routed projections' FLOPs, E·d values per token instead of k·D; which of the two a layer takes is a
cost model's choice (`squad.layers.moe_attention.projection_costs`). No sort, no plan, no host read, no atomics:
plain matmuls and batched matmuls, on any device.
"""

from __future__ import annotations

import torch


def head_selection(experts: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, k] selected heads → S [M, k, E] one-hot (``dtype``): S[m, j, e] = 1 when slot j of token m is head e."""
    m, k = experts.shape
    return torch.zeros(m, k, num_experts, dtype=dtype, device=experts.device).scatter_(2, experts.unsqueeze(-1), 1)


class _DenseQueryKV(torch.autograd.Function):
    """q[m, j] = x[m] @ Wq[e_mj] (every head's query by one GEMM, then the selected ones) and kv = x Wkvᵀ + bkv.

    The backward adds both input gradients in one buffer (``dx = dkv Wkv``, then ``dx += dQ Wqᵀ`` in place)."""

    @staticmethod
    def forward(ctx, x, wq, wkv, bkv, select):  # x [M, D], wq [E, D, d], wkv [2d, D], bkv [2d] | None, S [M, k, E]
        m, dim = x.shape
        e, _, d = wq.shape
        wq_all = wq.permute(1, 0, 2).reshape(dim, e * d)  # [D, E·d]: head e's columns e·d .. (e + 1)·d
        q = torch.bmm(select, (x @ wq_all).view(m, e, d))  # [M, k, d]: the selected heads' queries
        kv = torch.nn.functional.linear(x, wkv, bkv)  # [M, 2d]
        ctx.save_for_backward(x, wq_all, wkv, select)
        ctx.has_bias = bkv is not None
        return q, kv

    @staticmethod
    def backward(ctx, dq, dkv):  # dq [M, k, d], dkv [M, 2d]
        x, wq_all, wkv, select = ctx.saved_tensors
        m, dim = x.shape
        e = select.shape[2]
        d = dq.shape[2]
        dq_all = torch.bmm(select.transpose(1, 2), dq).view(m, e * d)  # [M, E·d], zero at heads not selected
        dx = dkv @ wkv
        dx.addmm_(dq_all, wq_all.t())
        dwq = (x.t() @ dq_all).view(dim, e, d).permute(1, 0, 2)  # [E, D, d]
        dwkv = dkv.t() @ x
        dbkv = dkv.sum(0) if ctx.has_bias else None
        return dx, dwq, dwkv, dbkv, None


class _DenseGatedOutput(torch.autograd.Function):
    """y[m] = Σ_j g[m, j] · o[m, j] @ Wo[e_mj] + b, as one GEMM over the [M, E·d] buffer of gated heads."""

    @staticmethod
    def forward(ctx, o, wo, gates, bias, select):  # o [M, k, d], wo [E, d, D], gates [M, k], bias [D], S [M, k, E]
        m, k, d = o.shape
        e, _, dim = wo.shape
        gated = select * gates.to(o.dtype).unsqueeze(-1)  # [M, k, E]: g at each slot's head
        buffer = torch.bmm(gated.transpose(1, 2), o).view(m, e * d)  # [M, E·d]: gated heads at their columns
        y = torch.addmm(bias, buffer, wo.reshape(e * d, dim))
        ctx.save_for_backward(o, wo, gates, select, buffer)
        return y

    @staticmethod
    def backward(ctx, dy):  # dy [M, D]
        o, wo, gates, select, buffer = ctx.saved_tensors
        m, k, d = o.shape
        e, _, dim = wo.shape
        dbuffer = dy @ wo.reshape(e * d, dim).t()  # [M, E·d]
        dwo = (buffer.t() @ dy).view(e, d, dim)
        d_heads = torch.bmm(select, dbuffer.view(m, e, d))  # [M, k, d]: dy Wo[e_mj]ᵀ, not yet gated
        dgates = (d_heads.unsqueeze(2) @ o.unsqueeze(3)).view(m, k).to(gates.dtype)  # [M, k] = <d_heads, o>
        do = d_heads.mul_(gates.to(o.dtype).unsqueeze(-1))
        return do, dwo, dgates, dy.sum(0), None


def dense_query_kv(x: torch.Tensor, wq: torch.Tensor, wkv: torch.Tensor, bkv: torch.Tensor | None,
                   select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries of the selected heads and the shared key/value head.

    Args:
        x: [M, D] tokens; wq: [E, D, d] every head's query weight; wkv, bkv: the key/value ``nn.Linear``'s
            [2d, D] weight and [2d] bias; select: [M, k, E] one-hot (`head_selection`).

    Returns:
        (q [M, k, d] in (token, slot) order, kv [M, 2d]).
    """
    return _DenseQueryKV.apply(x, wq, wkv, bkv, select)


def dense_gated_output(o: torch.Tensor, wo: torch.Tensor, gates: torch.Tensor, bias: torch.Tensor,
                       select: torch.Tensor) -> torch.Tensor:
    """Σ_j g[m, j] · o[m, j] @ Wo[e_mj] + bias: the heads' outputs mixed by the gates.

    Args:
        o: [M, k, d] attention outputs in (token, slot) order; wo: [E, d, D]; gates: [M, k]; bias: [D];
            select: [M, k, E] one-hot.

    Returns:
        [M, D].
    """
    return _DenseGatedOutput.apply(o, wo, gates, bias, select)
