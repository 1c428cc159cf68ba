"""Expert usage statistics per routed layer and task: hard selection counts and soft probability sums.

Accumulated over steps (training logs, calibration passes), summed across ranks, saved with the model; extraction
and the figures read the frequencies: for task t, ``freq[e] = tokens of t that selected e / tokens of t`` (so the
frequencies of a top-k layer sum to k, and θ = 0.01 means "used by fewer than 1 % of the task's tokens").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from squad.layers.base import EXPERT_KINDS
from squad.layers.context import RouterStats
from squad.train.distributed import is_distributed


class ExpertUsage:
    """Running sums of router statistics, keyed by layer name.

    Args:
        tasks: the model's task names (rows of every table).
    """

    def __init__(self, tasks: Sequence[str]):
        self.tasks = list(tasks)
        self.counts: dict[str, torch.Tensor] = {}  # layer → [T, E] float64 hard selections
        self.mass: dict[str, torch.Tensor] = {}  # layer → [T, E] float64 soft probability sums
        self.tokens: dict[str, torch.Tensor] = {}  # layer → [T] float64 tokens routed
        self.kinds: dict[str, str] = {}
        self.top_k: dict[str, int] = {}

    def update(self, stats: Sequence[RouterStats]) -> None:
        """Adds one forward pass's statistics."""
        for s in stats:
            counts = s.counts.detach().double().cpu()
            if s.name not in self.counts:
                self.counts[s.name] = torch.zeros_like(counts)
                self.mass[s.name] = torch.zeros_like(counts)
                self.tokens[s.name] = torch.zeros(len(self.tasks), dtype=torch.float64)
                self.kinds[s.name] = s.kind
                self.top_k[s.name] = s.top_k
            self.counts[s.name] += counts
            if s.mass is not None:
                self.mass[s.name] += s.mass.detach().double().cpu()
            self.tokens[s.name] += s.tokens.detach().double().cpu()

    def reset(self) -> None:
        for table in (self.counts, self.mass, self.tokens):
            for v in table.values():
                v.zero_()

    def all_reduce(self) -> None:
        """Sums the tables over all ranks (every rank must hold the same layers, in the same order)."""
        if not is_distributed():
            return
        for name in sorted(self.counts):
            for table in (self.counts, self.mass, self.tokens):
                t = table[name].clone()
                dist.all_reduce(t)
                table[name] = t

    def frequencies(self, task: str, kinds: Sequence[str] = EXPERT_KINDS) -> dict[str, torch.Tensor]:
        """Per layer, [E] share of the task's tokens that selected each expert."""
        t = self.tasks.index(task)
        out = {}
        for name, counts in self.counts.items():
            if self.kinds[name] in kinds:
                out[name] = counts[t] / self.tokens[name][t].clamp_min(1.0)
        return out

    def selection_share(self, kinds: Sequence[str] = EXPERT_KINDS) -> dict[str, torch.Tensor]:
        """Per layer, [T, E] share of each task's selections that went to each expert (rows sum to 1)."""
        out = {}
        for name, counts in self.counts.items():
            if self.kinds[name] in kinds:
                out[name] = counts / counts.sum(1, keepdim=True).clamp_min(1.0)
        return out

    def state_dict(self) -> dict:
        """Plain tensors and lists (loadable with ``torch.load(weights_only=True)``)."""
        return {"tasks": list(self.tasks), "counts": dict(self.counts), "mass": dict(self.mass),
                "tokens": dict(self.tokens), "kinds": dict(self.kinds), "top_k": dict(self.top_k)}

    @classmethod
    def from_state_dict(cls, state: dict) -> ExpertUsage:
        usage = cls(state["tasks"])
        for key in ("counts", "mass", "tokens", "kinds", "top_k"):
            setattr(usage, key, dict(state[key]))
        return usage
