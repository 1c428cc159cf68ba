"""`routed_attention`: the op every attention layer calls — validation, backend choice, autograd.

Backends:
- "triton": the kernels in `triton_attention.py` (CUDA tensors, or CPU tensors when the process started with
  TRITON_INTERPRET=1 — Triton reads it when first imported, and `import torch` imports Triton). Forward
  keeps each row's log-sum-exp; the routing scores come from a second, key-major pass; the backward is a flash
  backward for the output. Token-indexed rows are read in place.
- "reference": pure PyTorch (`reference.py`): SDPA without scores, one chunked pass with scores; memory O(N · chunk).
- "auto": "triton" for CUDA tensors (when Triton is installed), "reference" otherwise.

`squad.kernels.triton_attention` is imported only when the Triton backend runs, so importing this package never
defines or compiles kernels.
"""

from __future__ import annotations

import importlib.util

import torch

from .reference import reference_attention

BACKENDS = ("auto", "triton", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_TRITON_HEAD_DIM = 128


def triton_available() -> bool:
    """Whether the `triton` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def _triton_module():
    from . import triton_attention
    return triton_attention


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: torch.Tensor | None,
                  scale: float | None) -> None:
    """Raises ValueError/TypeError naming the first problem with the inputs."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"routed_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"routed_attention: {name} must be 4-D [B, H, N, d], got shape {tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise TypeError(f"routed_attention: {name} has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"routed_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"routed_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"routed_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    bq, hq, n, d = q.shape
    bk, hkv, nk, dk = k.shape
    if bq != bk or n != nk or d != dk:
        raise ValueError(f"routed_attention: q [B, Hq, N, d] = {tuple(q.shape)} and k/v [B, Hkv, N, d] = "
                         f"{tuple(k.shape)} must agree in B, N and d")
    if any(size < 1 for size in (bq, hq, n, d, hkv)):  # not min(): torch.export keeps a symbolic batch size
        raise ValueError(f"routed_attention: empty input, q {tuple(q.shape)}, k {tuple(k.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"routed_attention: key/value heads ({hkv}) must divide query heads ({hq})")
    if scale is not None and not (isinstance(scale, int | float) and scale == scale and abs(scale) != float("inf")):
        raise ValueError(f"routed_attention: scale must be a finite number or None, got {scale!r}")
    if token_index is None:
        return
    if not isinstance(token_index, torch.Tensor):
        raise TypeError(f"routed_attention: token_index must be a torch.Tensor, got {type(token_index).__name__}")
    if token_index.dtype != torch.int64:
        raise TypeError(f"routed_attention: token_index must be int64, got {token_index.dtype}")
    if token_index.dim() != 2 or token_index.shape[0] != bq or token_index.shape[1] < 1:
        raise ValueError(f"routed_attention: token_index must be [B={bq}, K>=1], got shape {tuple(token_index.shape)}")
    if token_index.device != q.device:
        raise ValueError(f"routed_attention: token_index is on {token_index.device}, q on {q.device}")
    lo, hi = torch.aminmax(token_index)
    if lo.item() < 0 or hi.item() >= n:  # one host sync; an out-of-range row would read foreign memory
        raise ValueError(f"routed_attention: token_index values must lie in [0, N={n}), got range "
                         f"[{lo.item()}, {hi.item()}]")


def _resolve_backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"routed_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if q.is_cuda and triton_available() else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("routed_attention: backend='triton' needs the triton package")
        if q.shape[-1] > MAX_TRITON_HEAD_DIM:
            raise ValueError(f"routed_attention: backend='triton' supports head dim <= {MAX_TRITON_HEAD_DIM}, "
                             f"got {q.shape[-1]}")
        if not q.is_cuda and not _triton_module().interpreter_enabled():
            raise ValueError(f"routed_attention: backend='triton' needs CUDA tensors (got {q.device}), or Triton's CPU "
                             "interpreter: TRITON_INTERPRET=1 in the environment before Python imports torch/triton")
    return backend


class _TritonAttention(torch.autograd.Function):
    """Triton forward (+ optional score pass) and flash backward for the output."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_index: torch.Tensor | None,
                scale: float, return_scores: bool):  # noqa: D102
        kernels = _triton_module()
        out, lse = kernels.attention_forward(q, k, v, scale, token_index)
        ctx.save_for_backward(q, k, v, token_index, out, lse)
        ctx.scale = scale
        if not return_scores:
            return out
        scores = kernels.attention_scores(q, k, lse, scale, token_index)
        ctx.mark_non_differentiable(scores)
        return out, scores

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *_grad_scores: torch.Tensor):  # noqa: D102
        q, k, v, token_index, out, lse = ctx.saved_tensors
        dq, dk, dv = _triton_module().attention_backward(grad_out, q, k, v, out, lse, ctx.scale, token_index)
        return dq, dk, dv, None, None, None


def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, token_index: torch.Tensor | None = None,
                     return_scores: bool = False, scale: float | None = None, backend: str = "auto"
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal softmax attention, optionally among routed tokens, optionally with A-MoD routing scores.

    Query head h attends with key/value head h // (Hq / Hkv) (multi-head when Hkv = Hq, multi-query when Hkv = 1).

    Args:
        q: [B, Hq, N, d] queries; float32, float16 or bfloat16.
        k: [B, Hkv, N, d] keys, Hkv dividing Hq; same dtype and device as q.
        v: [B, Hkv, N, d] values.
        token_index: optional [B, K] int64 rows in [0, N): attention among the selected tokens only — queries, keys
            and values are the rows ``token_index[b]`` of q, k, v. The output then has K rows; gradients reach only
            the selected rows of q, k, v (zeros elsewhere).
        return_scores: also return the routing scores: for each (selected) token, the mean over query heads and
            query rows of its softmax attention probability (the column means of the attention map, as in A-MoD).
            Float32, no gradient.
        scale: score scale; default d ** -0.5.
        backend: "auto", "triton" or "reference" (see the module docstring).

    Returns:
        out [B, Hq, M, d] in q's dtype (M = K with token_index, else N), or (out, scores [B, M]) with
        return_scores=True.

    Raises:
        TypeError, ValueError: on bad dtypes, shapes, devices, indices, scale or backend (the message names it).
    """
    _check_inputs(q, k, v, token_index, scale)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if _resolve_backend(backend, q) == "reference":
        return reference_attention(q, k, v, scale, token_index=token_index, return_scores=return_scores)
    return _TritonAttention.apply(q, k, v, token_index, scale, bool(return_scores))
