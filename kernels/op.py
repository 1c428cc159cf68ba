"""`routed_attention`: the op every attention layer calls — validation, backend choice, autograd.

Backends:
- "auto": on CUDA tensors (with Triton installed), Triton for what SDPA cannot do — A-MoD scores, a routed token
  subset — and PyTorch's `F.scaled_dot_product_attention` (flash or cuDNN, PyTorch's choice) for everything else;
  "reference" on any other device and for head dims past `MAX_TRITON_HEAD_DIM`.
- "triton": the kernels in `triton_attention.py` (CUDA tensors, or CPU tensors when the process started with
  TRITON_INTERPRET=1 — Triton reads it when first imported, and `import torch` imports it). One forward launch
  yields output, row log-sum-exp and (when asked) the scores; the backward is a flash backward for the output.
  Token-indexed rows are read in place.
- "reference": pure PyTorch (`reference.py`): SDPA without scores (token-indexed rows gathered first), the chunked
  one-pass forward with scores; memory O(N · chunk).

The kernels run as `torch.library` custom ops (`library.py`) with fake implementations and registered autograd, so
`torch.compile` keeps each call as one opaque node on every device, and `torch.export` (which must give programs
that run without squad) traces the pure-PyTorch pass instead. `squad.kernels.triton_attention` is imported only when
a Triton op runs, so importing this package never defines or compiles kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import library
from .device import cuda_path, triton_available, triton_runs_on
from .reference import attention_forward_chunked, gather_rows

BACKENDS = ("auto", "triton", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_TRITON_HEAD_DIM = 128


def auto_backend(is_cuda: bool, head_dim: int, scores: bool, token_subset: bool) -> str:
    """What "auto" runs: "triton" only on the CUDA path (``is_cuda``), for scores or a token subset, at head dims
    Triton serves; "reference" (SDPA when there are no scores) otherwise."""
    wants_triton = scores or token_subset
    return "triton" if is_cuda and wants_triton and triton_available() and head_dim <= MAX_TRITON_HEAD_DIM \
        else "reference"


def _triton_serves(device: torch.device) -> bool:
    """The CUDA path takes the Triton op where a kernel can run (`triton_runs_on`) or where only its fake runs (meta
    tensors: the traffic recorder); a forced CUDA path on CPU tensors without the interpreter takes the reference."""
    return cuda_path(device) and (device.type == "meta" or triton_runs_on(device))


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
    # the values' range is checked where the rows are read: `library.check_index_range` (one host read)


def _resolve_backend(backend: str, q: torch.Tensor, scores: bool, token_subset: bool) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"routed_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return auto_backend(_triton_serves(q.device), q.shape[-1], scores, token_subset)
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("routed_attention: backend='triton' needs the triton package")
        if q.shape[-1] > MAX_TRITON_HEAD_DIM:
            raise ValueError(f"routed_attention: backend='triton' supports head dim <= {MAX_TRITON_HEAD_DIM}, "
                             f"got {q.shape[-1]}")
        # the device is checked by the op itself (`library.triton_attention`), in eager and compiled code alike
    return backend


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, token_index: torch.Tensor | None,
               return_scores: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The "reference" backend (inputs already validated)."""
    if token_index is not None:
        if not torch.compiler.is_compiling():  # compiled: torch.gather checks the rows itself
            library.check_index_range(token_index, q.shape[2])
        q, k, v = gather_rows(q, token_index), gather_rows(k, token_index), gather_rows(v, token_index)
    if not return_scores:
        gqa = k.shape[1] != q.shape[1]
        if gqa and cuda_path(q.device) and q.dtype == torch.float32:  # only flash takes GQA, not fp32: math forms N×N
            group = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    if torch.compiler.is_exporting():  # a program that runs without squad: trace the PyTorch pass itself
        out, _, scores = attention_forward_chunked(q, k, v, scale, need_lse=False)
        return out, scores
    need_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, _, scores = torch.ops.squad.chunked_attention(q, k, v, scale, need_lse)
    return out, scores


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
    return_scores = bool(return_scores)
    if _resolve_backend(backend, q, return_scores, token_index is not None) == "reference":
        return _reference(q, k, v, scale, token_index, return_scores)
    out, _, scores = torch.ops.squad.triton_attention(q, k, v, token_index, scale, return_scores)
    return (out, scores) if return_scores else out
