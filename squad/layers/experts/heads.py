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

Two backends run this form (``model.moa.kernel``, `squad.layers.moe_attention`):

- ``heads``: the [M, E·d] operands are never in memory: the ops of `squad.kernels.heads` (Triton) read and write the
  compact [M, k, d] tensors through a per-token slot map ([M, E] int32, `head_slots`);
- ``cublas``: the [M, E·d] operands are materialised (`HeadIndex`) and every product is one plain GEMM (cuBLAS on a
  GPU): the query GEMM writes all E heads and a gather keeps the k selected; the gated heads are copied into a
  zero [M, E·d] operand for the output GEMM (and again, recomputed, for its weight gradient).
  Each [M, E·d] pass moves E/k times the compact rows' bytes (2× at modsquad_vit_b: 94 MB in bf16), a few tens of
  microseconds at HBM rates, against GEMMs at the library's rate that a GPU has measured
  (``../shared/gpu/MEASURED.md``), where the Triton head kernels spent 1.85 ms of MoE attention's 4.12 in one
  weight-gradient kernel on an H200 (reports/bench/gpu_check_h200).

Both cost E/k times the routed projections' FLOPs and read each token once. No sort, no plan, no host read, no
atomics: every move of rows is a gather (``index_select``) or a copy to distinct rows (``index_copy``), each the
other's backward written out, never autograd's ``index_add``.
"""

from __future__ import annotations

import dataclasses

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


# ------------------------------------------------------------------------------------------- the cublas backend
@dataclasses.dataclass(frozen=True)
class HeadIndex:
    """The row map of the ``cublas`` backend, from one routing decision (M tokens, k of E heads each).

    Attributes:
        select: [M·k] int64: row ``m·E + e`` of an all-head [M·E, d] tensor for each (token m, slot j) whose head is
            e, in (token, slot) order. Gathering by it keeps the selected heads' rows; copying the compact rows to
            it (`spread_rows`) builds the zero-padded all-head operand. Slots name distinct heads (top-k), so no two
            rows meet: a copy, never an add.
        num_experts, top_k: E and k.
    """

    select: torch.Tensor
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, experts: torch.Tensor, num_experts: int) -> HeadIndex:
        """From the selected heads [M, k] (distinct per token, as top-k gives them)."""
        m, k = experts.shape
        token = torch.arange(m, device=experts.device).unsqueeze(1)  # [M, 1]
        return cls((token * num_experts + experts).view(-1), num_experts, k)

    def spread_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, k, d] compact rows (any strides) → [M, E·d]: each selected head's row at its head, zeros elsewhere
        (a zero fill and one indexed copy: fewer bytes than padding the rows and gathering)."""
        m, k, d = rows.shape
        full = rows.new_zeros(m * self.num_experts, d)
        return full.index_copy_(0, self.select, rows.reshape(m * k, d)).view(m, self.num_experts * d)

    def select_rows(self, full: torch.Tensor) -> torch.Tensor:
        """[M, E·d] all heads → [M, k, d] the selected heads in (token, slot) order."""
        m = full.shape[0]
        d = full.shape[1] // self.num_experts
        return full.view(m * self.num_experts, d).index_select(0, self.select).view(m, self.top_k, d)


def _query_weights(wq: torch.Tensor) -> torch.Tensor:
    """[E, D, d] query weights → [D, E·d] (head e's columns at e·d …): the all-head GEMM's operand (a small copy)."""
    e, big_d, d = wq.shape
    return wq.permute(1, 0, 2).reshape(big_d, e * d)


class _LibraryQueryKV(torch.autograd.Function):
    """`_DenseQueryKV` on plain GEMMs: Q = x @ [Wq_1 … Wq_E], the selected heads gathered; kv = x Wkvᵀ + bkv."""

    @staticmethod
    def forward(ctx, x, wq, wkv, bkv, index):  # x [M, D], wq [E, D, d], wkv [2d, D], bkv [2d] | None
        q = index.select_rows(x @ _query_weights(wq))  # [M, k, d]
        kv = torch.nn.functional.linear(x, wkv, bkv)  # [M, 2d]
        ctx.save_for_backward(x, wq, wkv)
        ctx.index, ctx.has_bias = index, bkv is not None
        return q, kv

    @staticmethod
    def backward(ctx, dq, dkv):  # dq [M, k, d], dkv [M, 2d]
        x, wq, wkv = ctx.saved_tensors
        e, big_d, d = wq.shape
        dq_all = ctx.index.spread_rows(dq)  # [M, E·d], zero at the heads not selected
        dx = torch.addmm(dkv @ wkv, dq_all, _query_weights(wq).t())  # the queries' and the key/value head's
        dwq = (x.t() @ dq_all).view(big_d, e, d).permute(1, 0, 2).contiguous()  # [E, D, d]
        dwkv = dkv.t() @ x
        dbkv = dkv.sum(0) if ctx.has_bias else None
        return dx, dwq, dwkv, dbkv, None


class _LibraryGatedOutput(torch.autograd.Function):
    """`_DenseGatedOutput` on plain GEMMs: y = V @ Wo.view(E·d, D) + b, V the gated heads spread to [M, E·d]."""

    @staticmethod
    def forward(ctx, o, wo, gates, bias, index):  # o [M, k, d], wo [E, d, D], gates [M, k], bias [D]
        e, d, big_d = wo.shape
        gated = o * gates.unsqueeze(-1).to(o.dtype)
        y = torch.addmm(bias, index.spread_rows(gated), wo.reshape(e * d, big_d))  # [M, D]
        ctx.save_for_backward(o, wo, gates)
        ctx.index = index
        return y

    @staticmethod
    def backward(ctx, dy):  # dy [M, D]
        o, wo, gates = ctx.saved_tensors
        e, d, big_d = wo.shape
        index = ctx.index
        w = wo.reshape(e * d, big_d)
        dsel = index.select_rows(dy @ w.t())  # [M, k, d]: dy Woᵀ at each selected head
        dgates = torch.linalg.vecdot(dsel, o)  # <dy Woᵀ, o> per slot: one reduction (accumulating in float32)
        g = gates.unsqueeze(-1).to(o.dtype)
        do = dsel * g
        dwo = (index.spread_rows(o * g).t() @ dy).view(e, d, big_d)  # V recomputed, not kept
        return do, dwo, dgates.to(gates.dtype), dy.sum(0), None


def library_query_kv(x: torch.Tensor, wq: torch.Tensor, wkv: torch.Tensor, bkv: torch.Tensor | None,
                     index: HeadIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """`dense_query_kv` on the ``cublas`` backend (``index``: `HeadIndex.of` the routing's heads)."""
    return _LibraryQueryKV.apply(x, wq, wkv, bkv, index)


def library_gated_output(o: torch.Tensor, wo: torch.Tensor, gates: torch.Tensor, bias: torch.Tensor,
                         index: HeadIndex) -> torch.Tensor:
    """`dense_gated_output` on the ``cublas`` backend."""
    return _LibraryGatedOutput.apply(o, wo, gates, bias, index)
