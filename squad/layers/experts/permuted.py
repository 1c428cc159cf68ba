"""The MoE MLP on the library's grouped GEMM: the ``grouped_mm`` backend of the kernel path (CUDA, compiled code).

torchtitan's design: the tokens are permuted into expert order once, each projection is one call of torch's grouped
GEMM (`torch.nn.functional.grouped_mm`: CUTLASS on sm_90, offsets on the device), and the outputs are permuted back
to (token, slot) order and summed per token. Beside it the ``triton`` backend (`squad.layers.experts.scatter`)
gathers and scatters inside its own kernels; `squad.kernels.choice` says which one a layer takes.

Every move of rows is a gather by a permutation of the plan (`Dispatch.order` / ``inverse``) whose backward is the
gather by the inverse permutation, never an ``index_add``: no atomics, no host read, and one graph under
`torch.compile`. With M tokens, k slots, R = M·k rows in expert order (row i: token ``token[i]``, expert
``row_expert[i]``; no-op and dropped slots after the last group), and as few passes over [R, ·] rows as eager code
allows (each is a kernel reading and writing ~190 MB at ViT-B sizes; a bias gather and add were two more a side):

    xs  = [x, 1, 0…][token]                     [R, D + p] (p keeps rows 16-byte aligned)
    a   = xs ⊗ [W1; b1; 0…]                     [R, H]   (⊗: the grouped GEMM; the bias rides in as a weight row)
    h   = gelu(a)
    y   = h ⊗ W2                                 [R, D]
    out = g ⊙ y[inverse] + G b2                  [M, D]   (y as [M, k, D] weighted by the gates g [M, k] and summed
                                                           per token; G [M, E + 1] the gates per expert)

The gates meet the rows in batched GEMMs over tiles of T tokens (`_tile_gates`): per tile the [T, T·k] block-diagonal
matrix of its gates times the tile's T·k rows of y is the tile's weighted slot sum, one GEMM on the tensor cores
reading y once. Written per token, these products are batched GEMVs ([1, k] × [k, D]: cuBLAS's ``gemv2N``, 0.28 ms
for the 236 MB of a ViT-B block on an H200, a third of the bandwidth) or a gate-by-row product whose broadcast
operand keeps PyTorch's element-wise kernel from vectorising (0.24 ms for the backward's [M, k, D] rows,
reports/bench/gpu_check_h200). The zeros of the tile matrix cost T times the slot sum's FLOPs (T ≤ 32: a few GFLOP,
microseconds); a row that is not finite reaches the other tokens of its tile (0 · inf), a loss it would make
non-finite anyway.

The backward is written out (four grouped GEMMs; b1's gradient is the extra row of W1's, b2's is Gᵀ grad, the
gate's <grad, y> + <grad, b2[e]>), so what autograd would do with the gathers (atomic ``index_add`` into [M, D])
never happens, and no per-group sum (``embedding_bag``, slow on a GPU) is needed; the tiles again carry the gates:
the rows' gradient g ⊙ grad is the tile matrix's transpose times the tile's grad rows, and <grad, y> the diagonal of
each tile's grad × yᵀ. Rows of no group (no-op and dropped slots, after the last group) are left as the library op
leaves them (unwritten) except where they would reach a token: the second projection's output and the input
gradient are zeroed there; the weight gradients only read rows inside the groups. G's column E (no-op and dropped
slots) meets a zero bias row and is dropped from b2's gradient; a token's real experts are distinct (top-k), so G
holds each of its gates once.

Where the library op cannot take the operands (float64 anywhere; on CUDA and in compiled code anything but bf16;
widths whose rows are not 16-byte aligned) `grouped_gemm` runs its per-group reference (`grouped_gemm_reference`,
reading the group ends on the host): the CPU tests force the CUDA path and check this backend's dispatch in float64
with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.layers.experts.grouped import library_grouped_mm, native_grouped_mm
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


def _zero_tail_(rows: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Zeroes the rows of no group (no-op and dropped slots; ``valid`` [R, 1] False there), in place."""
    return rows if valid is None else rows.masked_fill_(~valid, 0)


def _slots_sum(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[R, N] rows in expert order → [M, N]: permuted to (token, slot) order (a gather by ``inverse``) and each
    token's k rows summed."""
    return rows.index_select(0, plan.inverse).view(-1, plan.k, rows.shape[1]).sum(1)


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    """[M, D] → [M, D + p]: x, a column of ones, zeros (p keeps 16-byte rows 16-byte aligned): the first
    projection's bias rides in its GEMM as one more input row of the weights."""
    p = max(1, 16 // x.element_size())
    pad = torch.zeros(x.shape[0], p, dtype=x.dtype, device=x.device)
    pad[:, 0] = 1
    return torch.cat([x, pad], 1)


def _with_bias_row(w: torch.Tensor, b: torch.Tensor, p: int) -> torch.Tensor:
    """[E, D, H] weights and [E, H] bias → [E, D + p, H]: the bias as input row D, zero rows after it."""
    return torch.cat([w, b.unsqueeze(1), torch.zeros(w.shape[0], p - 1, w.shape[2], dtype=w.dtype, device=w.device)], 1)


def _slot_matrix(gates: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, E + 1] each token's gate on each expert (column E: no-op and dropped slots; slots name distinct experts),
    from the gates and the slots' experts [M, k]."""
    sel = torch.zeros(gates.shape[0], num_experts + 1, dtype=gates.dtype, device=gates.device)
    return sel.scatter(1, experts, gates)


TILE_TOKENS = 32
"""The most tokens of a gate tile (`token_tile`): T·k rows of K for the slot sum's GEMM, T× its FLOPs."""


def token_tile(m: int, k: int) -> int:
    """T: the most tokens, up to `TILE_TOKENS`, that divide M with T·k a multiple of 8 (the tile matrix's rows 16-byte
    aligned in 16-bit, as the tensor-core GEMMs want them); 1 where none does (per-token GEMVs, still right)."""
    return next((t for t in range(min(m, TILE_TOKENS), 1, -1) if m % t == 0 and (t * k) % 8 == 0), 1)


def _tile_gates(g: torch.Tensor, t: int) -> torch.Tensor:
    """[M, k] gates → [M / T, T, T·k]: per tile of T tokens, row i holds token i's gates in columns i·k … i·k + k − 1
    and zeros elsewhere (block diagonal), so that tile × [T·k, D] rows in (token, slot) order is each token's gate-
    weighted sum of its k rows."""
    m, k = g.shape
    eye = torch.eye(t, dtype=g.dtype, device=g.device).view(1, t, t, 1)
    return (eye * g.view(m // t, t, 1, k)).view(m // t, t, t * k)


def _tile_diagonal(p: torch.Tensor, k: int) -> torch.Tensor:
    """[M / T, T, T·k] products of each tile's token rows with its (token, slot) rows → [M, k] each token's products
    with its own k rows (the block diagonal)."""
    b, t, _ = p.shape
    return p.view(b, t, t, k).diagonal(dim1=1, dim2=2).transpose(1, 2).reshape(b * t, k)


class _PermutedMLP(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (gelu(x[m] W1[e_mj] + b1[e_mj]) W2[e_mj] + b2[e_mj]) on the library's grouped GEMM."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, gates, plan):  # x [M, D], w1 [E, D, H], w2 [E, H, D], gates [M, k]
        offs = plan.offsets
        m, d = x.shape
        k = plan.k
        t = token_tile(m, k)
        valid = (plan.row_expert < plan.num_experts).unsqueeze(1) if plan.tail else None  # [R, 1]
        xa = _with_ones(x) if b1 is not None else x  # [M, D + p]
        xs = xa.index_select(0, plan.token)  # [R, D (+ p)] expert order
        w1a = _with_bias_row(w1, b1, xa.shape[1] - d) if b1 is not None else w1
        a = grouped_gemm(xs, w1a, offs)  # [R, H] with the bias; rows of no group unspecified
        h = F.gelu(a)
        y = _zero_tail_(grouped_gemm(h, w2, offs), valid)  # [R, D] without the bias
        yk = y.index_select(0, plan.inverse).view(m // t, t * k, d)  # tiles of T tokens' (token, slot) rows
        g = gates.to(x.dtype)
        tiles = _tile_gates(g, t)  # [M / T, T, T·k]
        if b2 is not None:  # Σ_j g_j b2[e_j] = G b2 with G [M, E + 1] the gates per expert (no-op column: zero bias)
            experts = plan.slot_experts()  # [M, k]
            sel = _slot_matrix(g, experts, plan.num_experts)
            b2p = torch.cat([b2, torch.zeros(1, d, dtype=b2.dtype, device=b2.device)])  # [E + 1, D]
            out = torch.baddbmm((sel @ b2p).view(m // t, t, d), tiles, yk).view(m, d)
        else:
            experts, sel, b2p = None, None, None
            out = torch.bmm(tiles, yk).view(m, d)
        if any(ctx.needs_input_grad):
            none = g.new_empty(0)
            ctx.save_for_backward(xs, w1, w2, a, h, yk, tiles, valid if valid is not None else none,
                                  *(v if v is not None else none for v in (experts, sel, b2p)))
            ctx.plan, ctx.has_b1, ctx.has_b2, ctx.gates_dtype = plan, b1 is not None, b2 is not None, gates.dtype
        return out  # [M, D]; no-op rows are zero

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        xs, w1, w2, a, h, yk, tiles, valid, experts, sel, b2p = ctx.saved_tensors
        plan = ctx.plan
        offs = plan.offsets
        m, d = grad.shape
        n_tiles, t, _ = tiles.shape
        valid = valid if valid.numel() else None
        grad_t = grad.contiguous().view(n_tiles, t, d)  # tiles of T tokens' gradients
        grad_gates = _tile_diagonal(torch.bmm(grad_t, yk.transpose(1, 2)), plan.k)  # [M, k] <grad, y>
        grad = grad_t.view(m, d)
        gb2 = None
        if ctx.has_b2:
            grad_gates = grad_gates + (grad @ b2p.t()).gather(1, experts)  # + <grad, b2[e]>
            gb2 = (sel.t() @ grad)[: plan.num_experts]  # [E, D] Σ over each expert's slots of g · grad
        dy = torch.bmm(tiles.transpose(1, 2), grad_t).view(-1, d).index_select(0, plan.order)  # [R, D] g ⊙ grad
        gw2 = grouped_gemm(h.t(), dy, offs)  # [E, H, D]; rows of no group meet only group-bounded GEMMs
        dh = grouped_gemm(dy, w2.transpose(1, 2), offs)  # [R, H]
        da = torch.ops.aten.gelu_backward(dh, a)  # dh · gelu'(a), one pass
        gw1 = grouped_gemm(xs.t(), da, offs)  # [E, D (+ p), H]: row D the bias gradient
        gb1 = gw1[:, d] if ctx.has_b1 else None
        dxs = _zero_tail_(grouped_gemm(da, w1.transpose(1, 2), offs), valid)  # [R, D]
        dx = _slots_sum(dxs, plan)
        return dx, gw1[:, :d], gb1, gw2, gb2, grad_gates.to(ctx.gates_dtype), None


def permuted_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                 b2: torch.Tensor | None, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """`squad.layers.experts.ops.expert_mlp` on the ``grouped_mm`` backend."""
    return _PermutedMLP.apply(x, w1, b1, w2, b2, gates, plan)
