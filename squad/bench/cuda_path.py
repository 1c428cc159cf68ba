"""What CUDA runs, recorded on any device: the pieces of a `squad.bench.traffic.TrafficRecorder` that make a CPU or
``meta`` recording follow the GPU's path.

- `force_cuda_path`: squad's routed layers take the algorithm CUDA tensors take (the forced
  `squad.kernels.device` predicate; ``FORCE_SYNC_FREE`` on older commits).
- `CudaKernels`, a `TorchFunctionMode` active while a recorder runs with ``cuda_path=True``:
  ``F.scaled_dot_product_attention`` becomes one fused flash kernel forward and one backward (`FusedAttention`),
  where the CPU and ``meta`` would decompose it into an N×N softmax; on ``meta`` tensors squad's attention custom ops
  (``squad::triton_attention``, and ``squad::chunked_attention``, which CUDA's "auto" backend runs as the Triton op)
  run their real Python wrappers in `squad.kernels.triton_attention` with each Triton launch recorded instead of run
  (`TritonLaunches`): the PyTorch work around the kernels (score partial sums, the backward's row dot products,
  split sums) is recorded op by op, and each launch is priced from its operands.
- `TritonLaunches`: a table of kernels → what each reads, writes and computes; `KERNELS` describes the current
  kernels, `squad.bench.legacy` the kernels of an old commit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .flops import attention_flops


@contextlib.contextmanager
def force_cuda_path() -> Iterator[None]:
    """Inside the block squad's routed layers take the algorithm CUDA tensors take, on any device: the forced device
    predicate (`squad.kernels.device.force_cuda_path`) where the code has one, else ``FORCE_SYNC_FREE``; code with
    neither (an old commit) is left as it is."""
    try:
        from squad.kernels.device import force_cuda_path as forced
    except ImportError:
        forced = None
    if forced is not None:
        with forced():
            yield
        return
    from squad.layers import experts

    if not hasattr(experts, "FORCE_SYNC_FREE"):
        yield
        return
    saved = experts.FORCE_SYNC_FREE
    experts.FORCE_SYNC_FREE = True
    try:
        yield
    finally:
        experts.FORCE_SYNC_FREE = saved


# ------------------------------------------------------------------------------------------------- fused SDPA
def laid_out_like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``ref``'s memory order, as CUDA's flash kernels allocate their results: ``empty_like`` of the
    operand (the output like q, dq/dk/dv like q/k/v — PyTorch's flash API and its own meta kernels do the same), so
    a query laid out [B, N, H, d] in memory gives an output the caller reshapes to [B, N, H·d] without a copy. The
    copy is made with the recording paused: it stands for where the kernel writes, not for a launch."""
    if value.stride() == torch.empty_like(ref).stride():
        return value
    return torch.empty_like(ref).copy_(value)


class FusedAttention(torch.autograd.Function):
    """SDPA recorded as CUDA runs it in bf16/fp16: one flash forward (out and the fp32 row log-sum-exp) and one
    flash backward; the values come from PyTorch's own SDPA with the recording paused, laid out as the flash kernels
    write them (`laid_out_like`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, recorder, kwargs):  # q [B, Hq, Nq, d], k/v [B, Hkv, Nk, d]
        with recorder.paused():
            out = laid_out_like(q, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        recorder.launch("flash_attention_forward", [q, k, v, mask], [out, lse], attention_flops(q, k, 4.0),
                        kind="attention")
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.recorder, ctx.kwargs = recorder, kwargs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        recorder = ctx.recorder
        with recorder.paused(), torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            again = F.scaled_dot_product_attention(*leaves, attn_mask=mask, **ctx.kwargs)
            dq, dk, dv = (laid_out_like(t, g) for t, g in zip((q, k, v), torch.autograd.grad(again, leaves, grad_out),
                                                               strict=True))
        recorder.launch("flash_attention_backward", [grad_out, q, k, v, mask, out, lse], [dq, dk, dv],
                        attention_flops(q, k, 10.0), kind="attention")
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------------------------------ Triton launches
@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one Triton kernel does, from its positional arguments.

    Attributes:
        per_pair: FLOPs per (query row, key row, feature): 4 for a forward (QKᵀ, PV), 8 for the dK/dV kernel
            (QKᵀ, dV, dP, dK), 6 for the dQ kernel (QKᵀ, dP, dQ).
        writes: positions of the arguments it writes (the rest of its tensors it reads).
        rows: position of an argument shaped [B, Hq, M, ...]: attention among M rows.
        two_phase: the forward's two-phase path (scores past one key tile) recomputes QKᵀ: half a forward more.
    """

    per_pair: float
    writes: tuple[int, ...]
    rows: int
    two_phase: bool = False


KERNELS = {"_fwd_kernel": Kernel(4.0, (4, 5, 6), 4, two_phase=True), "_bwd_dkdv_kernel": Kernel(8.0, (7, 8), 3),
           "_bwd_dq_kernel": Kernel(6.0, (7,), 3)}


class TritonLaunches:
    """Stands for a module's ``_kernels()`` dict: ``launches[name][grid](*args, **meta)`` records the launch with
    `TrafficRecorder.launch` instead of running it."""

    def __init__(self, recorder, kernels: Mapping[str, Kernel]):
        self.recorder, self.kernels = recorder, kernels

    def __getitem__(self, name: str) -> _Grid:
        spec = self.kernels[name]

        def launch(*args, **meta) -> None:
            writes = [args[i] for i in spec.writes]
            if spec.two_phase and not meta.get("SCORES"):  # without scores the partials argument is the lse
                writes = writes[:2]
            reads = [a for a in args if isinstance(a, torch.Tensor) and all(a is not w for w in writes)]
            b, h, m = args[spec.rows].shape[:3]
            flops = spec.per_pair * b * h * m * m * args[0].shape[-1]
            if spec.two_phase and meta.get("SCORES") and not meta.get("ONE_TILE"):
                flops *= 1.5
            self.recorder.launch(f"triton{name}", reads, writes, flops, kind="triton")

        return _Grid(launch)


class _Grid:
    """``kernel[grid]``: the grid does not change what a launch moves."""

    def __init__(self, launch):
        self._launch = launch

    def __getitem__(self, grid):
        return self._launch


@contextlib.contextmanager
def recorded_launches(module, recorder, kernels: Mapping[str, Kernel]) -> Iterator[None]:
    """Inside the block ``module``'s Triton launches are recorded, not run (``module._kernels`` and
    ``module._device_of`` replaced)."""
    saved = {name: getattr(module, name) for name in ("_kernels", "_device_of")}
    launches = TritonLaunches(recorder, kernels)
    module._kernels = lambda: launches
    module._device_of = lambda x: contextlib.nullcontext()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class ModelledTriton(torch.autograd.Function):
    """``squad::triton_attention`` as CUDA runs it, on meta tensors: the real wrappers, launches recorded."""

    @staticmethod
    def forward(ctx, q, k, v, token_index, scale, scores, recorder):
        from squad.kernels import triton_attention as tk

        with recorded_launches(tk, recorder, KERNELS):
            out, lse, col = tk.attention_forward(q, k, v, scale, token_index, scores=scores)
        ctx.save_for_backward(q, k, v, token_index, out, lse)
        ctx.scale, ctx.recorder = scale, recorder
        col = col if scores else lse.new_empty(q.shape[0], 0)
        ctx.mark_non_differentiable(lse, col)
        return out, lse, col

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_scores):
        from squad.kernels import triton_attention as tk

        q, k, v, token_index, out, lse = ctx.saved_tensors
        with recorded_launches(tk, ctx.recorder, KERNELS):
            dq, dk, dv = tk.attention_backward(grad_out, q, k, v, out, lse, ctx.scale, token_index)
        return dq, dk, dv, None, None, None, None


class CudaKernels(TorchFunctionMode):
    """Routes SDPA through `FusedAttention` and, on meta tensors, squad's attention ops through `ModelledTriton`,
    while ``recorder`` runs (not while it is paused)."""

    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recorder.is_paused():
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            q, k, v, *rest = args
            mask = kwargs.pop("attn_mask", rest[0] if rest else None)
            names = ("dropout_p", "is_causal", "scale", "enable_gqa")
            kwargs.update(dict(zip(names, rest[1:], strict=False)))
            return FusedAttention.apply(q, k, v, mask, self.recorder, kwargs)
        packet = func.overloadpacket if isinstance(func, torch._ops.OpOverload) else func
        name = getattr(packet, "_qualified_op_name", "") if isinstance(packet, torch._ops.OpOverloadPacket) else ""
        if name in ("squad::triton_attention", "squad::chunked_attention") and args[0].device.type == "meta":
            if name == "squad::triton_attention":
                q, k, v, token_index, scale, scores = args
            else:  # (q, k, v, scale, need_lse): what "auto" runs as the Triton op on CUDA, with scores
                (q, k, v, scale, _), token_index, scores = args, None, True
            return ModelledTriton.apply(q, k, v, token_index, scale, scores, self.recorder)
        return func(*args, **kwargs)
