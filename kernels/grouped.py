"""Grouped GEMMs over expert-sorted rows as PyTorch custom operators: ``squad::grouped_mm`` and
``squad::grouped_wgrad``.

These are the expert matmuls of squad's routed layers on the CUDA path (`squad.kernels.device.cuda_path`): each op
is ONE kernel over all experts' rows that gathers its input rows by index, scatters its output rows by index and
applies bias, GELU, the gate or the gate's gradient on the tile (ScatterMoE's design; the kernels and their contract
are in `triton_grouped.py`). Each op has three implementations:

- Triton (`triton_grouped`) on CUDA tensors — and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
  how the tests run it) — for float32, float16 and bfloat16;
- a pure-PyTorch reference (`grouped_mm_reference`, `grouped_wgrad_reference`) everywhere else (CPU tensors, float64):
  the same arithmetic with the group sizes read on the host;
- a fake implementation (output shapes only) for meta tensors and `torch.compile`, which keeps each call as one
  opaque node of the graph: nothing inside reads the device or breaks the graph.

Arguments shared by both ops: rows are in G consecutive groups, ``ends`` [G] int32 the cumulative end of each group
(on the rows' device); rows past ``ends[-1]`` belong to no group and give zero rows (no-op experts, dropped slots).
``a_rows``/``b_rows`` [R] int64: the row of ``a``/``b`` each sorted row reads (None: row i reads row i); ``out_rows``
[R] int64: where each sorted row's output goes (None: row i); ``scale`` [R]: a per-row factor (the gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import gelu_grad
from .device import triton_runs_on
from .tiles import KERNEL_DTYPES, gate_tiles, mm_config, wgrad_config

EPILOGUES = ("linear", "gelu", "gate_grad")


def _use_triton(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0].device) and all(t.dtype in KERNEL_DTYPES for t in tensors)


def _check(epilogue: str, a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> None:
    if epilogue not in EPILOGUES:
        raise ValueError(f"squad::grouped_mm: epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1]:
        raise ValueError(f"squad::grouped_mm: a [R, K] and w [G, K, N] must agree in K, got a {tuple(a.shape)}, "
                         f"w {tuple(w.shape)}")
    if ends.dtype != torch.int32 or ends.shape != (w.shape[0],):
        raise ValueError(f"squad::grouped_mm: ends must be int32 [G={w.shape[0]}], got {ends.dtype} "
                         f"{tuple(ends.shape)}")


# ------------------------------------------------------------------------------------------ PyTorch reference
def _group_bounds(ends: torch.Tensor) -> list[tuple[int, int]]:
    """(first, end) rows of each group, read on the host."""
    stops = ends.tolist()
    return list(zip([0, *stops[:-1]], stops, strict=True))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def grouped_mm_reference(a, a_rows, w, bias, ends, scale, out_rows, aux, rows: int, epilogue: str,
                         store_pre: bool = True, aux_gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``squad::grouped_mm`` in PyTorch (the arithmetic of the kernel, fp32 epilogue; float64 stays float64)."""
    ct = _compute_dtype(a.dtype)
    n = w.shape[2]
    src = (a if a_rows is None else a.index_select(0, a_rows)).to(ct)  # [R, K] in sorted order
    acc = src.new_zeros(rows, n)
    bias_dot = src.new_zeros(rows)
    for g, (first, end) in enumerate(_group_bounds(ends)):
        if end > first:
            acc[first:end] = src[first:end] @ w[g].to(ct)
            if bias is not None and epilogue != "gate_grad":
                acc[first:end] += bias[g].to(ct)
            elif bias is not None:
                bias_dot[first:end] = src[first:end] @ bias[g].to(ct)
    used = int(ends[-1]) if ends.numel() else 0
    extra = a.new_empty(0, 0)
    if epilogue == "gelu":
        if store_pre:
            extra = acc.clone()
        acc = F.gelu(acc)
    elif epilogue == "gate_grad":
        aux_rows = (aux if out_rows is None else aux.index_select(0, out_rows)).to(ct)  # sorted order
        act = F.gelu(aux_rows) if aux_gelu else aux_rows
        extra = torch.zeros(rows, gate_tiles(n, a.dtype), dtype=ct, device=a.device)
        extra[:, 0] = (acc * act).sum(1) + bias_dot
        if aux_gelu:
            acc = acc * gelu_grad(aux_rows)
    if scale is not None and epilogue != "gelu":
        acc = acc * scale.to(ct).unsqueeze(1)
    acc[used:] = 0
    if epilogue == "gate_grad":
        extra[used:] = 0
    out = acc.to(a.dtype)
    extra = extra.to(a.dtype) if epilogue == "gelu" and store_pre else extra
    if out_rows is not None:  # sorted row i goes to row out_rows[i]
        out = torch.empty_like(out).index_copy_(0, out_rows, out)
        if epilogue == "gelu" and store_pre:
            extra = torch.empty_like(extra).index_copy_(0, out_rows, extra)
    return out, extra


def grouped_wgrad_reference(a, a_rows, b, b_rows, scale, ends, bias_grad: bool,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``squad::grouped_wgrad`` in PyTorch."""
    ct = _compute_dtype(a.dtype)
    src_a = (a if a_rows is None else a.index_select(0, a_rows)).to(ct)
    src_b = (b if b_rows is None else b.index_select(0, b_rows)).to(ct)
    if scale is not None:
        src_b = src_b * scale.to(ct).unsqueeze(1)
    g = ends.shape[0]
    dw = src_a.new_zeros(g, a.shape[1], b.shape[1])
    db = src_a.new_zeros(g, b.shape[1])
    for i, (first, end) in enumerate(_group_bounds(ends)):
        if end > first:
            dw[i] = src_a[first:end].t() @ src_b[first:end]
            db[i] = src_b[first:end].sum(0)
    return dw.to(dtype), db.to(dtype) if bias_grad else dw.new_empty(0, 0, dtype=dtype)


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("squad::grouped_mm", mutates_args=(),
                         schema="(Tensor a, Tensor? a_rows, Tensor w, Tensor? bias, Tensor ends, Tensor? scale, "
                                "Tensor? out_rows, Tensor? aux, int rows, str epilogue, bool store_pre, "
                                "bool aux_gelu) -> (Tensor, Tensor)")
def grouped_mm(a, a_rows, w, bias, ends, scale, out_rows, aux, rows, epilogue, store_pre, aux_gelu):
    """out[o(i)] = epilogue(a[a(i)] @ w[g(i)]) for R = ``rows`` sorted rows i (see the module docstring).

    Args:
        a: [*, K] input rows; w: [G, K, N] one weight per group (any strides: a transposed view serves a backward);
        bias: [G, N] (``linear``/``gelu``: added; ``gate_grad``: [G, K], its dot with the input row adds to the
            gate's gradient) or None.
        epilogue: ``linear`` (out = (acc + bias) · scale), ``gelu`` (out = gelu(acc + bias), extra = the
            pre-activation when ``store_pre``), ``gate_grad`` (the backward of ``y = scale · act(aux) W + ...``:
            out = scale · acc · act'(aux), extra = [R, tiles] float32 (float64 for float64 rows) partial sums of
            the gate's gradient Σ acc · act(aux) (+ a · bias), summed by the caller; act = GELU when ``aux_gelu``,
            else the identity;
            ``aux`` [R, N] rows stored where the outputs go).

    Returns:
        (out [R, N] in a's dtype, extra; an empty tensor where there is none).
    """
    _check(epilogue, a, w, ends)
    if _use_triton(a, w):
        from . import triton_grouped
        return triton_grouped.grouped_mm(a, a_rows, w, bias, ends, scale, out_rows, aux, rows, epilogue,
                                         store_pre, aux_gelu, mm_config(w.shape[1], w.shape[2], a.dtype))
    return grouped_mm_reference(a, a_rows, w, bias, ends, scale, out_rows, aux, rows, epilogue, store_pre, aux_gelu)


@grouped_mm.register_fake
def _(a, a_rows, w, bias, ends, scale, out_rows, aux, rows, epilogue, store_pre, aux_gelu):
    _check(epilogue, a, w, ends)
    n = w.shape[2]
    if epilogue == "gelu" and store_pre:
        extra = a.new_empty(rows, n)
    elif epilogue == "gate_grad":
        extra = a.new_empty(rows, gate_tiles(n, a.dtype), dtype=_compute_dtype(a.dtype))
    else:
        extra = a.new_empty(0, 0)
    return a.new_empty(rows, n), extra


@torch.library.custom_op("squad::grouped_wgrad", mutates_args=(),
                         schema="(Tensor a, Tensor? a_rows, Tensor b, Tensor? b_rows, Tensor? scale, Tensor ends, "
                                "bool bias_grad, ScalarType dtype) -> (Tensor, Tensor)")
def grouped_wgrad(a, a_rows, b, b_rows, scale, ends, bias_grad, dtype):
    """dW[g] = Σ_{i in g} a[a(i)]ᵀ · (scale[i] · b[b(i)]) and db[g] = Σ_{i in g} scale[i] · b[b(i)].

    Args:
        a: [*, K]; b: [*, N]; ends: [G] int32; bias_grad: also return db; dtype: of the results.

    Returns:
        (dW [G, K, N], db [G, N] or an empty tensor).
    """
    if _use_triton(a, b):
        from . import triton_grouped
        return triton_grouped.grouped_wgrad(a, a_rows, b, b_rows, scale, ends, bias_grad, dtype,
                                            wgrad_config(a.shape[1], b.shape[1], a.dtype))
    return grouped_wgrad_reference(a, a_rows, b, b_rows, scale, ends, bias_grad, dtype)


@grouped_wgrad.register_fake
def _(a, a_rows, b, b_rows, scale, ends, bias_grad, dtype):
    g = ends.shape[0]
    db = a.new_empty(g, b.shape[1], dtype=dtype) if bias_grad else a.new_empty(0, 0, dtype=dtype)
    return a.new_empty(g, a.shape[1], b.shape[1], dtype=dtype), db


def grouped_mm_flops(a_rows: int, k: int, n: int) -> int:
    """FLOPs of one grouped matmul over ``a_rows`` rows of width K into N columns (2 per multiply-accumulate)."""
    return 2 * a_rows * k * n
