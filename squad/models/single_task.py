"""`SingleTaskModel`: one task's pruned subnetwork as a standalone model (written by tools/extract.py, loaded by
`squad.load`); ``model(images)`` returns that task's prediction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT


class SingleTaskModel(nn.Module):
    """An extracted model: ``model(images)`` → the task's prediction ([B, C, H, W] dense, [B, C] class logits).

    Attributes:
        model: the pruned single-task `SquadViT` (``model.model(images, [task])`` gives the full `SquadOutput`).
        task: the task's canonical name.
        kept: layer name → kept expert indices (numbering of the original model).
        exact: exact routing (the router scores every original expert) or the paper's renormalised softmax.
        usage: expert-usage statistics saved with the model (`ExpertUsage`), or None; extracted files save none (the
            statistics the extraction used are summarised in ``meta["report"]``).
        meta: the file's metadata when loaded by `squad.load` (format, path, config, task, kept, exact, report);
            empty for a model built in memory.
    """

    def __init__(self, model: SquadViT, task: str, kept: dict[str, list[int]], exact: bool,
                 usage: ExpertUsage | None = None, meta: dict[str, Any] | None = None):
        super().__init__()
        self.model = model
        self.task = task
        self.kept = {k: list(v) for k, v in kept.items()}
        self.exact = exact
        self.usage = usage
        self.meta = dict(meta or {})

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, C, H, W] → the task's prediction."""
        return self.model(images, [self.task]).preds[self.task]

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Final normed tokens [B, N, D]."""
        return self.model.forward_features(images, self.task)
