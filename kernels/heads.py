"""Head-select GEMMs for MoE attention as PyTorch custom operators: ``squad::head_select_mm``,
``squad::head_gather_mm`` and ``squad::head_wgrad``.

MoE attention's experts are attention heads (a query projection [D → d] and an output projection [d → D] each); a
token selects k of E. Its dense all-head form computes every head's query with one GEMM and one output GEMM over all
heads' weights stacked, which costs E/k times the routed projections' FLOPs but reads each token once. These ops
are that form with nothing of width E·d ever in memory: the [M, E·d] operand a plain GEMM would need is virtual,
read from or written to the compact [M, k, d] tensors of the selected heads through a per-token slot map.

- ``slots`` [M, E] int32: ``slots[m, e]`` = the slot j (0 ≤ j < k) of token m that selected head e, −1 where m did
  not select e (`squad.layers.experts.heads.head_slots`). Each of a token's k slots names one head.
- ``head_select_mm(a, w, slots, top_k, gates?, aux?) -> (out, gate_grad)``: the all-head GEMM ``a @ [w_1 … w_E]``
  (a [M, K], w [E, K, d]) that keeps only the selected heads: ``out[m, j] = acc[m, e]`` for slots[m, e] = j, out
  [M, k, d]. With ``gates`` [M, k] and ``aux`` [M, k, d] (the backward of a gated output projection):
  ``out[m, j] = g[m, j] · acc[m, e]`` and ``gate_grad[m, j] = <acc[m, e], aux[m, j]>`` (float32, float64 for
  float64); an empty tensor otherwise. The queries of the selected heads (w = W_q), and the input gradient of the
  heads' outputs with the gates' gradient (a = dy, w = W_oᵀ).
- ``head_gather_mm(c, slots, gates?, w, a2?, w2?, bias?) -> out``: the GEMM over the virtual zero-padded operand
  V [M, E·d], ``V[m, e] = g[m, j] · c[m, j]`` for slots[m, e] = j (c [M, k, d]; g = 1 without gates), 0 where not
  selected: ``out = V @ w.view(E·d, N) + a2 @ w2 + bias`` (w [E, d, N], a2 [M, K2], w2 [K2, N]). The gated output
  projection (c = attention outputs, w = W_o), and the input gradient of the queries plus the key/value head's
  (c = dQ, w = W_qᵀ, a2 = dKV, w2 = W_kv).
- ``head_wgrad(c, slots, gates?, b, transpose, bias_grad, dtype) -> (dw, db)``: ``dw[e] = V[:, e]ᵀ @ b`` [E, d, N]
  ([E, N, d] with ``transpose``: W_q's layout) and ``db = Σ_m b[m]`` when asked: the weight gradients of both
  projections (b = dy, or b = x).

Three implementations each, as `squad.kernels.grouped`'s: Triton (`triton_heads`) on CUDA tensors (and CPU tensors
under ``TRITON_INTERPRET=1``) in float32/float16/bfloat16; a PyTorch reference elsewhere (float64 kept); a fake for
meta tensors and `torch.compile`. Nothing reads the device on the host.
"""

from __future__ import annotations

import torch

from .device import triton_runs_on
from .tiles import KERNEL_DTYPES, gather_config, select_config
from .tiles import head_wgrad_config as wgrad_config


def _use_triton(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0].device) and all(t.dtype in KERNEL_DTYPES for t in tensors)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_slots(op: str, slots: torch.Tensor, m: int, e: int) -> None:
    if slots.dtype != torch.int32 or slots.shape != (m, e):
        raise ValueError(f"squad::{op}: slots must be int32 [M={m}, E={e}], got {slots.dtype} {tuple(slots.shape)}")


def _check_compact(op: str, c: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor | None, e: int, d: int) -> None:
    if c.dim() != 3 or c.shape[2] != d:
        raise ValueError(f"squad::{op}: c must be [M, k, d={d}], got {tuple(c.shape)}")
    _check_slots(op, slots, c.shape[0], e)
    if gates is not None and gates.shape != c.shape[:2]:
        raise ValueError(f"squad::{op}: gates must be [M, k] = {tuple(c.shape[:2])}, got {tuple(gates.shape)}")


# ------------------------------------------------------------------------------------------ PyTorch reference
def _one_hot(slots: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, k, E] with 1 where slot j of token m selected head e (from the slot map [M, E])."""
    j = torch.arange(top_k, device=slots.device, dtype=slots.dtype).view(1, top_k, 1)
    return (slots.unsqueeze(1) == j).to(dtype)


def _virtual(c: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor | None, ct: torch.dtype) -> torch.Tensor:
    """The virtual operand V [M, E, d]: each selected head's (gated) compact row at its head, zero elsewhere."""
    rows = c.to(ct) if gates is None else c.to(ct) * gates.to(ct).unsqueeze(-1)
    return torch.bmm(_one_hot(slots, c.shape[1], ct).transpose(1, 2), rows)


def head_select_reference(a, w, slots, top_k, gates, aux) -> tuple[torch.Tensor, torch.Tensor]:
    """``squad::head_select_mm`` in PyTorch (float32 math for 16-bit inputs, float64 kept)."""
    ct = _compute_dtype(a.dtype)
    m, k = a.shape
    e, _, d = w.shape
    acc = (a.to(ct) @ w.to(ct).permute(1, 0, 2).reshape(k, e * d)).view(m, e, d)  # every head
    picked = torch.bmm(_one_hot(slots, top_k, ct), acc)  # [M, k, d]: the selected heads
    gate_grad = a.new_empty(0, 0, dtype=ct)
    if gates is not None:
        gate_grad = (picked * aux.to(ct)).sum(-1)
        picked = picked * gates.to(ct).unsqueeze(-1)
    return picked.to(a.dtype), gate_grad


def head_gather_reference(c, slots, gates, w, a2, w2, bias) -> torch.Tensor:
    """``squad::head_gather_mm`` in PyTorch."""
    ct = _compute_dtype(c.dtype)
    m = c.shape[0]
    e, d, n = w.shape
    out = _virtual(c, slots, gates, ct).reshape(m, e * d) @ w.to(ct).reshape(e * d, n)
    if a2 is not None:
        out = out + a2.to(ct) @ w2.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    return out.to(c.dtype)


def head_wgrad_reference(c, slots, gates, b, transpose, bias_grad, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``squad::head_wgrad`` in PyTorch."""
    ct = _compute_dtype(c.dtype)
    dw = torch.einsum("med,mn->edn", _virtual(c, slots, gates, ct), b.to(ct))
    if transpose:
        dw = dw.transpose(1, 2)
    db = b.to(ct).sum(0).to(dtype) if bias_grad else b.new_empty(0, dtype=dtype)
    return dw.contiguous().to(dtype), db


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("squad::head_select_mm", mutates_args=(),
                         schema="(Tensor a, Tensor w, Tensor slots, int top_k, Tensor? gates, Tensor? aux) "
                                "-> (Tensor, Tensor)")
def head_select_mm(a, w, slots, top_k, gates, aux):
    """The all-head GEMM keeping each token's selected heads (module docstring).

    Args:
        a: [M, K]; w: [E, K, d] (any strides); slots: [M, E] int32; top_k: k; gates: [M, k] or None; aux: [M, k, d]
            (with gates).

    Returns:
        (out [M, k, d] in a's dtype, gate_grad [M, k] float32 — float64 for float64 — or an empty tensor).
    """
    _check_select(a, w, slots, gates, aux)
    if _use_triton(a, w):
        from . import triton_heads
        return triton_heads.head_select_mm(a, w, slots, top_k, gates, aux,
                                           select_config(w.shape[1], w.shape[2], a.dtype))
    return head_select_reference(a, w, slots, top_k, gates, aux)


def _check_select(a, w, slots, gates, aux) -> None:
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1]:
        raise ValueError(f"squad::head_select_mm: a [M, K] and w [E, K, d] must agree in K, got a {tuple(a.shape)}, "
                         f"w {tuple(w.shape)}")
    _check_slots("head_select_mm", slots, a.shape[0], w.shape[0])
    if (gates is None) != (aux is None):
        raise ValueError("squad::head_select_mm: gates and aux come together (the gated backward) or not at all")
    if aux is not None:
        _check_compact("head_select_mm", aux, slots, gates, w.shape[0], w.shape[2])


@head_select_mm.register_fake
def _(a, w, slots, top_k, gates, aux):
    _check_select(a, w, slots, gates, aux)
    ct = _compute_dtype(a.dtype)
    gate_grad = a.new_empty(a.shape[0], top_k, dtype=ct) if gates is not None else a.new_empty(0, 0, dtype=ct)
    return a.new_empty(a.shape[0], top_k, w.shape[2]), gate_grad


def _check_gather(c, slots, gates, w, a2, w2, bias) -> None:
    if w.dim() != 3:
        raise ValueError(f"squad::head_gather_mm: w must be [E, d, N], got {tuple(w.shape)}")
    _check_compact("head_gather_mm", c, slots, gates, w.shape[0], w.shape[1])
    if (a2 is None) != (w2 is None) or (a2 is not None and (a2.shape[0] != c.shape[0] or a2.shape[1] != w2.shape[0]
                                                            or w2.shape[1] != w.shape[2])):
        raise ValueError(f"squad::head_gather_mm: a2 [M, K2] and w2 [K2, N={w.shape[2]}] come together, got "
                         f"{None if a2 is None else tuple(a2.shape)}, {None if w2 is None else tuple(w2.shape)}")


@torch.library.custom_op("squad::head_gather_mm", mutates_args=(),
                         schema="(Tensor c, Tensor slots, Tensor? gates, Tensor w, Tensor? a2, Tensor? w2, "
                                "Tensor? bias) -> Tensor")
def head_gather_mm(c, slots, gates, w, a2, w2, bias):
    """The GEMM over the virtual [M, E·d] operand of the selected heads (module docstring).

    Args:
        c: [M, k, d] (any strides); slots: [M, E] int32; gates: [M, k] or None; w: [E, d, N] (any strides);
            a2: [M, K2] and w2: [K2, N], or None; bias: [N] or None.

    Returns:
        [M, N] in c's dtype.
    """
    _check_gather(c, slots, gates, w, a2, w2, bias)
    if _use_triton(c, w):
        from . import triton_heads
        k2 = a2.shape[1] if a2 is not None else 16
        return triton_heads.head_gather_mm(c, slots, gates, w, a2, w2, bias,
                                           gather_config(w.shape[2], w.shape[1], k2, c.dtype))
    return head_gather_reference(c, slots, gates, w, a2, w2, bias)


@head_gather_mm.register_fake
def _(c, slots, gates, w, a2, w2, bias):
    _check_gather(c, slots, gates, w, a2, w2, bias)
    return c.new_empty(c.shape[0], w.shape[2])


@torch.library.custom_op("squad::head_wgrad", mutates_args=(),
                         schema="(Tensor c, Tensor slots, Tensor? gates, Tensor b, int num_heads, bool transpose, "
                                "bool bias_grad, ScalarType dtype) -> (Tensor, Tensor)")
def head_wgrad(c, slots, gates, b, num_heads, transpose, bias_grad, dtype):
    """Weight gradient through the virtual operand: dw[e] = V[:, e]ᵀ @ b (module docstring).

    Args:
        c: [M, k, d]; slots: [M, E = num_heads] int32; gates: [M, k] or None; b: [M, N]; transpose: return
            [E, N, d] instead of [E, d, N]; bias_grad: also return Σ_m b[m]; dtype: of the results.

    Returns:
        (dw, db [N] or an empty tensor).
    """
    _check_compact("head_wgrad", c, slots, gates, num_heads, c.shape[2])
    if _use_triton(c, b):
        from . import triton_heads
        return triton_heads.head_wgrad(c, slots, gates, b, num_heads, transpose, bias_grad, dtype,
                                       wgrad_config(c.shape[0], num_heads, b.shape[1], c.shape[2], c.dtype))
    return head_wgrad_reference(c, slots, gates, b, transpose, bias_grad, dtype)


@head_wgrad.register_fake
def _(c, slots, gates, b, num_heads, transpose, bias_grad, dtype):
    _check_compact("head_wgrad", c, slots, gates, num_heads, c.shape[2])
    d, n = c.shape[2], b.shape[1]
    dw = c.new_empty(num_heads, n, d, dtype=dtype) if transpose else c.new_empty(num_heads, d, n, dtype=dtype)
    return dw, (c.new_empty(n, dtype=dtype) if bias_grad else c.new_empty(0, dtype=dtype))
