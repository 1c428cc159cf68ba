"""MoNE inference ops as PyTorch custom operators: ``squad::nested_linear``, ``squad::nested_linear_`` (in place),
``squad::nested_norm`` and ``squad::nested_mlp_`` (the whole MLP sublayer, in place).

Mixture of Nested Experts runs every token through the first w_g features of each projection, w_g its group's
width. On the CUDA path these ops do a MoNE block's work in four projection launches and two norm launches with
nothing of full width for a token that takes a slice beyond what the model needs (the kernels and their contract are
in `triton_nested.py`): the hidden layer's GELU inside the first MLP projection, the output projections adding into
the residual in their epilogue, the layer norms writing only the features the next projection reads, the attention
output read where SDPA wrote it; and the MLP sublayer (norm, both projections, GELU, the scaled residual add) as one
launch that never writes the hidden layer (`triton_nested_mlp`). Triton on CUDA (and on CPU tensors under
``TRITON_INTERPRET=1``); a PyTorch reference elsewhere; fake implementations for meta tensors and `torch.compile`.

Shared arguments: token-major rows T in G consecutive groups, ``layout`` [2, G] int32 on the rows' device (row 0: the
cumulative end of each group, row 1: its width) for the kernels, and the same as host ints, ``groups`` = [ends...,
widths...] (for the reference and for whoever prices the ops without reading the device); ``period`` R, the number of
image rows (token t belongs to image row t % R, which indexes the per-row embedding ``emb`` [R, D]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .device import triton_runs_on
from .tiles import KERNEL_DTYPES, nested_config, nested_mlp_config


def nested_mlp_flops(groups: list[int], hidden: int, config: dict) -> float:
    """FLOPs the fused MLP kernel executes: per token of width w, ceil(w / BLOCK_K) · BLOCK_K input features of the
    first projection and ceil(w / BLOCK_W) · BLOCK_W output features of the second, every hidden feature."""
    k, w_out = config["BLOCK_K"], config["BLOCK_W"]
    return sum(2.0 * (end - first) * hidden * (-(-w // k) * k + -(-w // w_out) * w_out)
               for first, end, w in group_bounds(groups))


def _rows(a: torch.Tensor) -> torch.Tensor:
    """[T, K] rows of an input [T, K], [T / R, R, K] or [T / R, R, H, K / H]."""
    return a.reshape(a.shape[0] * (a.shape[1] if a.dim() > 2 else 1), -1)


def group_bounds(groups: list[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, width) of each group from the host ints [ends..., widths...]."""
    g = len(groups) // 2
    ends, widths = groups[:g], groups[g:]
    return [(first, end, w) for first, end, w in zip([0, *ends[:-1]], ends, widths, strict=True)]


def _use_triton(*tensors: torch.Tensor) -> bool:
    return triton_runs_on(tensors[0].device) and all(t.dtype in KERNEL_DTYPES for t in tensors)


def _check(a: torch.Tensor, w: torch.Tensor, layout: torch.Tensor, mode: str) -> None:
    if mode not in ("in", "out"):
        raise ValueError(f"squad::nested_linear: mode must be 'in' or 'out', got {mode!r}")
    k = a.shape[-1] * (a.shape[-2] if a.dim() == 4 else 1)
    if a.dim() not in (2, 3, 4) or k != w.shape[1]:
        raise ValueError(f"squad::nested_linear: a [T, K], [T / R, R, K] or [T / R, R, H, K / H] and w [N, K] must "
                         f"agree in K, got a {tuple(a.shape)}, w {tuple(w.shape)}")
    if layout.dtype != torch.int32 or layout.dim() != 2 or layout.shape[0] != 2:
        raise ValueError(f"squad::nested_linear: layout must be int32 [2, G], got {layout.dtype} "
                         f"{tuple(layout.shape)}")


# ------------------------------------------------------------------------------------------ PyTorch reference
def nested_linear_reference(a, w, bias, groups, period, mode, gelu, residual, emb, scale):
    """``squad::nested_linear`` in PyTorch (float32 math for 16-bit inputs, float64 kept)."""
    ct = torch.float64 if a.dtype == torch.float64 else torch.float32
    x = _rows(a).to(ct)
    base = None
    if residual is not None:
        base = residual.to(ct).clone()
        if emb is not None:
            base += emb.to(ct).repeat(base.shape[0] // period, 1)
    out = x.new_zeros(x.shape[0], w.shape[0]) if base is None else base
    for first, end, width in group_bounds(groups):
        if end == first:
            continue
        if mode == "in":
            y = x[first:end, :width] @ w[:, :width].to(ct).t() + (bias.to(ct) if bias is not None else 0)
            out[first:end] = F.gelu(y) if gelu else y
        else:
            y = x[first:end] @ w[:width].to(ct).t() + (bias[:width].to(ct) if bias is not None else 0)
            y = F.gelu(y) if gelu else y
            if scale is not None:
                y = y * scale[first:end].to(ct).view(-1, 1)
            out[first:end, :width] += y
    return out.to(a.dtype)


def nested_mlp_reference(x, ln_w, ln_b, eps, w1, b1, w2, b2, groups, gate, alpha):
    """``squad::nested_mlp_`` in PyTorch (float32 math for 16-bit inputs, rounded to x's dtype where the unfused ops
    would store: the normed rows and the hidden layer); returns the new x."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = F.layer_norm(x.to(ct), (x.shape[1],), ln_w.to(ct), ln_b.to(ct), eps).to(x.dtype).to(ct)
    scale = 1.0 if gate is None else (alpha.to(ct) * gate.t().reshape(-1).to(ct) + 1.0)[:, None]  # t = n·R + r
    out = x.to(ct, copy=True)
    for first, end, width in group_bounds(groups):
        if end == first:
            continue
        hid = F.gelu(h[first:end, :width] @ w1[:, :width].to(ct).t() + b1.to(ct)).to(x.dtype).to(ct)
        y = hid @ w2[:width].to(ct).t() + b2[:width].to(ct)
        out[first:end, :width] += (scale if gate is None else scale[first:end]) * y
    return out.to(x.dtype)


def nested_norm_reference(x, emb, weight, bias, eps, period):
    """``squad::nested_norm`` in PyTorch: every feature normalised (the kernel writes only the first w)."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(ct)
    if emb is not None:
        h = h + emb.to(ct).repeat(h.shape[0] // period, 1)
    return F.layer_norm(h, (h.shape[1],), weight.to(ct), bias.to(ct), eps).to(x.dtype)


# ------------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("squad::nested_linear", mutates_args=(),
                         schema="(Tensor a, Tensor w, Tensor? bias, Tensor layout, int[] groups, int period, str mode, "
                                "bool gelu, Tensor? residual, Tensor? emb, Tensor? scale) -> Tensor")
def nested_linear(a, w, bias, layout, groups, period, mode, gelu, residual, emb, scale):
    """A nested projection of token-major rows (see the module docstring).

    Args:
        a: [T, K] rows, or [T / R, R, K] (row t at a[t // R, t % R]), or [T / R, R, H, K / H] (its features too in
            two levels: the attention output [R, H, N, d] permuted to [N, R, H, d], read in place).
        w: [N, K] (``nn.Linear`` layout); bias: [N] or None.
        mode: ``in`` — out[t] = act(a[t, :w] @ w[:, :w]ᵀ + bias), [T, N]; ``out`` — out[t, :w] = r[t, :w] (+ e) +
            s[t] · act(a[t] @ w[:w]ᵀ + bias[:w]) and out[t, w:] = r[t, w:] (+ e), [T, N], with r = ``residual``
            [T, N] (required), e = ``emb`` [R, N] at row t % R, s = ``scale`` [T] (or 1).
        gelu: act = GELU (else the identity).

    Returns:
        [T, N] in a's dtype.
    """
    _check(a, w, layout, mode)
    if mode == "out" and residual is None:
        raise ValueError("squad::nested_linear: mode 'out' adds into a residual; pass one")
    if _use_triton(a, w):
        from . import triton_nested
        return triton_nested.nested_mm(a, w, bias, layout, period, mode == "in", gelu, residual, emb, scale, None,
                                       nested_config(w.shape[1], w.shape[0], a.dtype))
    return nested_linear_reference(a, w, bias, groups, period, mode, gelu, residual, emb, scale)


@nested_linear.register_fake
def _(a, w, bias, layout, groups, period, mode, gelu, residual, emb, scale):
    _check(a, w, layout, mode)
    return a.new_empty(_rows(a).shape[0], w.shape[0])


@torch.library.custom_op("squad::nested_linear_", mutates_args=("residual",),
                         schema="(Tensor a, Tensor w, Tensor? bias, Tensor layout, int[] groups, Tensor(a!) residual, "
                                "Tensor? scale) -> ()")
def nested_linear_(a, w, bias, layout, groups, residual, scale):
    """In place: residual[t, :w] += s[t] · (a[t] @ w[:w]ᵀ + bias[:w]); the features past w are not touched."""
    _check(a, w, layout, "out")
    if _use_triton(a, w):
        from . import triton_nested
        triton_nested.nested_mm(a, w, bias, layout, 1, False, False, residual, None, scale, residual,
                                nested_config(w.shape[1], w.shape[0], a.dtype))
        return
    residual.copy_(nested_linear_reference(a, w, bias, groups, 1, "out", False, residual, None, scale))


@nested_linear_.register_fake
def _(a, w, bias, layout, groups, residual, scale):
    _check(a, w, layout, "out")


@torch.library.custom_op("squad::nested_norm", mutates_args=(),
                         schema="(Tensor x, Tensor? emb, Tensor weight, Tensor bias, float eps, Tensor layout, "
                                "int[] groups, int period) -> Tensor")
def nested_norm(x, emb, weight, bias, eps, layout, groups, period):
    """LayerNorm of x [T, D] (+ emb [R, D] at row t % R) over all D features; each row's first w features are the
    result (the kernel writes only those: the only ones the next nested projection reads)."""
    if _use_triton(x, weight):
        from . import triton_nested
        return triton_nested.nested_norm(x, emb, weight, bias, eps, layout, period)
    return nested_norm_reference(x, emb, weight, bias, eps, period)


@nested_norm.register_fake
def _(x, emb, weight, bias, eps, layout, groups, period):
    return torch.empty_like(x)


@torch.library.custom_op("squad::nested_mlp_", mutates_args=("x",),
                         schema="(Tensor(a!) x, Tensor ln_w, Tensor ln_b, float eps, Tensor w1, Tensor b1, Tensor w2, "
                                "Tensor b2, Tensor layout, int[] groups, Tensor? gate, Tensor? alpha) -> ()")
def nested_mlp_(x, ln_w, ln_b, eps, w1, b1, w2, b2, layout, groups, gate, alpha):
    """MoNE's MLP sublayer in place: x[t, :w] += (α · gate + 1) · (gelu(LN(x[t])[:w] @ W1[:, :w]ᵀ + b1) @ W2[:w]ᵀ +
    b2[:w]) for token-major rows x [T, D] (contiguous rows) in the layout's groups.

    Args:
        x: [T, D], written in place (each row's first w features).
        ln_w, ln_b, eps: the layer norm (over all D features).
        w1, b1: the first projection (``nn.Linear`` [H, D], [H]); w2, b2: the second ([D, H], [D]).
        gate: [R, N] the router's probability of each token's expert (token t = n·R + r); alpha: [1]; both None:
            the scale is 1 (a plain pre-norm MLP sublayer).
    """
    if x.dim() != 2 or x.stride(1) != 1 or w1.shape != (b1.shape[0], x.shape[1]) or w2.shape != (x.shape[1],
                                                                                                   w1.shape[0]):
        raise ValueError(f"squad::nested_mlp_: x [T, D] (rows contiguous), w1 [H, D] and w2 [D, H] must agree, got "
                         f"x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    config = nested_mlp_config(x.shape[1], w1.shape[0], x.dtype)
    if config is not None and _use_triton(x, w1):
        from . import triton_nested_mlp
        triton_nested_mlp.nested_mlp_(x, ln_w, ln_b, eps, w1, b1, w2, b2, layout, gate, alpha, config)
        return
    x.copy_(nested_mlp_reference(x, ln_w, ln_b, eps, w1, b1, w2, b2, groups, gate, alpha))


@nested_mlp_.register_fake
def _(x, ln_w, ln_b, eps, w1, b1, w2, b2, layout, groups, gate, alpha):
    pass
