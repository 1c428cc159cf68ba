"""The routed-layer contract: `RoutedLayer`, the base class of every layer that routes tokens and reports
`RouterStats`, and `EXPERT_KINDS`, the kinds whose routers choose among experts.

A routed layer has a class-level ``kind`` (``"moe"``, ``"moa"``, ``"mod"``, ``"mone"``: the ``RouterStats.kind``
it reports) and an instance ``layer_name``, its module path in the model (``"blocks.3.mlp"``), which the model sets
once built (`SquadViT._wire`) and which names its statistics. Code finds routed layers with
``isinstance(m, RoutedLayer)`` and the expert-choosing ones with ``m.kind in EXPERT_KINDS``.
"""

from __future__ import annotations

from typing import ClassVar

import torch.nn as nn

EXPERT_KINDS: tuple[str, ...] = ("moe", "moa")
"""Kinds whose routers pick k of E experts per token (MoE MLP, MoE attention): the layers the MI and balance losses
act on, that pruning slices, that usage frequencies and task relations describe."""


class RoutedLayer(nn.Module):
    """A layer that routes tokens and appends one `RouterStats` per forward pass.

    Subclasses set ``kind`` and call ``super().__init__()`` first; ``layer_name`` starts as the kind and becomes the
    module path once the model names its layers.

    Attributes:
        kind: the ``RouterStats.kind`` this layer reports.
        layer_name: the layer's module path (the ``RouterStats.name`` it reports).
    """

    kind: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        if not type(self).kind:
            raise TypeError(f"{type(self).__name__} subclasses RoutedLayer without setting its class attribute 'kind'")
        self.layer_name = type(self).kind
