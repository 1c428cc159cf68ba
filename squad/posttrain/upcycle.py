"""Sparse upcycling: a Mod-Squad (or any SquadViT) initialised from a dense ViT (Komatsuzaki et al. 2023).

``upcycle(dense, cfg)`` builds ``cfg``'s model and fills it from ``dense``: a timm VisionTransformer state dict on
disk (``.pth``/``.pt``/``.safetensors``), a timm module, or a dense squad model (a `SquadViT` whose blocks are all
dense attention + dense MLP, or its ``model.pt`` / run folder / checkpoint tag). Block ``i`` of the new model comes
from dense block ``i``; routers start fresh.

The maps themselves (what goes where, and when step 0 is exact) are `squad.models.transfer`'s; reading the dense
model from a file is `squad.io.weights`'s. This module is the public entry point and the step-0 check (`drift`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from squad.config.loading import load_config
from squad.config.model import ModelConfig, SquadConfig
from squad.io.weights import read_dense_source
from squad.layers.mone import MoNEBlock
from squad.models.transfer import KVScheme, MoEScheme, TaskEmbedInit, dense_source, transfer
from squad.models.vit import SquadViT, build_model


def _as_model_config(cfg: ModelConfig | SquadConfig | str | Path) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, str | Path):
        cfg = load_config(cfg)
    model = getattr(cfg, "model", None)
    if not isinstance(model, ModelConfig):
        raise TypeError(f"upcycle: cfg must be a ModelConfig, a SquadConfig/RunConfig, a YAML path or a model name, "
                        f"got {type(cfg).__name__}")
    return model


def upcycle(dense: SquadViT | nn.Module | Mapping | str | Path, cfg: ModelConfig | SquadConfig | str | Path, *,
            moe: MoEScheme = "auto", kv: KVScheme = "mean", task_embed: TaskEmbedInit = "zero") -> SquadViT:
    """A model of ``cfg`` initialised from a dense ViT (sparse upcycling; schemes in the module docstring).

    Args:
        dense: a timm VisionTransformer state dict (file ``.pth``/``.pt``/``.safetensors``, or the dict), a timm
            module, or a dense squad model (`SquadViT`, or its ``model.pt`` / run folder / checkpoint tag).
        cfg: the new model's config, as `squad.build_model` takes it (ModelConfig, SquadConfig/RunConfig, YAML path
            or a registered name). Its widths, depth, patch and image size must be the dense model's.
        moe: MoE-MLP scheme: ``"auto"`` (copy when experts are at least as wide as the dense MLP, else partition),
            ``"copy"`` or ``"partition"``.
        kv: MoE-attention shared key/value head: ``"mean"`` of the dense heads' or the ``"first"`` head's.
        task_embed: task embeddings the source does not provide: ``"zero"`` (keeps step 0 exact) or ``"fresh"``.

    Returns:
        The new `SquadViT` in eval mode; ``model.upcycle_report`` says what came from where (`transfer`). Routers
        and anything else not filled keep the init ``build_model(cfg)`` draws from torch's global RNG at the call
        (seed it first for reproducibility).

    Raises:
        FileNotFoundError: ``dense`` names nothing.
        ValueError: ``dense`` is not a dense ViT, or does not fit ``cfg`` (the message names the tensor, both
            shapes and the config key).
        ConfigError: an invalid ``cfg``.
    """
    mcfg = _as_model_config(cfg)
    target = build_model(mcfg)  # first: its fresh parts are what build_model(cfg) would draw now
    if isinstance(dense, str | Path):
        source, copy_heads = read_dense_source(dense, mcfg)
    else:
        source, copy_heads = dense_source(dense, mcfg)
    name = str(dense) if isinstance(dense, str | Path) else "the dense model"
    target.upcycle_report = transfer(source, target, moe=moe, kv=kv, task_embed=task_embed, copy_heads=copy_heads,
                                     source_name=name)
    return target.eval()


# ---------------------------------------------------------------------------------------------- step-0 drift
@torch.no_grad()
def drift(model: SquadViT, reference: SquadViT, images: torch.Tensor, tasks: Sequence[str] | None = None) -> dict:
    """How far ``model``'s step-0 function is from ``reference``'s on ``images`` (both in eval mode).

    Args:
        model: e.g. the upcycled model.
        reference: e.g. the dense model it came from (same depth and widths).
        images: [B, C, H, W].
        tasks: tasks to compare (default: ``model``'s tasks that ``reference`` has, else ``model``'s first task,
            run on ``reference``'s first task).

    Returns:
        ``features`` (task → relative error ‖f − f_ref‖ / ‖f_ref‖ of the final tokens), ``max_abs`` (task → largest
        absolute difference), ``blocks`` (relative error of each block's output, averaged over the tasks; MoNE
        blocks are left out, their tokens are in routed order) and ``max_features`` (the worst task).
    """
    was = model.training, reference.training
    model.eval()
    reference.eval()
    common = [t for t in model.task_names if t in reference.task_names]
    pairs = [(t, t) for t in (tasks or common)] or [(model.task_names[0], reference.task_names[0])]
    features, max_abs, blocks = {}, {}, [0.0] * len(model.blocks)
    for task, ref_task in pairs:
        outs: dict[str, list[torch.Tensor]] = {"m": [], "r": []}
        hooks = [b.register_forward_hook(lambda _m, _i, o, store=outs[key]: store.append(o))
                 for key, mdl in (("m", model), ("r", reference)) for b in mdl.blocks]
        try:
            f = model.forward_features(images, task)
            g = reference.forward_features(images, ref_task)
        finally:
            for hk in hooks:
                hk.remove()
        features[task] = float((f - g).norm() / g.norm().clamp_min(1e-12))
        max_abs[task] = float((f - g).abs().max())
        for i, (a, b) in enumerate(zip(outs["m"], outs["r"], strict=True)):
            if not isinstance(model.blocks[i], MoNEBlock):
                blocks[i] += float((a - b).norm() / b.norm().clamp_min(1e-12)) / len(pairs)
    model.train(was[0])
    reference.train(was[1])
    return {"features": features, "max_abs": max_abs, "blocks": blocks, "max_features": max(features.values())}
