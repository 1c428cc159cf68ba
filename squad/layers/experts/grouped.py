"""The grouped matmul: one matmul per group over rows laid out in consecutive groups (a `Groups` or `Dispatch`).

Two algorithms, chosen by the rows' device (`squad.layers.experts.plan.takes_kernel_path`):

- CPU: PyTorch's `grouped_mm` (one call for all groups, from a device-side offsets tensor) for float32/bf16/fp16
  operands whose strides it accepts; otherwise (float64, odd widths) a loop over the groups with ``mm(out=...)``
  into one preallocated output, reading the group sizes to the host once. Per-expert bias rows are added by a slice
  per group, bias gradients summed by one `embedding_bag`. Weight gradients are grouped matmuls too (``xᵀ · grad``
  partitioned by the same offsets).
- kernel path (CUDA, compiled code): the ``squad::grouped_mm`` / ``squad::grouped_wgrad`` ops
  (`squad.kernels.grouped`), bias in the epilogue, bias gradient with the weight gradient; no host read.

`TaskLinear` (squad.layers.routing) runs all tasks' routers as one grouped matmul (`segment_groups`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squad.kernels.grouped import grouped_mm as kernel_mm
from squad.kernels.grouped import grouped_wgrad as kernel_wgrad
from squad.layers.experts.plan import Dispatch, Groups, takes_kernel_path

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the library's grouped GEMM: `F.grouped_mm` where torch has the public name, else `torch._grouped_mm`
library_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def native_grouped_mm(*tensors: torch.Tensor) -> bool:
    """Whether the library's grouped GEMM (`torch.nn.functional.grouped_mm`, or ``torch._grouped_mm`` in a torch
    without the public name) takes these operands: float32/bf16/fp16, one dtype, 16-byte aligned base pointers, each
    matrix row- or column-major with its other stride (and a batch stride) a multiple of 16 bytes (on CUDA only
    bf16, which is what its kernels support)."""
    if library_grouped_mm is None:
        return False
    dtype = tensors[0].dtype
    compiling = torch.compiler.is_compiling()  # traced tensors: no address (the run checks its own), bf16 only
    eager_cpu = tensors[0].device.type == "cpu" and not compiling  # float32/fp16 kernels: eager CPU tensors only
    if dtype not in _NATIVE_DTYPES or (not eager_cpu and dtype != torch.bfloat16):
        return False
    for t in tensors:
        if t.dtype != dtype or (not compiling and t.data_ptr() % 16):
            return False
        size = t.element_size()
        *batch, rows, cols = t.stride()
        if any((b * size) % 16 for b, n in zip(batch, t.shape[:-2], strict=True) if n > 1):
            return False
        if not ((cols == 1 and (rows * size) % 16 == 0) or (rows == 1 and (cols * size) % 16 == 0)):
            return False  # one of the matrix's two strides must be 1, the other a multiple of 16 bytes
    return True


def gmm(a: torch.Tensor, b: torch.Tensor, plan: Groups) -> torch.Tensor:
    """Grouped matmul of the CPU algorithm, without autograd, in one of two forms (groups of rows given by ``plan``):

    - a [R, K] × b [E, K, N] → [R, N]: rows of group e times b[e]; rows past the last group are zero.
    - a [K, R] × b [R, N] → [E, K, N]: the weight-gradient form, a[:, rows of e] @ b[rows of e] (zero if empty).
    """
    if torch.compiler.is_exporting():  # torch.export (squad.deploy.export): no data pointers, no host reads
        return _gmm_exported(a, b, plan)
    if native_grouped_mm(a, b) and (b.shape[-1] * b.element_size()) % 16 == 0:  # its output's rows aligned too
        out = library_grouped_mm(a, b, offs=plan.offsets)
        if b.dim() == 3 and plan.tail:  # grouped_mm leaves the rows past the last group unwritten
            used = sum(plan.host_sizes())
            out[used:].zero_()
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


def _gmm_exported(a: torch.Tensor, b: torch.Tensor, plan: Groups) -> torch.Tensor:
    """The forward form of `gmm` as torch.export traces it: one matmul per group, the group sizes read as
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
    """FLOPs (2 per multiply-accumulate) of one ``aten._grouped_mm`` call as `gmm` uses it, in the raw form of
    ``torch.utils.flop_counter.register_flop_formula(..., get_raw=True)``; PyTorch's counter has no formula for
    grouped matmuls, so whoever counts FLOPs of routed layers registers this one (tests/test_profile.py does)."""
    if b.dim() == 3:  # a [R, K] in groups × b [E, K, N]: every row meets one group's K × N
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]  # a [K, R] × b [R, N], partitioned along R


def add_row_bias_(out: torch.Tensor, bias: torch.Tensor, plan: Groups) -> None:
    """out[rows of e] += bias[e], in place: a slice per group (host sizes); under torch.export (a `Dispatch`) the
    gathered [M·k, N] bias rows (zero on no-op rows)."""
    if torch.compiler.is_exporting():
        padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])  # [E + 1, N]
        out += padded.index_select(0, plan.row_expert)
        return
    start = 0
    for e, n in enumerate(plan.host_sizes()):
        if n:
            out[start : start + n] += bias[e]
        start += n


def segment_sum(rows: torch.Tensor, plan: Groups) -> torch.Tensor:
    """[R, N] grouped rows → [G, N] sums per group (rows past the last group left out): one `embedding_bag`."""
    idx = torch.arange(rows.shape[0], device=rows.device)
    starts = F.pad(plan.offsets.long(), (1, 0))  # [G + 1] first row of each group and of the tail
    return F.embedding_bag(idx, rows, offsets=starts, mode="sum")[: plan.num_groups]


def project(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, plan: Groups) -> torch.Tensor:
    """[R, Din] grouped rows → [R, Dout] = rows of e @ w[e] (+ b[e]), without autograd (CPU algorithm)."""
    y = gmm(rows, w, plan)
    if b is not None:
        add_row_bias_(y, b, plan)
    return y


class _GroupedMatmul(torch.autograd.Function):
    """y[rows of group e] = x[rows of e] @ w[e] (+ b[e]); rows past the last group are zero (CPU algorithm)."""

    @staticmethod
    def forward(ctx, x, w, b, plan):  # x [R, Din], w [E, Din, Dout], b [E, Dout] | None
        y = project(x, w, b, plan)
        ctx.save_for_backward(x, w)
        ctx.plan, ctx.has_bias = plan, b is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        plan = ctx.plan
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gmm(grad, w.transpose(1, 2), plan) if need_x else None
        gw = gmm(x.t(), grad, plan) if need_w else None
        gb = segment_sum(grad, plan) if (need_b and ctx.has_bias) else None
        return gx, gw, gb, None


class _KernelGroupedMatmul(torch.autograd.Function):
    """The same on the kernel path: one ``squad::grouped_mm`` forward, one for the input gradient and one
    ``squad::grouped_wgrad`` for the weight and bias gradients."""

    @staticmethod
    def forward(ctx, x, w, b, ends):  # x [R, Din], w [G, Din, Dout], b [G, Dout] | None, ends [G] int32
        y, _ = kernel_mm(x, None, w, b, ends, None, None, None, x.shape[0], "linear", False, False)
        ctx.save_for_backward(x, w, ends)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, ends = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        if need_x:
            gx, _ = kernel_mm(grad, None, w.transpose(1, 2), None, ends, None, None, None, x.shape[0], "linear",
                              False, False)
        if need_w or (need_b and ctx.has_bias):
            gw, gb = kernel_wgrad(x, None, grad, None, None, ends, ctx.has_bias, w.dtype)
        return gx, gw, gb if ctx.has_bias else None, None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, plan: Groups, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One matmul per group over grouped rows.

    Args:
        x: [R, Din] rows in groups (R = M·k for a `Dispatch`; rows past the real experts' groups give zeros).
        w: [G, Din, Dout] one weight per group.
        plan: the groups (a `Dispatch`, or `Groups`: e.g. the rows a rank received for its experts).
        bias: [G, Dout] or None.

    Returns:
        [R, Dout].
    """
    kernels = plan.sync_free if isinstance(plan, Dispatch) else takes_kernel_path(x.device)
    if kernels:
        return _KernelGroupedMatmul.apply(x, w, bias, plan.offsets)
    return _GroupedMatmul.apply(x, w, bias, plan)
