"""Dense twins recorded as a dense layer runs with the fusions cuBLASLt gives it: the traffic profile's baselines
(`squad.bench.traffic_profile`).

A routed kernel of squad fuses bias, GELU and the gate into its GEMMs; a dense layer has the same fusions from
cuBLASLt's epilogues (cuBLAS documentation, ``cublasLtEpilogue_t``), which is what ``F.linear`` + ``F.gelu`` become
under a fusing compiler or a fused MLP (``aten::_addmm_activation`` is the forward of it). Pricing the twin as eager
PyTorch's separate GELU, GELU-backward and bias-sum passes would flatter the routed layer. Recorded here:

- `FusedMlp` (training): forward ``GELU_AUX_BIAS`` (fc1 + bias + GELU, the pre-activation kept for the backward)
  and ``BIAS`` (fc2); backward ``BGRADB`` (fc2's weight gradient with its bias gradient), ``DGELU_BGRAD`` (fc1's
  output gradient through GELU's derivative with fc1's bias gradient) and two plain GEMMs (fc1's weight gradient,
  the input gradient). Inference: ``GELU_BIAS`` and ``BIAS``, nothing kept.
- `FusedLinear`: ``BIAS`` forward; backward the input-gradient GEMM and ``BGRADB`` (weight and bias gradients in
  one GEMM).

Each kernel is launched into the running recorder (`squad.bench.traffic.current_recorder`) with what it reads,
writes and computes, its values made by PyTorch with the recording paused; outside a recording the modules run
their plain PyTorch forward. `fuse_dense` swaps a model's `Mlp` and ``nn.Linear`` modules for these.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .traffic import current_recorder


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class _MlpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, recorder, training):
        with recorder.paused():
            pre = F.linear(x, w1, b1)
            h = F.gelu(pre)
            y = F.linear(h, w2, b2)
        t, d, hidden = _rows(x), x.shape[-1], w1.shape[0]
        recorder.launch("cublaslt_gemm_bias_gelu" + ("_aux" if training else ""), [x, w1, b1],
                        [h, pre] if training else [h], 2.0 * t * d * hidden, kind="gemm")
        recorder.launch("cublaslt_gemm_bias", [h, w2, b2], [y], 2.0 * t * hidden * d, kind="gemm")
        ctx.save_for_backward(x, w1, w2, pre, h)
        ctx.recorder = recorder
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, pre, h = ctx.saved_tensors
        recorder = ctx.recorder
        t, d, hidden = _rows(x), x.shape[-1], w1.shape[0]
        flops = 2.0 * t * d * hidden
        with recorder.paused(), torch.enable_grad():
            leaves = [p.detach().requires_grad_() for p in (pre, h)]
            dh = dy @ w2.to(dy.dtype)
            dpre = torch.autograd.grad(F.gelu(leaves[0]), leaves[0], dh)[0]
            dy2, dpre2 = dy.reshape(t, d), dpre.reshape(t, hidden)
            dw2, db2 = dy2.t() @ h.reshape(t, hidden), dy2.sum(0)
            dw1, db1 = dpre2.t() @ x.reshape(t, d), dpre2.sum(0)
            dx = dpre @ w1
        recorder.launch("cublaslt_gemm_bgradb", [dy, h], [dw2, db2], flops, kind="gemm")
        recorder.launch("cublaslt_gemm_dgelu_bgrad", [dy, w2, pre], [dpre, db1], flops, kind="gemm")
        recorder.launch("cublas_gemm_wgrad", [dpre, x], [dw1], flops, kind="gemm")
        recorder.launch("cublas_gemm_dgrad", [dpre, w1], [dx], flops, kind="gemm")
        return dx, dw1, db1, dw2, db2, None, None


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recorder):
        with recorder.paused():
            y = F.linear(x, w, b)
        recorder.launch("cublaslt_gemm_bias", [x, w, b], [y], 2.0 * _rows(x) * w.shape[1] * w.shape[0], kind="gemm")
        ctx.save_for_backward(x, w)
        ctx.recorder, ctx.has_bias = recorder, b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        recorder = ctx.recorder
        t, n, k = _rows(x), w.shape[0], w.shape[1]
        with recorder.paused():
            dy2 = dy.reshape(t, n)
            dx = dy @ w
            dw = dy2.t() @ x.reshape(t, k)
            db = dy2.sum(0) if ctx.has_bias else None
        recorder.launch("cublas_gemm_dgrad", [dy, w], [dx], 2.0 * t * n * k, kind="gemm")
        recorder.launch("cublaslt_gemm_bgradb" if ctx.has_bias else "cublas_gemm_wgrad", [dy, x],
                        [dw, db], 2.0 * t * n * k, kind="gemm")
        return dx, dw, db, None


class FusedMlp(nn.Module):
    """A dense `squad.layers.mlp.Mlp` (its parameters) recorded with cuBLASLt's bias + GELU epilogues (module
    docstring)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        recorder = current_recorder()
        if recorder is None:
            return self.mlp(x)
        fc1, fc2 = self.mlp.fc1, self.mlp.fc2
        params = (x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in params)  # keep the pre-activation
        return _MlpFunction.apply(*params, recorder, training)


class FusedLinear(nn.Module):
    """An ``nn.Linear`` (its parameters) recorded with the bias in the GEMM's epilogue both ways (module
    docstring)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recorder = current_recorder()
        if recorder is None:
            return self.linear(x)
        return _LinearFunction.apply(x, self.linear.weight, self.linear.bias, recorder)


def fuse_dense(module: nn.Module) -> nn.Module:
    """``module`` with every `Mlp` inside it (or itself) a `FusedMlp` and every other ``nn.Linear`` a `FusedLinear`,
    in place (returned for chaining)."""
    from squad.layers.mlp import Mlp

    if type(module) is Mlp:
        return FusedMlp(module)
    for name, child in list(module.named_children()):
        if type(child) is Mlp:
            setattr(module, name, FusedMlp(child))
        elif type(child) is nn.Linear:
            setattr(module, name, FusedLinear(child))
        else:
            fuse_dense(child)
    return module
