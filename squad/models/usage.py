"""Expert usage statistics per routed layer and task: hard selection counts and soft probability sums.

Accumulated over steps (training logs, calibration passes), summed across ranks, saved with the model; extraction
and the figures read the frequencies: for task t, ``freq[e] = tokens of t that selected e / tokens of t`` (so the
frequencies of a top-k layer sum to k, and θ = 0.01 means "used by fewer than 1 % of the task's tokens").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from squad.distributed import is_distributed
from squad.layers.base import EXPERT_KINDS
from squad.layers.context import RouterStats


class _SettledTable:
    """A table of `ExpertUsage` (``counts``, ``mass``, ``tokens``): the pending device sums are added to it before it
    is read or replaced."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, usage: ExpertUsage | None, owner: type | None = None):
        if usage is None:
            return self
        usage._settle()
        return getattr(usage, self.attr)

    def __set__(self, usage: ExpertUsage, value: dict[str, torch.Tensor]) -> None:
        usage._settle()
        setattr(usage, self.attr, value)


class ExpertUsage:
    """Running sums of router statistics, keyed by layer name.

    Args:
        tasks: the model's task names (rows of every table).
    """

    def __init__(self, tasks: Sequence[str]):
        self.tasks = list(tasks)
        self._counts: dict[str, torch.Tensor] = {}  # layer → [T, E] float64 hard selections
        self._mass: dict[str, torch.Tensor] = {}  # layer → [T, E] float64 soft probability sums
        self._tokens: dict[str, torch.Tensor] = {}  # layer → [T] float64 tokens routed
        # layer → [counts, mass, tokens] summed where the statistics live (a GPU) since the tables were last read
        self._pending: dict[str, list[torch.Tensor]] = {}
        self.kinds: dict[str, str] = {}
        self.top_k: dict[str, int] = {}

    # The tables (host float64), with the statistics added since they were last read: reading them is the one host
    # copy per layer and table, however many passes were added (`update` itself never waits for a GPU).
    counts = _SettledTable()
    mass = _SettledTable()
    tokens = _SettledTable()

    def update(self, stats: Sequence[RouterStats]) -> None:
        """Adds one forward pass's statistics (summed on their device: no host copy, no wait for a GPU)."""
        for s in stats:
            counts = s.counts.detach().double()
            mass = s.mass.detach().double() if s.mass is not None else torch.zeros_like(counts)
            tokens = s.tokens.detach().double()
            if s.name not in self.kinds:
                self.kinds[s.name] = s.kind
                self.top_k[s.name] = s.top_k
            pending = self._pending.get(s.name)
            if pending is None:
                self._pending[s.name] = [counts.clone(), mass.clone(), tokens.clone()]
            else:
                for acc, value in zip(pending, (counts, mass, tokens), strict=True):
                    acc += value

    def _settle(self) -> None:
        """Adds the pending device sums into the host tables."""
        pending, self._pending = self._pending, {}
        for name, (counts, mass, tokens) in pending.items():
            if name not in self._counts:
                self._counts[name] = torch.zeros(counts.shape, dtype=torch.float64)
                self._mass[name] = torch.zeros(counts.shape, dtype=torch.float64)
                self._tokens[name] = torch.zeros(len(self.tasks), dtype=torch.float64)
            self._counts[name] += counts.cpu()
            self._mass[name] += mass.cpu()
            self._tokens[name] += tokens.cpu()

    def reset(self) -> None:
        self._pending = {}
        for table in (self._counts, self._mass, self._tokens):
            for v in table.values():
                v.zero_()

    def all_reduce(self) -> None:
        """Sums the tables over all ranks.

        The ranks first agree on the layers (the union of theirs): a rank that has not seen a layer yet (no step since
        a resume, or no token of it routed there) counts zero for it, so every rank makes the same collective calls.

        Raises:
            ValueError: two ranks hold one layer with different shapes (named), on every rank.
        """
        if not is_distributed():
            return
        mine = {name: (tuple(self.counts[name].shape), self.kinds[name], self.top_k[name]) for name in self.counts}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        layers: dict[str, tuple] = {}
        for rank, theirs in enumerate(every):
            for name, spec in theirs.items():
                if name in layers and layers[name][0] != spec[0]:
                    raise ValueError(f"expert usage of layer {name}: shape {list(spec[0])} on rank {rank}, "
                                     f"{list(layers[name][0])} on another rank")
                layers.setdefault(name, spec)
        for name, (shape, kind, top_k) in layers.items():
            if name not in self.counts:
                self.counts[name] = torch.zeros(shape, dtype=torch.float64)
                self.mass[name] = torch.zeros(shape, dtype=torch.float64)
                self.tokens[name] = torch.zeros(len(self.tasks), dtype=torch.float64)
                self.kinds[name] = kind
                self.top_k[name] = top_k
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
    def from_state_dict(cls, state: dict, zeroed: bool = False) -> ExpertUsage:
        """The statistics `state_dict` saved (copies of its tables).

        Args:
            state: a `state_dict`.
            zeroed: keep the layers but not the sums (every rank but one, when a run resumes: the saved sums are
                already over all ranks, and every rank must hold the same layers).
        """
        usage = cls(state["tasks"])
        for key in ("kinds", "top_k"):
            setattr(usage, key, dict(state[key]))
        for key in ("counts", "mass", "tokens"):
            setattr(usage, key, {k: torch.zeros_like(v) if zeroed else v.clone() for k, v in state[key].items()})
        return usage
