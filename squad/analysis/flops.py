"""Parameter and MAC counts from the routed shapes (the papers call multiply-accumulates "FLOPs").

MACs per image per task are summed from every layer's ``macs(n)`` at the token counts it actually sees: routed
layers count k experts per token plus the router, MoD blocks count their block at k = ceil(C·N) tokens, MoNE blocks
count each nested width at its group size. Attention matmuls (QKᵀ and AV) are included, norms and softmax are not.
Pruned (extracted) layers count the experts and top-k they have now; an exactly routed router still scores every
original expert and is counted that way. `tests/test_profile.py` and `tests/test_extract.py` check these counts
against PyTorch's FLOP counter on real forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import ExpertMLP
from squad.layers.mone import MoNEBlock
from squad.layers.mone_capacity import capacity_distribution
from squad.layers.routing import TaskLinear
from squad.models.vit import SquadViT


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _active_params(model: SquadViT, task: int) -> int:
    """Parameters one token of ``task`` touches: shared weights, its own router rows/embedding/head, k experts."""
    total = 0
    seen = set()
    embed_counted = False
    for name, module in model.named_modules():
        if isinstance(module, TaskLinear):  # one row per task (rows of added tasks have the same size)
            total += module.weight[0].numel() + (module.bias[0].numel() if module.bias is not None else 0)
            seen.update(id(p) for p in module.parameters())
        elif isinstance(module, ExpertMLP):
            per = sum(p[0].numel() for p in module.parameters())
            mlp = model.get_submodule(name.rsplit(".", 1)[0])
            total += per * min(mlp.cfg.top_k, module.num_experts)
            seen.update(id(p) for p in module.parameters())
        elif isinstance(module, MoEAttention):
            total += (module.q[0].numel() + module.o[0].numel()) * module.top_k
            seen.update({id(module.q), id(module.o)})
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        if name in ("task_embed", "task_embed_extra"):  # one row of the [T, D] table
            total += 0 if embed_counted else p.shape[1]
            embed_counted = True
        elif name.startswith("heads."):
            if name.split(".")[1] == model.task_names[task]:
                total += p.numel()
        else:
            total += p.numel()
    return total


def backbone_macs(model: SquadViT, mone_capacity: float | None = None) -> int:
    """MACs of the backbone per image (patch embedding + blocks), for one task."""
    cfg = model.cfg
    n = cfg.num_tokens
    n_patches = cfg.grid**2
    macs = n_patches * cfg.in_chans * cfg.patch_size**2 * cfg.embed_dim
    cap = capacity_distribution(round(mone_capacity or model.mone_capacity, 6), cfg.mone.num_experts,
                                cfg.mone.beta, cfg.mone.delta)
    for block in model.blocks:
        macs += block.macs(n, cap) if isinstance(block, MoNEBlock) else block.macs(n)
    return macs + _unpruned_router_macs(model, n)


def _unpruned_router_macs(model: SquadViT, n: int) -> int:
    """Router MACs a pruned MoE attention layer's own count misses: with exact routing its router still scores
    every original expert, while the layer counts the router at the experts it holds."""
    extra = 0
    for block in model.blocks:
        inner, tokens = (block.block, block.capacity_tokens(n)) if isinstance(block, MoDBlock) else (block, n)
        attn = getattr(inner, "attn", None)
        if isinstance(attn, MoEAttention):
            extra += tokens * attn.kv.in_features * (attn.router.num_experts - attn.num_experts)
    return extra


def profile(model: SquadViT, tasks: Sequence[str] | None = None, mone_capacity: float | None = None) -> dict:
    """Parameter and MAC summary of a model.

    Args:
        model: the model.
        tasks: tasks to report (default: all).
        mone_capacity: effective capacity for MoNE blocks (default: the model's current one).

    Returns:
        ``{"params": total, "backbone_macs": per image, "tasks": {task: {"active_params", "macs"}}}`` where a
        task's MACs are per image (backbone + its head).
    """
    tasks = list(model.task_names if tasks is None else tasks)
    bb = backbone_macs(model, mone_capacity)
    n_patches = model.cfg.grid**2
    out = {"params": count_params(model), "backbone_macs": bb, "tasks": {}}
    for name in tasks:
        (t,) = model.task_index([name])
        canonical = model.task_names[t]
        out["tasks"][canonical] = {
            "active_params": _active_params(model, t),
            "macs": bb + model.heads[canonical].macs(n_patches),
        }
    return out
