"""timm VisionTransformer ↔ SquadViT: dense SquadViT blocks use timm's parameter names and layout, so a timm
model's weights load as they are (``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.i.{norm1, attn.qkv,
attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``).

Pooling: a class-token ViT (``global_pool="token"``) ends in ``norm`` and its classifier ``head`` becomes a
``token`` head. An average-pooled ViT (``global_pool="avg"``, timm's default ``fc_norm``) has no ``norm`` on its
tokens; its LayerNorm ``fc_norm`` comes after pooling. SquadViT models it with ``final_norm: false`` and a ``class``
head (patch-token mean → LayerNorm ← ``fc_norm`` → Linear ← ``head``), so features and logits equal timm's. Other
poolings (``max``, ``avgmax``, attention pooling ``map``) are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from squad.config.base import deep_merge
from squad.config.loading import load_config
from squad.config.model import BlockSpec, HeadConfig, SquadConfig
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
    pool = timm_pooling(vit)
    act = getattr(block.mlp, "act", None)
    if act is not None and not (isinstance(act, nn.GELU) and act.approximate == "none"):
        raise ValueError(f"from_timm: the MLP activation is {act}; SquadViT uses exact GELU")
    norms = [("blocks.0.norm1", block.norm1), ("blocks.0.norm2", block.norm2), ("norm", pool["norm"]),
             ("fc_norm", pool["fc_norm"])]
    for name, norm in norms:
        if norm is not None and not (isinstance(norm, nn.LayerNorm) and norm.elementwise_affine
                                     and abs(norm.eps - 1e-6) < 1e-12):
            raise ValueError(f"from_timm: {name} is {norm}; SquadViT uses LayerNorm(eps=1e-6) "
                             f"(features would differ from timm's)")
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
        "final_norm": pool["norm"] is not None,
    }


def timm_pooling(vit: nn.Module) -> dict:
    """How a timm VisionTransformer turns its tokens into logits, as far as SquadViT can reproduce it.

    Returns:
        ``{"pool": "token" | "avg" | "", "norm": the final token norm or None, "fc_norm": the norm after pooling or
        None, "head_kind": "token" | "class" | None}``; ``head_kind`` is the squad head that equals timm's
        classifier (None: no squad head does, e.g. avg pooling without fc_norm).

    Raises:
        ValueError: a pooling SquadViT does not model (``map``, ``max``, ``avgmax``, pooling over the class token).
    """
    if getattr(vit, "attn_pool", None) is not None:
        raise ValueError("from_timm: attention pooling (global_pool='map') is not supported")
    pool = getattr(vit, "global_pool", "token")
    if pool not in ("token", "avg", ""):
        raise ValueError(f"from_timm: global_pool={pool!r} is not supported (token, avg or '')")
    if pool == "avg" and getattr(vit, "pool_include_prefix", False):
        raise ValueError("from_timm: average pooling over the class token too (pool_include_prefix=True) is not "
                         "supported")
    norm = getattr(vit, "norm", None)
    fc_norm = getattr(vit, "fc_norm", None)
    norm = None if norm is None or isinstance(norm, nn.Identity) else norm
    fc_norm = None if fc_norm is None or isinstance(fc_norm, nn.Identity) else fc_norm
    if norm is not None and fc_norm is not None:
        raise ValueError("from_timm: a ViT with both a final norm and fc_norm is not supported")
    head_kind = None
    if pool == "token" and fc_norm is None and vit.cls_token is not None:
        head_kind = "token"
    elif pool == "avg" and fc_norm is not None:
        head_kind = "class"
    return {"pool": pool, "norm": norm, "fc_norm": fc_norm, "head_kind": head_kind}


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
            classifier as a head named ``"timm"`` (weights copied; a ``token`` head for class-token pooling, a
            ``class`` head holding ``fc_norm`` for average pooling) when it has one that SquadViT reproduces, else
            a placeholder ``"features"`` head.
        plan: layer plan as `BlockSpec` or mappings like YAML's ``model.plan`` (default: all dense). Dense
            attention/MLP weights are copied into every block whose attention/MLP is dense (also inside MoD
            blocks); routed parts keep their fresh init.
        overrides: extra ModelConfig fields (e.g. ``{"mod": {"capacity": 0.5}}``), merged into the config.

    Returns:
        The model; with the default plan its ``forward_features`` equals timm's (and the ``"timm"`` head's logits
        equal timm's output).

    Raises:
        ConfigError: a bad head, plan entry or override (named as its ``model.`` key).
        ValueError: a timm feature SquadViT does not model.
    """
    arch = timm_config_dict(vit)
    head_kind = timm_pooling(vit)["head_kind"]
    copy_head = False
    if heads is None:
        n_cls = getattr(vit, "num_classes", 0)
        if n_cls and head_kind is not None:
            heads = [HeadConfig("timm", head_kind, int(n_cls))]
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
        head: name of the head to receive timm's classifier: a ``token`` head takes ``head.*``; a ``class`` head
            takes ``head.*`` and ``fc_norm.*`` (an average-pooled ViT's norm after pooling).

    Returns:
        Names of ``model`` parameters that received no timm weight (routers, experts, heads...).

    Raises:
        ValueError: weights that do not fit, e.g. an average-pooled ViT's weights (``fc_norm``, no ``norm``) into a
            model with a final norm (build it with ``final_norm: false``), or a shape mismatch.
    """
    own = model.state_dict()
    fc_norm = any(k.startswith("fc_norm.") for k in state)
    if "norm.weight" in own and "norm.weight" not in state:
        why = " (an average-pooled ViT: its norm, fc_norm, comes after pooling)" if fc_norm else ""
        raise ValueError(f"timm weights have no final norm (norm.weight){why}; the model needs "
                         "model.final_norm=false for its features to equal timm's (from_timm sets it)")
    if head is not None and fc_norm and f"heads.{head}.norm.weight" not in own:
        raise ValueError(f"timm weights pool with fc_norm (average pooling); head {head!r} must be a 'class' head "
                         "to take it")
    if head is not None and not fc_norm and f"heads.{head}.norm.weight" in own:
        raise ValueError(f"head {head!r} is a 'class' head (mean → LayerNorm → Linear), but the timm weights have no "
                         "fc_norm for its LayerNorm: use a 'token' head for a class-token classifier")
    mapped: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("head."):
            if head is not None:
                mapped[f"heads.{head}.fc.{key[5:]}"] = value
            continue
        if key.startswith("fc_norm."):
            if head is not None:
                mapped[f"heads.{head}.norm.{key[8:]}"] = value
            continue
        if key.startswith("head_drop"):
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
