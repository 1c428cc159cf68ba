"""Expert pruning: which experts a task uses and which to keep (`squad.models.surgery.keep_experts` cuts the layers).

Usage frequency of expert e for task t in one layer = share of the task's tokens that selected e (so a top-k
layer's frequencies sum to k; `squad.models.usage.ExpertUsage.frequencies`). An expert is kept when its frequency is
above θ (θ = 0 keeps every expert used at least once), or when it is among the top H % of the layer; at least one
expert per layer always stays (the most used). Only real experts are pruned: MoDE's no-op experts cost nothing
and stay selectable.

A pruned layer holds only its kept experts: each layer removes the others itself (`ExpertLayer.keep_experts`, called
by `squad.models.surgery.keep_experts`) and restricts its router to them (`TaskRouter.restrict`), with exact routing
by default — the router still scores every expert, so the gates of the kept experts are unchanged and, on data where
the removed experts were never selected, the pruned model computes exactly what the full one did. top-k shrinks to
the number of experts left when fewer than k remain.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from squad.config.tools import check_keep_top, check_theta
from squad.layers.base import EXPERT_KINDS, ExpertLayer
from squad.models.usage import ExpertUsage


def prunable_layers(model: nn.Module) -> dict[str, ExpertLayer]:
    """Layer name (its module path, as in `RouterStats.name`) → every MoE MLP and MoE attention layer, in order."""
    return {m.layer_name: m for m in model.modules() if isinstance(m, ExpertLayer)}


def real_experts(layer: ExpertLayer) -> int:
    """Experts of a layer that hold weights (no-op experts excluded)."""
    return layer.num_experts


def task_frequencies(usage: ExpertUsage, task: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Per prunable layer of ``model``, [E] usage frequency of each real expert for ``task``.

    Raises:
        ValueError: the statistics do not cover the task or one of the model's MoE layers, or their expert count
            differs from the layer's (statistics of another model).
    """
    if task not in usage.tasks:
        raise ValueError(f"the usage statistics have no task {task!r} (they cover {', '.join(usage.tasks)})")
    freqs = usage.frequencies(task, EXPERT_KINDS)
    out = {}
    for name, layer in prunable_layers(model).items():
        if name not in freqs:
            raise ValueError(f"the usage statistics have no layer {name!r} (they cover {', '.join(sorted(freqs))}); "
                             f"were they collected on another model?")
        f = freqs[name]
        e = real_experts(layer)
        total = layer.router.num_experts
        if f.numel() != total:
            raise ValueError(f"usage statistics of layer {name} cover {f.numel()} experts, the layer routes to {total}")
        if usage.tokens[name][usage.tasks.index(task)] <= 0:
            raise ValueError(f"the usage statistics saw no tokens of task {task!r} in layer {name}")
        out[name] = f[:e].double()
    return out


def choose_experts(freqs: dict[str, torch.Tensor], theta: float | None = None,
                   keep_top: float | None = None) -> dict[str, list[int]]:
    """The experts to keep per layer, in increasing index order.

    Args:
        freqs: layer → [E] usage frequencies (`task_frequencies`).
        theta: keep experts with frequency > θ, θ in [0, 1).
        keep_top: instead, keep the ceil(H · E) most used experts, H in (0, 1] (ties: lower index first).

    Raises:
        ValueError: neither or both criteria, or a value out of range.
    """
    if (theta is None) == (keep_top is None):
        raise ValueError("give exactly one of theta (a usage threshold) or keep_top (a share of experts per layer)")
    check_theta(theta)
    check_keep_top(keep_top)
    kept = {}
    for name, f in freqs.items():
        e = f.numel()
        order = sorted(range(e), key=lambda i: (-float(f[i]), i))  # most used first
        if theta is not None:
            chosen = [i for i in range(e) if float(f[i]) > theta]
        else:
            chosen = order[: max(1, math.ceil(keep_top * e - 1e-9))]
        kept[name] = sorted(chosen) if chosen else [order[0]]
    return kept


def pruned_summary(model: nn.Module, kept: dict[str, list[int]], before: dict[str, int]) -> dict[str, dict]:
    """Per layer: kind, experts kept (original indices), experts before, top-k after."""
    out = {}
    for name, layer in prunable_layers(model).items():
        out[name] = {"kind": layer.kind, "kept": list(kept[name]), "experts_before": before[name],
                     "experts_after": layer.num_experts, "top_k": layer.top_k}
    return out
