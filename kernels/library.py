"""The attention kernels as PyTorch custom operators (`torch.library`): what `torch.compile` sees of them.

Each op is one opaque node in a compiled graph: the compiler never traces into the Triton launches or the chunked
PyTorch loop, it reads the output shapes from the op's fake implementation and differentiates through the
registered autograd formula. So one compiled graph serves the CPU (inductor) and CUDA, and Triton kernels never meet
inductor's code generation (which handed them a float64 softmax scale). Opaque ops rather than `triton_op`: inductor
could not fuse into these kernels anyway, and a traced Triton kernel cannot run on CPU tensors.

Ops (namespace ``squad``):

- ``triton_attention(q, k, v, token_index?, scale, scores) -> (out, lse, scores)``: the Triton forward
  (`triton_attention.attention_forward`); ``scores`` is [B, M] float32 when asked, [B, 0] otherwise. Checks the token
  index's range (one host read), so a compiled graph keeps the check that eager `routed_attention` makes.
- ``triton_attention_backward(grad_out, q, k, v, out, lse, token_index?, scale) -> (dq, dk, dv)``.
- ``chunked_attention(q, k, v, scale, need_lse) -> (out, lse, scores)``: the pure-PyTorch pass with scores
  (`reference.attention_forward_chunked`); ``lse`` is [B, Hq, 0] without ``need_lse``.
- ``chunked_attention_backward(grad_out, q, k, v, out, lse, scale) -> (dq, dk, dv)``: PyTorch's fused CPU flash
  backward on CPU tensors, the chunked backward elsewhere.

Importing this module registers the ops (the registration is what lets a compiled graph call them); it does not
import Triton — the Triton ops import `triton_attention` when they first run.
"""

from __future__ import annotations

import torch

from .device import triton_runs_on
from .reference import attention_backward_chunked, attention_forward_chunked, cpu_flash_backward


def triton_module():
    """`squad.kernels.triton_attention`, imported on first use (Triton is optional and slow to import)."""
    from . import triton_attention
    return triton_attention


def check_index_range(token_index: torch.Tensor, n: int) -> None:
    """Raises ValueError unless every token index lies in [0, n) (reads two numbers from the device)."""
    lo, hi = torch.aminmax(token_index)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= n:  # an out-of-range row would make a kernel read foreign memory
        raise ValueError(f"routed_attention: token_index values must lie in [0, N={n}), got range [{lo}, {hi}]")


def _rows(q: torch.Tensor, token_index: torch.Tensor | None) -> int:
    return q.shape[2] if token_index is None else token_index.shape[1]


# --------------------------------------------------------------------------------------------------- Triton ops
@torch.library.custom_op("squad::triton_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? token_index, float scale, bool scores) "
                                "-> (Tensor, Tensor, Tensor)")
def triton_attention(q, k, v, token_index, scale, scores):
    """See the module docstring."""
    if not triton_runs_on(q.device):
        raise ValueError(f"routed_attention: backend='triton' needs CUDA tensors (got {q.device}), or Triton's CPU "
                         "interpreter: TRITON_INTERPRET=1 in the environment before Python imports torch/triton")
    if token_index is not None:
        check_index_range(token_index, q.shape[2])
    out, lse, col = triton_module().attention_forward(q, k, v, scale, token_index, scores=scores)
    return out, lse, col if scores else lse.new_empty(q.shape[0], 0)


@triton_attention.register_fake
def _(q, k, v, token_index, scale, scores):
    b, hq, _, d = q.shape
    m = _rows(q, token_index)
    return (q.new_empty(b, hq, m, d), q.new_empty(b, hq, m, dtype=torch.float32),
            q.new_empty(b, m if scores else 0, dtype=torch.float32))


@torch.library.custom_op("squad::triton_attention_backward", mutates_args=(),
                         schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                                "Tensor? token_index, float scale) -> (Tensor, Tensor, Tensor)")
def triton_attention_backward(grad_out, q, k, v, out, lse, token_index, scale):
    """See the module docstring."""
    return triton_module().attention_backward(grad_out, q, k, v, out, lse, scale, token_index)


@triton_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, token_index, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _triton_setup(ctx, inputs, output):
    q, k, v, token_index, scale, _ = inputs
    out, lse, scores = output
    ctx.save_for_backward(q, k, v, token_index, out, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse, scores)


def _triton_grad(ctx, grad_out, _grad_lse, _grad_scores):
    q, k, v, token_index, out, lse = ctx.saved_tensors
    dq, dk, dv = triton_attention_backward(grad_out, q, k, v, out, lse, token_index, ctx.scale)
    return dq, dk, dv, None, None, None


triton_attention.register_autograd(_triton_grad, setup_context=_triton_setup)


# ------------------------------------------------------------------------------------------------ PyTorch ops
@torch.library.custom_op("squad::chunked_attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float scale, bool need_lse) "
                                "-> (Tensor, Tensor, Tensor)")
def chunked_attention(q, k, v, scale, need_lse):
    """See the module docstring."""
    out, lse, scores = attention_forward_chunked(q, k, v, scale, need_lse=need_lse)
    return out, lse if need_lse else q.new_empty(q.shape[0], q.shape[1], 0, dtype=torch.float32), scores


@chunked_attention.register_fake
def _(q, k, v, scale, need_lse):
    b, hq, m, d = q.shape
    return (q.new_empty(b, hq, m, d), q.new_empty(b, hq, m if need_lse else 0, dtype=torch.float32),
            q.new_empty(b, m, dtype=torch.float32))


@torch.library.custom_op("squad::chunked_attention_backward", mutates_args=(),
                         schema="(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale) "
                                "-> (Tensor, Tensor, Tensor)")
def chunked_attention_backward(grad_out, q, k, v, out, lse, scale):
    """See the module docstring."""
    if q.device.type == "cpu":
        return cpu_flash_backward(grad_out.contiguous(), q, k, v, out, lse, scale)
    return attention_backward_chunked(grad_out, q, k, v, out, lse, scale)


@chunked_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, scale):
    if q.device.type == "cpu":  # the aten op's own fake kernel: its gradients' strides ([B, N, H, d] in memory)
        return cpu_flash_backward(grad_out.contiguous(), q, k, v, out, lse, scale)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # the chunked pass: contiguous


def _chunked_setup(ctx, inputs, output):
    q, k, v, scale, need_lse = inputs
    out, lse, scores = output
    if not need_lse and any(x.requires_grad for x in (q, k, v)):
        raise RuntimeError("squad::chunked_attention: need_lse=False leaves nothing to differentiate with; call it "
                           "with need_lse=True when q, k or v require gradients")
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse, scores)


def _chunked_grad(ctx, grad_out, _grad_lse, _grad_scores):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = chunked_attention_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None, None


chunked_attention.register_autograd(_chunked_grad, setup_context=_chunked_setup)
