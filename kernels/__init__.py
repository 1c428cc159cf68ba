"""Routed attention for squad: Triton kernels, a pure-PyTorch reference, and the op that picks between them.

`routed_attention(q, k, v, *, token_index=None, return_scores=False, scale=None, backend="auto")` is what the
attention layers call; see `squad.kernels.op`. Importing this package does not import Triton.
"""

from .op import routed_attention, triton_available
from .reference import explicit_attention

__all__ = ["explicit_attention", "routed_attention", "triton_available"]
