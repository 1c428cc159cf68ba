"""timm VisionTransformer ↔ SquadViT: dense SquadViT blocks use timm's parameter names and layout, so a timm
model's weights load as they are (``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.i.{norm1, attn.qkv,
attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``, and ``head`` for a token-pooled classifier)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from squad.config.base import deep_merge
from squad.config.model import BlockSpec, HeadConfig, SquadConfig, load_config
from squad.models.vit import SquadViT


def timm_config_dict(vit: nn.Module) -> dict:
    """Reads the architecture of a timm VisionTransformer; rejects features SquadViT does not model."""
    for attr, ok, what in [
        ("no_embed_class", lambda v: not v, "no_embed_class=True"),
        ("num_reg_tokens", lambda v: v == 0, "register tokens"),
        ("dynamic_img_size", lambda v: not v, "dynamic_img_size=True"),
    ]:
        if hasattr(vit, attr) and not ok(getattr(vit, attr)):
            raise ValueError(f"from_timm: {what} is not supported")
    if not isinstance(getattr(vit, "norm_pre", nn.Identity()), nn.Identity):
        raise ValueError("from_timm: pre-norm ViTs (norm_pre) are not supported")
    block = vit.blocks[0]
    for name in ("ls1", "ls2"):
        if not isinstance(getattr(block, name, nn.Identity()), nn.Identity):
            raise ValueError("from_timm: layer scale is not supported")
    attn = block.attn
    if not isinstance(getattr(attn, "q_norm", nn.Identity()), nn.Identity):
        raise ValueError("from_timm: qk-norm is not supported")
    embed = vit.patch_embed
    img = embed.img_size[0] if isinstance(embed.img_size, tuple | list) else embed.img_size
    patch = embed.patch_size[0] if isinstance(embed.patch_size, tuple | list) else embed.patch_size
    dim = vit.embed_dim
    return {
        "img_size": int(img),
        "patch_size": int(patch),
        "in_chans": int(embed.proj.in_channels),
        "embed_dim": int(dim),
        "depth": len(vit.blocks),
        "num_heads": int(attn.num_heads),
        "mlp_ratio": block.mlp.fc1.out_features / dim,
        "qkv_bias": attn.qkv.bias is not None,
        "class_token": vit.cls_token is not None,
    }


def _as_data(items: Sequence[HeadConfig | BlockSpec | str | dict], what: str) -> list[str | dict]:
    """Heads/plan entries as YAML-like data: dataclasses → mappings; task names and mappings as they are."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, HeadConfig | BlockSpec):
            out.append(dataclasses.asdict(item))
        elif isinstance(item, str | dict):
            out.append(item)
        else:
            raise TypeError(f"from_timm: {what}[{i}] must be a task name, a mapping or a "
                            f"{'HeadConfig' if what == 'heads' else 'BlockSpec'}, got {type(item).__name__}")
    return out


def from_timm(vit: nn.Module, heads: Sequence[HeadConfig | str | dict] | str | None = None,
              plan: Sequence[BlockSpec | dict] | None = None, overrides: dict | None = None) -> SquadViT:
    """A SquadViT carrying a timm VisionTransformer's weights.

    Args:
        vit: a ``timm.models.vision_transformer.VisionTransformer`` (weights already in it; nothing is downloaded).
        heads: task heads, as in YAML's ``model.heads``: task names from `squad.tasks` (``"depth_euclidean"``; one
            name alone is a list of one), ``{name, kind, channels}`` mappings, or `HeadConfig`. Default: the timm
            classifier as a ``token`` head named ``"timm"`` (weights copied) when it has one and pools the class
            token.
        plan: layer plan as `BlockSpec` or mappings like YAML's ``model.plan`` (default: all dense). Dense
            attention/MLP weights are copied into every block whose attention/MLP is dense (also inside MoD
            blocks); routed parts keep their fresh init.
        overrides: extra ModelConfig fields (e.g. ``{"mod": {"capacity": 0.5}}``), merged into the config.

    Returns:
        The model; with the default plan its ``forward_features`` equals timm's.

    Raises:
        ConfigError: a bad head, plan entry or override (named as its ``model.`` key).
        ValueError: a timm feature SquadViT does not model.
    """
    arch = timm_config_dict(vit)
    copy_head = False
    if heads is None:
        n_cls = getattr(vit, "num_classes", 0)
        if n_cls and getattr(vit, "global_pool", "token") == "token":
            heads = [HeadConfig("timm", "token", int(n_cls))]
            copy_head = True
        else:
            heads = [HeadConfig("features", "class", 1)]
    elif isinstance(heads, str | dict | HeadConfig):
        heads = [heads]
    data = {**arch, "task_embed": "none", "heads": _as_data(heads, "heads"),
            "plan": _as_data(plan or [BlockSpec()], "plan")}
    cfg = load_config({"model": deep_merge(data, overrides or {})}, cls=SquadConfig).model
    model = SquadViT(cfg)
    load_timm_weights(model, vit.state_dict(), head="timm" if copy_head else None)
    return model


def load_timm_weights(model: SquadViT, state: dict[str, torch.Tensor], head: str | None = None) -> list[str]:
    """Copies a timm ViT state dict into the dense parts of ``model``.

    Args:
        model: the target model.
        state: timm ``state_dict()`` (or a checkpoint's ``model``/``state_dict`` entry).
        head: name of a ``token`` head to receive timm's ``head.*`` weights.

    Returns:
        Names of ``model`` parameters that received no timm weight (routers, experts, heads...).
    """
    own = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("head."):
            if head is not None:
                mapped[f"heads.{head}.fc.{key[5:]}"] = value
            continue
        if key.startswith("fc_norm.") or key.startswith("head_drop"):
            continue
        if key.startswith("blocks."):
            parts = key.split(".")
            target = key
            if f"blocks.{parts[1]}.block.{'.'.join(parts[2:])}" in own:  # a MoD-wrapped block
                target = f"blocks.{parts[1]}.block.{'.'.join(parts[2:])}"
            mapped[target] = value
        else:
            mapped[key] = value
    # timm's dense block weights have no home where this model's block is routed; anything else must fit
    other = [k for k in mapped if k not in own and not k.startswith("blocks.")]
    if other:
        raise ValueError(f"timm weights do not fit this model: no parameter for {other[:3]}")
    for k, v in mapped.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"timm weight {k}: shape {list(v.shape)} does not match the model's {list(own[k].shape)}")
    model.load_state_dict({k: v for k, v in mapped.items() if k in own}, strict=False)
    return sorted(set(own) - set(mapped))


def load_timm_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads a timm ViT state dict saved on disk (``.pth``/``.pt`` via torch.load(weights_only) or safetensors)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"timm weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    return state
