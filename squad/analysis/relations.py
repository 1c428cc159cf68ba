"""Task relations from routing (Mod-Squad Fig. 5): how much two tasks share experts on the same input.

For a routed layer (MoE attention or MoE MLP) and tasks a, b, the relation is the mean over input tokens (every
token of every image) of ``|S_a ∩ S_b| / k``, where S_t are the k experts task t's router selects for that token.
It is 1 on the diagonal and 0 for tasks that never share an expert. Matrices are given per layer, averaged over
all routed layers, and for the first, middle and last routed layer.

The per-token selections come from one fused forward pass with ``model.record_routing`` on (routers then report
`RouterStats.experts`). Inside a Mixture-of-Depths block each task processes its own subset of tokens; there the
relation averages over the tokens both tasks process. The MoD selection is recomputed from the block's own scores
in a forward pre-hook and checked against the tokens the inner block actually receives, so a change in MoD's
selection rule fails loudly instead of misaligning tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from squad.layers.base import EXPERT_KINDS
from squad.layers.mod import MoDBlock
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadOutput, SquadViT


@dataclasses.dataclass
class TaskRelations:
    """Accumulated expert-sharing statistics.

    Attributes:
        tasks: the tasks (rows and columns).
        layers: routed layers in forward order.
        kinds: layer → ``"moe"`` or ``"moa"``.
        overlap: layer → [T, T] float64 sum over tokens of |S_a ∩ S_b| / k.
        tokens: layer → [T, T] float64 tokens both tasks routed through the layer.
    """

    tasks: list[str]
    layers: list[str] = dataclasses.field(default_factory=list)
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    overlap: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def matrix(self, layer: str) -> torch.Tensor:
        """[T, T] mean share of experts for one layer (NaN where two tasks never routed the same token)."""
        both = self.tokens[layer]
        return torch.where(both > 0, self.overlap[layer] / both.clamp_min(1.0), torch.full_like(both, float("nan")))

    def summary(self) -> dict[str, tuple[str, torch.Tensor]]:
        """``{"all" | "first" | "middle" | "last": (title, [T, T] matrix)}``; "all" is the mean over layers."""
        if not self.layers:
            raise ValueError("no routed (MoE attention / MoE MLP) layers were recorded")
        mats = [self.matrix(name) for name in self.layers]
        mean = torch.stack(mats).nanmean(0)
        picks = {"first": 0, "middle": len(self.layers) // 2, "last": len(self.layers) - 1}
        out = {"all": (f"all {len(self.layers)} routed layers", mean)}
        for key, i in picks.items():
            name = self.layers[i]
            out[key] = (f"{key} routed layer ({name}, {self.kinds[name]})", mats[i])
        return out

    def to_dict(self) -> dict:
        """Plain lists for JSON: the summary matrices and every layer's matrix."""
        nan_to_none = lambda m: [[None if v != v else round(float(v), 6) for v in row] for row in m.tolist()]  # noqa: E731
        return {"tasks": list(self.tasks),
                "summary": {k: {"title": t, "matrix": nan_to_none(m)} for k, (t, m) in self.summary().items()},
                "layers": {name: {"kind": self.kinds[name], "matrix": nan_to_none(self.matrix(name))}
                           for name in self.layers}}


class _ModSelections:
    """Forward pre-hooks that record which tokens each MoD block sends through its inner block."""

    def __init__(self, model: SquadViT):
        self.selected: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # MoD name → (idx [R, k], valid [R, k])
        self.handles = []
        for name, m in model.named_modules():
            if isinstance(m, MoDBlock):
                self.handles.append(m.register_forward_pre_hook(self._outer(name)))
                self.handles.append(m.block.register_forward_pre_hook(self._inner(name)))

    def _outer(self, name: str):
        def hook(module: MoDBlock, args):
            x, ctx = args[0], args[1]
            select, logits = module._scores(x, ctx)  # the block's own scores (same call as its forward)
            if module.keep_cls:
                select = select.clone()
                select[:, 0] = float("inf")
            if logits is not None and not module.training and module.cfg.inference == "threshold":
                keep = logits > 0
                if module.keep_cls:
                    keep[:, 0] = True
                k = int(keep.sum(1).max().item())
            else:
                keep, k = None, module.capacity_tokens(x.shape[1])
            if k == 0:
                self.selected[name] = (x.new_zeros(x.shape[0], 0, dtype=torch.long),) * 2
                return
            idx = select.topk(k, dim=1).indices.sort(dim=1).values  # [R, k]
            valid = keep.gather(1, idx) if keep is not None else torch.ones_like(idx, dtype=torch.bool)
            self.selected[name] = (idx, valid)
            self._expect = (name, x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[2])))
        return hook

    def _inner(self, name: str):
        def hook(module, args):
            expect = getattr(self, "_expect", None)
            if expect is None or expect[0] != name or not torch.equal(expect[1], args[0]):
                raise RuntimeError(f"relations: could not reproduce the token selection of MoD block {name}; "
                                   f"squad.analysis.relations must follow squad.layers.mod's selection rule")
            self._expect = None
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _positions(selected: dict, layer: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The MoD selection a layer's rows come from (None for a layer outside MoD blocks)."""
    best = None
    for prefix, value in selected.items():
        if layer.startswith(prefix + ".") and (best is None or len(prefix) > len(best[0])):
            best = (prefix, value)
    return None if best is None else best[1]


def update_relations(rel: TaskRelations, out: SquadOutput, selected: dict, num_tokens: int) -> None:
    """Adds one recorded forward pass (every image ran every task of ``rel.tasks``, task-major rows)."""
    t = len(rel.tasks)
    for s in out.stats:
        if s.kind not in EXPERT_KINDS:
            continue
        if s.experts is None:
            raise ValueError(f"layer {s.name} did not record its routing (set model.record_routing = True)")
        rows = out.image_index[rel.tasks[0]].numel() * t
        k = s.experts.shape[1]
        e = s.counts.shape[1]
        sel = _positions(selected, s.name)
        n = s.experts.shape[0] // rows
        experts = s.experts.view(rows, n, k)
        if sel is None:
            processed = torch.ones(rows, n, dtype=torch.bool, device=experts.device)
        else:  # back to the block input's token positions; skipped tokens select nothing
            idx, valid = sel
            full = experts.new_zeros(rows, num_tokens, k)
            full.scatter_(1, idx.unsqueeze(-1).expand(-1, -1, k), experts)
            processed = torch.zeros(rows, num_tokens, dtype=torch.bool, device=experts.device)
            processed.scatter_(1, idx, valid)
            experts, n = full, num_tokens
        onehot = torch.zeros(rows, n, e, dtype=torch.float64, device=experts.device)
        onehot.scatter_(2, experts, 1.0)
        onehot *= processed.unsqueeze(-1)
        onehot = onehot.view(t, -1, e)  # [T, B·N, E]
        done = processed.view(t, -1).double()  # [T, B·N]
        overlap = torch.einsum("aue,bue->ab", onehot, onehot).cpu() / k
        both = (done @ done.T).cpu()
        if s.name not in rel.overlap:
            rel.layers.append(s.name)
            rel.kinds[s.name] = s.kind
            rel.overlap[s.name] = torch.zeros(t, t, dtype=torch.float64)
            rel.tokens[s.name] = torch.zeros(t, t, dtype=torch.float64)
        rel.overlap[s.name] += overlap
        rel.tokens[s.name] += both


@torch.no_grad()
def task_relations(model: SquadViT, batches: Iterable, tasks: Sequence[str] | None = None, max_batches: int = 0,
                   device: torch.device | str | None = None, usage: ExpertUsage | None = None) -> TaskRelations:
    """Task-relation statistics of ``model`` over ``batches`` (image tensors or data batches with ``"rgb"``).

    Args:
        model: the multi-task model (run in eval mode).
        batches: calibration images.
        tasks: the tasks to relate (default: all of the model's).
        max_batches: stop after this many batches (0 = all).
        device: where to run (default: the model's device).
        usage: when given, the pass's usage statistics are added to it too.

    Returns:
        `TaskRelations`; ``.summary()`` gives the all/first/middle/last matrices.
    """
    tasks = [model.task_names[i] for i in model.task_index(list(tasks or model.task_names))]
    device = device or next(model.parameters()).device
    rel = TaskRelations(tasks)
    hooks = _ModSelections(model)
    was_training, was_recording = model.training, model.record_routing
    model.eval()
    model.record_routing = True
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            images = (batch["rgb"] if isinstance(batch, dict) else batch).to(device)
            hooks.selected.clear()
            out = model(images, tasks)
            update_relations(rel, out, hooks.selected, model.cfg.num_tokens)
            if usage is not None:
                usage.update(out.stats)
    finally:
        hooks.close()
        model.record_routing = was_recording
        model.train(was_training)
    if not rel.layers:
        raise ValueError("task_relations: no batches, or the model has no MoE attention / MoE MLP layers")
    return rel
