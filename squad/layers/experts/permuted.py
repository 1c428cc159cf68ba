"""The MoE MLP on the library's grouped GEMM: the ``grouped_mm`` backend of the kernel path (CUDA, compiled code).

torchtitan's design: the tokens are permuted into expert order once, each projection is one call of torch's grouped
GEMM (`torch.nn.functional.grouped_mm`: CUTLASS on sm_90, offsets on the device), and the outputs are permuted back
to (token, slot) order and summed per token. Beside it the ``triton`` backend (`squad.layers.experts.scatter`)
gathers and scatters inside its own kernels; `squad.kernels.choice` says which one a layer takes.

Every move of rows is a gather by a permutation of the plan (`Dispatch.order` / ``inverse``) whose backward is the
gather by the inverse permutation, never an ``index_add``: no atomics, no host read, and one graph under
`torch.compile`. With M tokens, k slots, R = M·k rows in expert order (row i: token ``token[i]``, expert
``row_expert[i]``; no-op and dropped slots after the last group):

    xs  = x[token]                              [R, D]
    a   = xs ⊗ W1 + b1[row_expert]               [R, H]   (⊗: the grouped GEMM, row i times W1[row_expert[i]])
    h   = gelu(a)
    y   = h ⊗ W2 + b2[row_expert]                [R, D]
    out = Σ_slots (g · y)[inverse]              [M, D]   (g [R]: each row's gate; 0 on no-op rows)

The backward is written out (four grouped GEMMs, two per-group bias sums, the gate's gradient <grad, y>), so what
autograd would do with the gathers (atomic ``index_add`` into [M, D] and [E, H]) never happens. Rows of no group
(no-op and dropped slots, after the last group) are left as the library op leaves them (unwritten) except where
they would reach a token: the second projection's output and the input gradient are zeroed there; the weight
gradients and bias sums only read rows inside the groups.

Where the library op cannot take the operands (float64 anywhere; on CUDA and in compiled code anything but bf16;
widths whose rows are not 16-byte aligned) `grouped_gemm` runs its per-group reference (`grouped_gemm_reference`,
reading the group ends on the host): the CPU tests force the CUDA path and check this backend's dispatch in float64
with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.layers.experts.grouped import library_grouped_mm, native_grouped_mm, segment_sum
from squad.layers.experts.plan import Dispatch


def library_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the library's grouped GEMM runs ``a`` × ``b`` itself (dtype, device and alignment; the output's rows
    16-byte aligned too)."""
    return native_grouped_mm(a, b) and (b.shape[-1] * b.element_size()) % 16 == 0


def library_runs(device: torch.device, dtype: torch.dtype, *widths: int) -> bool:
    """Whether the library's grouped GEMM runs an MoE MLP of ``widths`` (D, H) in ``dtype`` on ``device`` itself
    (what `library_takes` will find of its operands), so that ``auto`` may take it before a GPU has measured: bf16, or
    float32/fp16 in eager code on CPU tensors (meta tensors stand for CUDA ones: the traffic recorder runs the CUDA
    path on them; compiled code traces the op's meta kernel, which takes bf16 only)."""
    eager_cpu = torch.device(device).type == "cpu" and not torch.compiler.is_compiling()
    size = torch.empty(0, dtype=dtype).element_size()
    return (library_grouped_mm is not None and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (dtype == torch.bfloat16 or eager_cpu) and all((w * size) % 16 == 0 for w in widths))


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What ``grouped_mm(a, b, offs=offs)`` computes, one matmul per group (the group ends read on the host), with
    rows past the last group zero; 16-bit operands accumulate in float32.

    - a [R, K] × b [G, K, N] → [R, N]: rows of group g times b[g];
    - a [K, R] × b [R, N] → [G, K, N]: a[:, rows of g] @ b[rows of g] (zero for an empty group).
    """
    ct = torch.float64 if a.dtype == torch.float64 else torch.float32
    bounds = [0, *offs.tolist()]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=ct, device=a.device)
        for g in range(b.shape[0]):
            out[bounds[g] : bounds[g + 1]] = a[bounds[g] : bounds[g + 1]].to(ct) @ b[g].to(ct)
    else:
        out = torch.zeros(len(bounds) - 1, a.shape[0], b.shape[1], dtype=ct, device=a.device)
        for g in range(len(bounds) - 1):
            out[g] = a[:, bounds[g] : bounds[g + 1]].to(ct) @ b[bounds[g] : bounds[g + 1]].to(ct)
    return out.to(a.dtype)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The library's grouped GEMM where it takes the operands, else `grouped_gemm_reference` (same forms). Rows
    past the last group are unspecified (the library op leaves them unwritten): callers mask them."""
    if library_takes(a, b):
        return library_grouped_mm(a, b, offs=offs)
    return grouped_gemm_reference(a, b, offs)


def _rows_bias(bias: torch.Tensor | None, plan: Dispatch) -> torch.Tensor | None:
    """[R, N] each row's expert bias (zero on no-op rows), or None."""
    if bias is None:
        return None
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])  # [E + 1, N]
    return padded.index_select(0, plan.row_expert)


def _zero_tail_(rows: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Zeroes the rows of no group (no-op and dropped slots; ``valid`` [R, 1] False there), in place."""
    return rows if valid is None else rows.masked_fill_(~valid, 0)


def _slots_sum(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[R, N] rows in expert order → [M, N]: permuted to (token, slot) order (a gather by ``inverse``) and each
    token's k rows summed."""
    return rows.index_select(0, plan.inverse).view(-1, plan.k, rows.shape[1]).sum(1)


class _PermutedMLP(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (gelu(x[m] W1[e_mj] + b1[e_mj]) W2[e_mj] + b2[e_mj]) on the library's grouped GEMM."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, gates, plan):  # x [M, D], w1 [E, D, H], w2 [E, H, D], gates [M, k]
        offs = plan.offsets
        valid = (plan.row_expert < plan.num_experts).unsqueeze(1) if plan.tail else None  # [R, 1]
        xs = x.index_select(0, plan.token)  # [R, D] expert order
        a = grouped_gemm(xs, w1, offs)  # [R, H]; rows of no group unspecified (never read past the next mask)
        if b1 is not None:
            a.add_(_rows_bias(b1, plan))
        h = F.gelu(a)
        y = grouped_gemm(h, w2, offs)  # [R, D]
        if b2 is not None:
            y.add_(_rows_bias(b2, plan))
        _zero_tail_(y, valid)
        g = gates.reshape(-1).index_select(0, plan.order).to(x.dtype)  # [R] gate of each row
        if any(ctx.needs_input_grad):
            ctx.save_for_backward(xs, w1, w2, a, h, y, g, valid if valid is not None else g.new_empty(0))
            ctx.plan, ctx.has_b1, ctx.has_b2, ctx.gates_dtype = plan, b1 is not None, b2 is not None, gates.dtype
        return _slots_sum(y * g.unsqueeze(1), plan)  # [M, D]; no-op rows are zero

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        xs, w1, w2, a, h, y, g, valid = ctx.saved_tensors
        plan = ctx.plan
        offs = plan.offsets
        valid = valid if valid.numel() else None
        gs = grad.index_select(0, plan.token)  # [R, D]: each row's output gradient (its token's)
        grad_gates = torch.bmm(gs.unsqueeze(1), y.unsqueeze(2)).view(-1)  # [R] <grad, y>, zero on no-op rows
        grad_gates = grad_gates.index_select(0, plan.inverse).view(-1, plan.k)
        dy = gs.mul_(g.unsqueeze(1))  # [R, D]; rows of no group meet only the group-bounded GEMMs below
        gw2 = grouped_gemm(h.t(), dy, offs)  # [E, H, D]
        gb2 = segment_sum(dy, plan) if ctx.has_b2 else None
        dh = grouped_gemm(dy, w2.transpose(1, 2), offs)  # [R, H]
        da = torch.ops.aten.gelu_backward(dh, a)  # dh · gelu'(a), one pass
        gw1 = grouped_gemm(xs.t(), da, offs)  # [E, D, H]
        gb1 = segment_sum(da, plan) if ctx.has_b1 else None
        dxs = _zero_tail_(grouped_gemm(da, w1.transpose(1, 2), offs), valid)  # [R, D]
        dx = _slots_sum(dxs, plan)
        return dx, gw1, gb1, gw2, gb2, grad_gates.to(ctx.gates_dtype), None


def permuted_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """`squad.layers.experts.ops.expert_mlp` on the ``grouped_mm`` backend."""
    return _PermutedMLP.apply(x, w1, b1, w2, b2, gates, plan)
