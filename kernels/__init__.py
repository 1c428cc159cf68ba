"""Routed attention for squad: Triton kernels, a pure-PyTorch reference, and the op that picks between them.

`routed_attention(q, k, v, *, token_index=None, return_scores=False, scale=None, backend="auto")` is what the
attention layers call; see `squad.kernels.op`. Importing this package does not import Triton.

Modules: op (the attention op), reference, library (the attention custom ops), triton_attention; device (the
CUDA-path predicate); the routed layers' custom ops, each with its Triton kernels beside it — grouped /
triton_grouped (MoE expert GEMMs), heads / triton_heads (MoE attention's head-select GEMMs), nested / triton_nested /
triton_nested_mlp (MoNE's nested projections, norms and fused MLP sublayer), rows / triton_rows (the inference row
ops: norms, adds and MoD write-backs with a task embedding folded in); triton_common (shared kernel helpers); bench
(the attention kernels' GPU bench rows).
"""

from .op import routed_attention, triton_available
from .reference import explicit_attention

__all__ = ["explicit_attention", "routed_attention", "triton_available"]
