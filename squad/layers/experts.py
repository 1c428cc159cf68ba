"""Grouped expert matmuls and token dispatch: the hot path of every MoE layer.

Tokens are grouped by expert ONCE per layer (`Dispatch`): the (token, slot) pairs are sorted by expert, every
expert's rows are then contiguous, and each projection is one grouped matmul over those rows. The grouped matmul
primitive is PyTorch's `grouped_mm` (one call for all groups, from a device-side offsets tensor: no host sync, no
Python loop) for float32/bf16/fp16 operands whose strides it accepts (on CUDA: bf16); otherwise (float64, odd
widths) a loop over the groups with ``mm(out=...)`` into one preallocated output, reading the group sizes to the
host once per layer. Weight gradients are grouped matmuls too (``xᵀ · grad`` partitioned by the same offsets).
`TaskLinear` (squad.layers.routing) uses the same primitive for all tasks' routers at once (`segment_groups`).

The layers use two fused ops, one per side of the experts, each a handful of whole-tensor calls rather than a
Python loop over the experts:

- `dispatch_matmul` = ``grouped_matmul(dispatch_tokens(x))``: one gather of the k copies of every token, one
  grouped matmul; backward sums each token's k slot gradients.
- `matmul_combine` = ``combine(grouped_matmul(rows))``: the gate is folded into the input rows, so the outputs
  are summed per token unweighted and the gate's gradient is a dot product on the input side (64 wide for MoA
  heads).

Two algorithms serve the sums, bias rows and no-op rows around the grouped matmuls (`Groups.sync_free`):

- CPU tensors: `embedding_bag` for the per-token and per-expert sums, a slice per group for the bias rows and the
  no-op tail (the group sizes cost nothing to read on the host). Fastest on the CPU.
- CUDA tensors (the sync-free path): nothing reads the device from the host and nothing adds atomically. Sums
  over a token's k rows are a gather with the inverse permutation and a sum over k contiguous rows; per-expert
  bias rows and bias gradients are small matmuls with the rows' one-hot experts (``onehot @ b``,
  ``onehotᵀ @ grad``: K = E, a reduction per expert, never an ``index_select`` backward into E rows); no-op rows
  are masked only when the layer can have them. In bf16 with `grouped_mm` a layer's forward and backward never
  wait for the device. `FORCE_SYNC_FREE` runs this path on CPU tensors, which is how the tests check its numerics.

No Triton gather-GEMM (ScatterMoE's fused gather, or the combine in the second GEMM's epilogue) is used: the gathers
and the k-sum are separate memory passes around `grouped_mm`.

`dispatch_tokens`, `grouped_matmul`, `to_slots`, `from_slots` and `combine` are the readable pieces (CPU
algorithm); the tests check the fused ops against their composition.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

FORCE_SYNC_FREE = False
"""Run the sync-free algorithm (the one CUDA tensors take) on every device. Tests set it to check that algorithm's
numerics on CPU tensors in float64; nothing else should."""


@dataclasses.dataclass(kw_only=True)
class Groups:
    """Rows laid out in consecutive groups, group g multiplied by weight g: what a grouped matmul needs.

    Attributes:
        counts: [G] rows per group (long, on the rows' device).
        offsets: [G] int32 cumulative end of each group (for `torch.nn.functional.grouped_mm`).
        sizes: the same as host ints, or None until a looped fallback reads them (`host_sizes`).
        tail: rows past the last group may exist and must come out zero (no-op slots); False when the groups
            cover every row.
        sync_free: take the algorithm that never reads the device from the host (chosen for CUDA tensors, or
            forced by `FORCE_SYNC_FREE`): masks and small matmuls instead of host-sized slices.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    sizes: list[int] | None = None
    tail: bool = True
    sync_free: bool = False

    @property
    def num_groups(self) -> int:
        return self.counts.shape[0]

    def host_sizes(self) -> list[int]:
        """Group sizes on the host (one device read, cached)."""
        if self.sizes is None:
            self.sizes = self.counts.tolist()
        return self.sizes


@dataclasses.dataclass(kw_only=True)
class Dispatch(Groups):
    """How M tokens with k expert slots each are laid out grouped by expert (one group per real expert; slots of
    no-op experts sort after the last group).

    Attributes:
        order: [M·k] flat slot index (token·k + slot) of each row in expert-sorted order.
        inverse: [M·k] position in sorted order of each flat slot (inverse permutation of ``order``).
        k: slots per token.
        token: [M·k] token index of each row in expert-sorted order (``order // k``).
        row_expert: [M·k] expert of each sorted row; no-op rows get E (bias lookups use a zero row there).
        starts: [E + 1] int64 first row of each group and of the no-op tail (segment sums per expert).
    """

    order: torch.Tensor
    inverse: torch.Tensor
    k: int
    token: torch.Tensor
    row_expert: torch.Tensor
    starts: torch.Tensor
    _onehot: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def active_rows(self) -> int:
        """Rows that belong to real experts (host int: reads the group sizes)."""
        return sum(self.host_sizes())

    def onehot(self, dtype: torch.dtype) -> torch.Tensor:
        """[M·k, E] one-hot expert of every sorted row (no-op rows all zero), cached per dtype: per-expert bias
        rows and sums become small matmuls (``onehot @ bias``, ``onehotᵀ @ rows``) with no atomics or host reads."""
        if dtype not in self._onehot:
            experts = torch.arange(self.num_experts, device=self.row_expert.device)
            self._onehot[dtype] = (self.row_expert.unsqueeze(1) == experts).to(dtype)
        return self._onehot[dtype]


def host_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as a long tensor on ``device``; on CUDA copied from pinned memory asynchronously, so building it
    never waits for the device."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@functools.lru_cache(maxsize=64)
def segment_groups(segments: tuple[tuple[int, int, int], ...], tokens_per_row: int,
                   device: torch.device) -> tuple[Groups, torch.Tensor]:
    """`Groups` of the tokens of task-major row runs, one group per run, and the runs' tasks on ``device``.

    Args:
        segments: ``(task, first_row, end_row)`` runs covering rows 0..R in order (`ForwardContext.segments`).
        tokens_per_row: N.
        device: where the rows live.

    Returns:
        (groups over the R·N token rows, [S] long task of each run). Cached: a step's layout recurs every step, so
        its few device ints are copied once (never as inference tensors, so evaluation and training share them).

    Raises:
        ValueError: the runs do not tile the rows in order.
    """
    end = 0
    for _, first, last in segments:
        if first != end or last < first:
            raise ValueError(f"segments must be consecutive (task, first_row, end_row) runs from row 0, got "
                             f"{list(segments)}")
        end = last
    sizes = [(last - first) * tokens_per_row for _, first, last in segments]
    ends = list(itertools.accumulate(sizes))
    s = len(segments)
    # Outside inference mode even when called inside it: the cached tensors outlive the call, and a tensor made in
    # inference mode could not be saved for backward by a later training step with the same layout.
    with torch.inference_mode(False):
        host = host_ints(sizes + ends + [task for task, _, _ in segments], device)
        offsets = host[s : 2 * s].to(torch.int32)
    groups = Groups(counts=host[:s], offsets=offsets, sizes=sizes, tail=False, sync_free=device.type == "cuda")
    return groups, host[2 * s :]


def plan_dispatch(experts: torch.Tensor, num_experts: int, host_sizes: bool = True, noop: bool = True,
                  sync_free: bool | None = None) -> Dispatch:
    """Groups (token, slot) pairs by expert.

    Args:
        experts: [M, k] expert index per token and slot; indices >= num_experts are no-op/dropped slots and are
            sorted after every real expert's rows.
        num_experts: number of real experts E.
        host_sizes: read the group sizes to the host now (otherwise only if a looped fallback needs them).
        noop: slots may name no-op experts (indices >= E); False promises they never do, so the sync-free path
            skips zeroing the (empty) tail.
        sync_free: take the sync-free algorithm (default: for CUDA tensors, under torch.compile, or when
            `FORCE_SYNC_FREE` is set).

    Returns:
        The `Dispatch` plan.
    """
    if sync_free is None:  # compiled: no host read either (each would be a graph break)
        sync_free = experts.is_cuda or FORCE_SYNC_FREE or torch.compiler.is_compiling()
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [M·k]
    sorted_e, order = torch.sort(flat, stable=True)  # rows grouped by expert, token order inside a group
    arange = torch.arange(order.numel(), device=order.device)
    inverse = torch.empty_like(order).scatter_(0, order, arange)
    row_expert = sorted_e.clamp(max=num_experts)
    # first row of each expert's group and of the no-op tail: a binary search in the sorted experts, no histogram
    # (bincount reads its size back to the host on CUDA) and no atomics
    starts = torch.searchsorted(row_expert, torch.arange(num_experts + 1, device=flat.device))  # [E + 1]
    ends = starts[1:]
    plan = Dispatch(counts=ends - starts[:-1], offsets=ends.to(torch.int32), tail=noop or not sync_free,
                    sync_free=sync_free, order=order, inverse=inverse, k=k,
                    token=torch.div(order, k, rounding_mode="floor"), row_expert=row_expert, starts=starts)
    if host_sizes:
        plan.host_sizes()
    return plan


# -------------------------------------------------------------------------------------- grouped matmul primitive
def native_grouped_mm(*tensors: torch.Tensor) -> bool:
    """Whether `torch.nn.functional.grouped_mm` takes these operands: float32/bf16/fp16, one dtype, 16-byte
    aligned base pointers, each matrix row- or column-major with its other stride (and a batch stride) a multiple of
    16 bytes (on CUDA only bf16, which is what its kernels support)."""
    if not hasattr(F, "grouped_mm"):
        return False
    dtype = tensors[0].dtype
    if dtype not in _NATIVE_DTYPES or (tensors[0].is_cuda and dtype != torch.bfloat16):
        return False
    compiling = torch.compiler.is_compiling()
    if compiling and dtype == torch.float32:  # its fake (meta) kernel takes bf16/fp16 only: cannot be traced
        return False
    for t in tensors:  # traced tensors have no data pointer: the compiler's own buffers are aligned
        if t.dtype != dtype or (not compiling and t.data_ptr() % 16):
            return False
        size = t.element_size()
        *batch, rows, cols = t.stride()
        if any((b * size) % 16 for b, n in zip(batch, t.shape[:-2], strict=True) if n > 1):
            return False
        if not ((cols == 1 and (rows * size) % 16 == 0) or (rows == 1 and (cols * size) % 16 == 0)):
            return False  # one of the matrix's two strides must be 1, the other a multiple of 16 bytes
    return True


def _gmm(a: torch.Tensor, b: torch.Tensor, plan: Groups) -> torch.Tensor:
    """Grouped matmul without autograd, in one of two forms (groups of rows given by ``plan``):

    - a [R, K] × b [E, K, N] → [R, N]: rows of group e times b[e]; rows past the last group are zero.
    - a [K, R] × b [R, N] → [E, K, N]: the weight-gradient form, a[:, rows of e] @ b[rows of e] (zero if empty).
    """
    if torch.compiler.is_exporting():  # torch.export (squad.deploy.export): no data pointers, no host reads
        return _gmm_exported(a, b, plan)
    if native_grouped_mm(a, b) and (b.shape[-1] * b.element_size()) % 16 == 0:  # its output's rows aligned too
        out = F.grouped_mm(a, b, offs=plan.offsets)
        if b.dim() == 3 and plan.tail:  # grouped_mm leaves the rows past the last group unwritten
            _zero_tail(out, plan)
        return out
    sizes = plan.host_sizes()
    if b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[2])
        start = 0
        for e, n in enumerate(sizes):
            if n:
                torch.mm(a[start : start + n], b[e], out=out[start : start + n])
            start += n
        if start < a.shape[0]:
            out[start:].zero_()
        return out
    out = a.new_empty(len(sizes), a.shape[0], b.shape[1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(a[:, start : start + n], b[start : start + n], out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


def _gmm_exported(a: torch.Tensor, b: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """The forward form of `_gmm` as torch.export traces it: one matmul per group, the group sizes read as
    data-dependent (unbacked) sizes, so the exported program routes each input as eager squad does."""
    if b.dim() != 3:
        raise RuntimeError("exported squad models run inference only: no weight-gradient grouped matmul")
    sizes = plan.counts.tolist()
    for n in sizes:
        torch._check(n >= 0)
        torch._check(n <= a.shape[0])
    used = sum(sizes)
    torch._check(used <= a.shape[0])
    outs = [rows @ b[e] for e, rows in enumerate(torch.split(a[:used], sizes))]
    outs.append(a.new_zeros(a.shape[0] - used, b.shape[2]))  # no-op rows after the last group
    return torch.cat(outs)


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, out_val: torch.Tensor | None = None, **kwargs) -> int:
    """FLOPs (2 per multiply-accumulate) of one ``aten._grouped_mm`` call as `_gmm` uses it, in the raw form of
    ``torch.utils.flop_counter.register_flop_formula(..., get_raw=True)``; PyTorch's counter has no formula for
    grouped matmuls, so whoever counts FLOPs of routed layers registers this one (tests/test_profile.py does)."""
    if b.dim() == 3:  # a [R, K] in groups × b [E, K, N]: every row meets one group's K × N
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]  # a [K, R] × b [R, N], partitioned along R


def _zero_tail(out: torch.Tensor, plan: Dispatch) -> None:
    """Zeroes the no-op rows after the last group: a mask on the sync-free path, a slice otherwise (host sizes)."""
    if plan.sync_free:
        out.masked_fill_((plan.row_expert == plan.num_experts).unsqueeze(1), 0)
        return
    active = plan.active_rows
    if active < out.shape[0]:
        out[active:].zero_()


def _row_bias(bias: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, N] bias of each sorted row's expert (zero on no-op rows)."""
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])  # [E + 1, N]
    return padded.index_select(0, plan.row_expert)


def _add_row_bias_(out: torch.Tensor, bias: torch.Tensor, plan: Dispatch) -> None:
    """out[rows of e] += bias[e], in place, without an [M·k, N] bias temporary: ``out += onehot @ bias`` (one
    matmul, K = E) on the sync-free path, a slice per group otherwise."""
    if torch.compiler.is_exporting():
        out += _row_bias(bias, plan)
    elif plan.sync_free:
        out.addmm_(plan.onehot(out.dtype), bias)
    else:
        start = 0
        for e, n in enumerate(plan.host_sizes()):
            if n:
                out[start : start + n] += bias[e]
            start += n


def _segment_sum(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, N] sorted rows → [E, N] sums per expert (no-op rows left out): ``onehotᵀ @ rows`` on the sync-free
    path (a reduction per expert, no atomics), one `embedding_bag` over the groups otherwise."""
    if plan.sync_free:
        return plan.onehot(rows.dtype).t() @ rows
    idx = torch.arange(rows.shape[0], device=rows.device)
    return F.embedding_bag(idx, rows, offsets=plan.starts, mode="sum")[: plan.num_experts]


def _sum_slots(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, N] expert-sorted rows → [M, N], each token's k rows summed: a gather with the inverse permutation and
    a sum over k contiguous rows on the sync-free path, one `embedding_bag` otherwise."""
    if plan.sync_free:
        slots = rows.index_select(0, plan.inverse)  # [M·k, N] in (token, slot) order
        return slots if plan.k == 1 else slots.view(-1, plan.k, rows.shape[1]).sum(1)
    return F.embedding_bag(plan.inverse.view(-1, plan.k), rows, mode="sum")


def _slot_experts(plan: Dispatch) -> torch.Tensor:
    """[M, k] expert of every (token, slot), no-op slots as E (the sorted rows' experts put back in slot order)."""
    return plan.row_expert.index_select(0, plan.inverse).view(-1, plan.k)


def _gate_table(experts: torch.Tensor, gates: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, E] gate mass each token gives each expert, Σ_j g[m, j] · [experts[m, j] = e] (no-op slots dropped)."""
    onehot = experts.unsqueeze(-1) == torch.arange(num_experts, device=experts.device)  # [M, k, E]
    return (onehot.to(gates.dtype) * gates.unsqueeze(-1)).sum(1)


class _GroupedMatmul(torch.autograd.Function):
    """y[rows of group e] = x[rows of e] @ w[e] (+ b[e]); rows past the last group are zero."""

    @staticmethod
    def forward(ctx, x, w, b, plan):  # x [R, Din], w [E, Din, Dout], b [E, Dout] | None
        y = _gmm(x, w, plan)
        if b is not None:
            _add_row_bias_(y, b, plan)
        ctx.save_for_backward(x, w)
        ctx.plan, ctx.has_bias = plan, b is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = _gmm(grad, w.transpose(1, 2), plan) if need_x else None
        gw = _gmm(x.t(), grad, plan) if need_w else None
        gb = _segment_sum(grad, plan) if (need_b and ctx.has_bias) else None
        return gx, gw, gb, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, plan: Groups, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One matmul per group over grouped rows.

    Args:
        x: [R, Din] rows in groups (R = M·k for a `Dispatch`; rows past the real experts' groups give zeros).
        w: [G, Din, Dout] one weight per group.
        plan: the groups (a `Dispatch`, or `Groups` that cover every row).
        bias: [G, Dout] or None (only with a `Dispatch`).

    Returns:
        [R, Dout].
    """
    if bias is not None and not isinstance(plan, Dispatch):
        raise TypeError("grouped_matmul: a bias needs a Dispatch plan (its rows' groups)")
    return _GroupedMatmul.apply(x, w, bias, plan)


# ------------------------------------------------------------------------------------------- readable pieces
class _GatherSlots(torch.autograd.Function):
    """rows[i] = x[token[i]]: every token copied once per slot, in expert order. Backward sums each token's k
    copies with one `embedding_bag` pass over the inverse permutation."""

    @staticmethod
    def forward(ctx, x, token, inverse, k):  # x [M, D]
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, D]
        (inverse,) = ctx.saved_tensors
        return F.embedding_bag(inverse.view(-1, ctx.k), grad.contiguous(), mode="sum"), None, None, None


class _Permute(torch.autograd.Function):
    """y = x[index] for a permutation ``index`` (with its ``inverse``): backward is the inverse gather."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def dispatch_tokens(x: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M, D] tokens → [M·k, D] rows grouped by expert (each token once per slot)."""
    return _GatherSlots.apply(x, plan.token, plan.inverse, plan.k)


def to_slots(rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M·k, ...] expert-sorted rows → [M, k, ...] in (token, slot) order."""
    y = _Permute.apply(rows, plan.inverse, plan.order)
    return y.view(-1, plan.k, *rows.shape[1:])


def from_slots(slots: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """[M, k, ...] per (token, slot) → [M·k, ...] expert-sorted rows."""
    flat = slots.reshape(-1, *slots.shape[2:])
    return _Permute.apply(flat, plan.order, plan.inverse)


class _Combine(torch.autograd.Function):
    """out[m] = Σ_j gates[m, j] · rows[inverse[m·k + j]]: a weighted `embedding_bag` over the token's k rows."""

    @staticmethod
    def forward(ctx, rows, gates, order, inverse, token):  # rows [M·k, D], gates [M, k]
        g = gates.to(rows.dtype)
        out = F.embedding_bag(inverse.view(gates.shape), rows, per_sample_weights=g, mode="sum")  # [M, D]
        ctx.save_for_backward(rows, g, order, inverse, token)
        ctx.gates_dtype = gates.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, D]
        rows, g, order, inverse, token = ctx.saved_tensors
        grad_rows = grad_gates = None
        dy = grad.contiguous().index_select(0, token)  # [M·k, D]: each sorted row's token gradient
        if ctx.needs_input_grad[1]:
            grad_gates = torch.linalg.vecdot(dy, rows).index_select(0, inverse).view(g.shape).to(ctx.gates_dtype)
        if ctx.needs_input_grad[0]:
            grad_rows = dy.mul_(g.reshape(-1).index_select(0, order).unsqueeze(1))
        return grad_rows, grad_gates, None, None, None


def combine(rows: torch.Tensor, gates: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Expert outputs back to tokens: Σ_slots gate · output.

    Args:
        rows: [M·k, D] expert outputs in expert-sorted order.
        gates: [M, k] gate weight of each slot.
        plan: the layer's `Dispatch`.

    Returns:
        [M, D].
    """
    return _Combine.apply(rows, gates, plan.order, plan.inverse, plan.token)


# ---------------------------------------------------------------------------------------------------- fused ops
class _DispatchMatmul(torch.autograd.Function):
    """rows[i] = x[token[i]] @ w[e(i)] (+ b[e(i)]) for expert-sorted rows i; no-op rows are zero."""

    @staticmethod
    def forward(ctx, x, w, b, plan):  # x [M, Din], w [E, Din, Dout], b [E, Dout] | None
        gathered = x.index_select(0, plan.token)  # [M·k, Din]: every token once per slot, grouped by expert
        out = _gmm(gathered, w, plan)  # [M·k, Dout]
        if b is not None:
            _add_row_bias_(out, b, plan)
        ctx.save_for_backward(gathered, w)
        ctx.plan, ctx.has_bias = plan, b is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M·k, Dout]
        gathered, w = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            d_rows = _gmm(grad, w.transpose(1, 2), plan)  # [M·k, Din], zero on no-op rows
            gx = _sum_slots(d_rows, plan)  # [M, Din]: Σ over each token's slots
        if need_w:
            gw = _gmm(gathered.t(), grad, plan)
        if need_b and ctx.has_bias:
            gb = _segment_sum(grad, plan)
        return gx, gw, gb, None


def dispatch_matmul(x: torch.Tensor, w: torch.Tensor, plan: Dispatch, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens to their experts and through one projection: ``grouped_matmul(dispatch_tokens(x), w, bias)`` fused.

    Args:
        x: [M, Din] tokens.
        w: [E, Din, Dout] expert weights.
        plan: the layer's `Dispatch`.
        bias: [E, Dout] or None.

    Returns:
        [M·k, Dout] rows in expert-sorted order (rows of no-op slots are zero).
    """
    return _DispatchMatmul.apply(x, w, bias, plan)


class _MatmulCombine(torch.autograd.Function):
    """out[m] = Σ_j g[m, j] · (rows[p] @ w[e] + b[e]) with p = inverse[m·k + j] and e the expert of row p.

    The gate is folded into the input rows, ``g·(a W + b) = (g·a) W + g·b``: the gated rows go through one grouped
    matmul and are summed per token (`_sum_slots`); the bias term is Σ_j g_j · b[e_j], a small weighted sum over the
    [E, Dout] bias table. The gate's gradient then comes from the input side, ``dg = <d(g·a), a> + <dy, b>``
    (narrow for MoA, where the input is one head), and nothing of width Dout is kept for backward.
    """

    @staticmethod
    def forward(ctx, rows, w, b, gates, experts, plan):  # rows [M·k, Din], gates/experts [M, k]
        g = gates.to(rows.dtype)
        g_rows = g.reshape(-1).index_select(0, plan.order)  # [M·k] gate of each sorted row
        scaled = rows * g_rows.unsqueeze(1)  # [M·k, Din]
        y = _gmm(scaled, w, plan)  # [M·k, Dout]
        out = _sum_slots(y, plan)  # [M, Dout]
        if b is not None and plan.sync_free:  # Σ_j g_j · b[e_j] as one small matmul
            out.addmm_(_gate_table(experts, g, b.shape[0]), b)
        elif b is not None:  # no-op slots index the zero row E
            table = torch.cat([b, b.new_zeros(1, b.shape[1])])  # [E + 1, Dout]
            out += F.embedding_bag(experts.clamp(max=b.shape[0]), table, per_sample_weights=g, mode="sum")
        ctx.save_for_backward(rows, scaled, w, b, g_rows, experts)
        ctx.plan, ctx.gates_dtype = plan, gates.dtype
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, Dout]
        rows, scaled, w, b, g_rows, experts = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_rows, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        m, k = experts.shape
        dy = grad.index_select(0, plan.token)  # [M·k, Dout]: each sorted row's token gradient
        gw = _gmm(scaled.t(), dy, plan) if need_w else None
        d_rows = grad_gates = gb = None
        if need_rows or need_g:
            d_scaled = _gmm(dy, w.transpose(1, 2), plan)  # [M·k, Din] = d(g·a)
            if need_g:
                dg = torch.linalg.vecdot(d_scaled, rows).index_select(0, plan.inverse).view(m, k)
                if b is not None:  # + <grad_m, b[e_mj]>
                    gb_dot = F.pad(grad @ b.t(), (0, 1))  # [M, E + 1], zero column for no-op slots
                    dg = dg + gb_dot.gather(1, experts.clamp(max=b.shape[0]))
                grad_gates = dg.to(ctx.gates_dtype)
            if need_rows:
                d_rows = d_scaled.mul_(g_rows.unsqueeze(1))
        if need_b and b is not None:  # Σ over slots routed to e of g · grad_m: [E, M] @ [M, Dout]
            g = g_rows.index_select(0, plan.inverse).view(m, k)
            if plan.sync_free:
                weights = _gate_table(experts, g, b.shape[0])
            else:
                weights = grad.new_zeros(m, b.shape[0] + 1).scatter_add_(1, experts.clamp(max=b.shape[0]), g)
                weights = weights[:, : b.shape[0]]
            gb = weights.t() @ grad
        return d_rows, gw, gb, grad_gates, None, None


def matmul_combine(rows: torch.Tensor, w: torch.Tensor, gates: torch.Tensor, plan: Dispatch,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """One grouped projection of expert-sorted rows, then back to the tokens mixed by the gates:
    ``combine(grouped_matmul(rows, w, bias), gates)`` fused.

    Args:
        rows: [M·k, Din] in expert-sorted order.
        w: [E, Din, Dout] expert weights.
        gates: [M, k] gate weight of each slot.
        plan: the layer's `Dispatch`.
        bias: [E, Dout] or None.

    Returns:
        [M, Dout] = Σ_slots gate · (row @ w[e] + b[e]); no-op slots contribute nothing.
    """
    return _MatmulCombine.apply(rows, w, bias, gates, _slot_experts(plan), plan)
