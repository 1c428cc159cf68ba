"""Parameter and MAC counts from the routed shapes (the papers call multiply-accumulates "FLOPs").

MACs per image per task are summed from every layer's ``macs(tokens, capacity=None)`` at the token counts it
actually sees: routed layers count k experts per token plus the router, MoD blocks count their block at
k = ceil(C·N) tokens, MoNE blocks count each nested width at its group size. Attention matmuls (QKᵀ and AV) are
included, norms and softmax are not. With ``mod_share`` (measured, e.g. MoD threshold inference: `mod_shares` of the
statistics an evaluation recorded) each MoD block counts its block at the measured mean number of tokens it processed
per image for each task (interpolated between whole token counts) instead of k.
Pruned (extracted) layers count the experts and top-k they have now; an exactly routed router still scores every
original expert and is counted that way (`TaskRouter.macs`). `tests/test_profile.py` and `tests/test_extract.py`
check these counts against PyTorch's FLOP counter on real forward passes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.nn as nn

from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import ExpertMLP
from squad.layers.mone import MoNEBlock
from squad.layers.routing import TaskLinear
from squad.models.usage import ExpertUsage
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
            total += per * min(mlp.top_k, module.num_experts)
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


def backbone_macs(model: SquadViT, mone_capacity: float | None = None,
                  mod_share: Mapping[str, float] | None = None) -> int:
    """MACs of the backbone per image (patch embedding + blocks), for one task.

    Every block counts itself with ``macs(tokens, capacity)``: MoNE blocks at the effective capacity, MoD blocks at
    their measured share when ``mod_share`` lists them, every other block (and MoD blocks not listed) as configured.

    Args:
        model: the model.
        mone_capacity: effective capacity for MoNE blocks (default: the model's current one).
        mod_share: MoD block name → measured share of tokens it processed (blocks not listed count k tokens).
    """
    cfg = model.cfg
    n = cfg.num_tokens
    macs = cfg.grid**2 * cfg.in_chans * cfg.patch_size**2 * cfg.embed_dim
    e_c = mone_capacity or model.mone_capacity
    share = mod_share or {}
    for block in model.blocks:
        if isinstance(block, MoNEBlock):
            macs += block.macs(n, e_c)
        else:
            macs += block.macs(n, share.get(block.layer_name) if isinstance(block, MoDBlock) else None)
    return round(macs)


def mod_shares(usage: ExpertUsage) -> dict[str, dict[str, float]]:
    """MoD block → task → share of the task's tokens the block processed, from recorded statistics.

    MoD blocks report per task the tokens they processed and skipped (`squad.layers.mod.MoDBlock`); under top-k
    routing the share is k / N, under threshold inference it is what the routers actually let through. Tasks the
    statistics saw no tokens of are left out.
    """
    out: dict[str, dict[str, float]] = {}
    for name, counts in usage.counts.items():
        if usage.kinds.get(name) != "mod":
            continue
        tokens = usage.tokens[name]
        out[name] = {t: float(counts[i, 0] / tokens[i]) for i, t in enumerate(usage.tasks) if tokens[i] > 0}
    return out


def mone_shares(usage: ExpertUsage) -> dict[str, dict[str, list[float]]]:
    """MoNE router → task → share of the task's tokens assigned to each nested expert (smallest width first)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, counts in usage.counts.items():
        if usage.kinds.get(name) != "mone":
            continue
        tokens = usage.tokens[name]
        out[name] = {t: (counts[i] / tokens[i]).tolist() for i, t in enumerate(usage.tasks) if tokens[i] > 0}
    return out


def profile(model: SquadViT, tasks: Sequence[str] | None = None, mone_capacity: float | None = None,
            mod_share: Mapping[str, Mapping[str, float]] | None = None) -> dict:
    """Parameter and MAC summary of a model.

    Args:
        model: the model.
        tasks: tasks to report (default: all).
        mone_capacity: effective capacity for MoNE blocks (default: the model's current one).
        mod_share: measured MoD token shares, block name → task → share of tokens processed (`mod_shares` of an
            evaluation's statistics, e.g. under threshold inference); each task's MACs then count its MoD blocks at
            the measured share instead of the capacity k. Default: k = ceil(C · N) tokens.

    Returns:
        ``{"params": total, "backbone_macs": per image, "tasks": {task: {"active_params", "macs"}}}`` where a
        task's MACs are per image (backbone + its head). ``backbone_macs`` always counts MoD blocks at capacity;
        with ``mod_share`` each task also gets ``"backbone_macs"`` at its measured shares.

    Raises:
        ValueError: ``mod_share`` names a block that is not a MoD block of the model, or a share outside [0, 1].
    """
    tasks = list(model.task_names if tasks is None else tasks)
    bb = backbone_macs(model, mone_capacity)
    n_patches = model.cfg.grid**2
    if mod_share is not None:
        blocks = {b.layer_name for b in model.blocks if isinstance(b, MoDBlock)}
        for layer, per_task in mod_share.items():
            if layer not in blocks:
                raise ValueError(f"mod_share: {layer!r} is not a MoD block of the model (its MoD blocks: "
                                 f"{', '.join(sorted(blocks)) or 'none'})")
            bad = {t: v for t, v in per_task.items() if not 0.0 <= v <= 1.0}
            if bad:
                raise ValueError(f"mod_share[{layer!r}]: shares must be in [0, 1], got {bad}")
    out = {"params": count_params(model), "backbone_macs": bb, "tasks": {}}
    for name in tasks:
        (t,) = model.task_index([name])
        canonical = model.task_names[t]
        entry = {"active_params": _active_params(model, t)}
        task_bb = bb
        if mod_share is not None:
            own = {layer: per_task[canonical] for layer, per_task in mod_share.items() if canonical in per_task}
            task_bb = backbone_macs(model, mone_capacity, own)
            entry["backbone_macs"] = task_bb
        entry["macs"] = task_bb + model.heads[canonical].macs(n_patches)
        out["tasks"][canonical] = entry
    return out
