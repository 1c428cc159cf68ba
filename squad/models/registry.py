"""Named models, timm style: `list_models` and `create_model` over the paper configs (configs/model/*.yaml).

A model's name is its config file's stem (``modsquad_vit_s``, ``mtl_vit_b`` ...; ``_``-prefixed files are shared
fragments, not models). The YAMLs ship inside the package, so names work from any working directory::

    import squad

    squad.list_models("*vit_s")                      # ['amod_vit_s', 'mod_vit_s', 'modsquad_vit_s', 'mone_vit_s']
    model = squad.create_model("modsquad_vit_s", depth=4, img_size=64, moe={"num_experts": 8})
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from squad.config.base import deep_merge, model_names
from squad.config.loading import load_config
from squad.config.model import SquadConfig
from squad.models.vit import SquadViT


def list_models(pattern: str | None = None) -> list[str]:
    """Names accepted by `create_model`, sorted.

    Args:
        pattern: optional `fnmatch` glob over the names, e.g. ``"modsquad_*"``.
    """
    return model_names(pattern)


def _plain(value: Any) -> Any:
    """Dataclass instances in keyword fields become mappings, so they merge like YAML (validated again)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def create_config(name_or_path: str | Path, **fields: Any) -> SquadConfig:
    """The config `create_model` builds: a registered name or a YAML file, with ModelConfig ``fields`` merged in.

    Args:
        name_or_path: a name from `list_models` or a model/run config file.
        **fields: ModelConfig fields; nested sections as mappings, merged key by key into the file's
            (``moe={"top_k": 2}`` keeps the file's ``moe.num_experts``); lists (``plan``, ``heads``) replace.

    Raises:
        ConfigError: an unknown name or file, or a bad field, named as its YAML key (``model.moe.top_k``).
    """
    cfg = load_config(name_or_path)
    data = {"model": deep_merge(_plain(cfg.model), _plain(fields)), "loss": _plain(cfg.loss)}
    return load_config(data, cls=SquadConfig)


def create_model(name_or_path: str | Path, pretrained: bool = False, **fields: Any) -> SquadViT:
    """Builds a freshly initialised model from a registered name or a config file, like ``timm.create_model``.

    Args:
        name_or_path: a name from `list_models` (e.g. ``"modsquad_vit_s"``) or a model/run config YAML.
        pretrained: must be False: squad ships no weights (load a trained model with `squad.load_model`).
        **fields: ModelConfig fields that replace the config's, validated exactly as in YAML, e.g.
            ``depth=4, img_size=64, heads=["depth", "normal"], moe={"num_experts": 4}``.

    Returns:
        The `SquadViT`; its ``cfg`` is the resolved `ModelConfig`.

    Raises:
        ConfigError: an unknown name or file, or a bad field (the message names the key).
        ValueError: ``pretrained=True``.
    """
    if pretrained:
        raise ValueError("create_model: squad ships no pretrained weights; train one (tools/train.py) and load it "
                         "with squad.load_model, or start from timm weights with squad.from_timm")
    return SquadViT(create_config(name_or_path, **fields).model)


__all__ = ["create_config", "create_model", "list_models"]
