"""Loading configs from YAML files, registered names or dicts: `load_config` (a model config → `SquadConfig`, a run
config → `RunConfig`, detected from its sections) and `model_config` (just the `ModelConfig`), with ``key=value``
overrides; every key is checked and a wrong one is named in the error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from squad.config.base import ConfigError, apply_overrides, find_config, load_dataclass, read_yaml
from squad.config.model import ModelConfig, SquadConfig
from squad.config.run import RunConfig

RUN_SECTIONS = ("data", "optim", "train")  # top-level keys that only a run config (RunConfig) has


def _read(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    if isinstance(source, str | Path):
        return read_yaml(find_config(source))
    raise TypeError(f"a config source is a YAML path, a registered model name or a dict, got {type(source).__name__}")


def load_config(source: str | Path | dict[str, Any], overrides: list[str] | None = None, cls: type | None = None):
    """Loads a config from a YAML path (following ``base:``), a registered model name or a dict, applies
    ``key=value`` overrides, validates. Nothing process-wide changes: the model's ``task_options`` stay in the
    returned config (`ModelConfig.get_task` gives the configured tasks).

    Args:
        source: YAML file, a name from `squad.list_models` (e.g. ``"modsquad_vit_s"``), or a plain dict.
        overrides: dotted overrides, e.g. ``["model.depth=6", "model.moe.top_k=2"]``.
        cls: the root dataclass. Default: `squad.config.run.RunConfig` when the config has a ``data``, ``optim``
            or ``train`` section (a run config), `SquadConfig` otherwise (a model config).

    Returns:
        A `SquadConfig` (model and loss) or a `RunConfig` (also data, optimisation, training loop).

    Raises:
        ConfigError: naming the offending key (or the file, or the unknown model name).
    """
    data = apply_overrides(_read(source), overrides)
    run_keys = [k for k in RUN_SECTIONS if k in data]
    if cls is None:
        cls = RunConfig if run_keys else SquadConfig
    elif run_keys and not any(f.name == run_keys[0] for f in dataclasses.fields(cls)):
        raise ConfigError(f"{source if not isinstance(source, dict) else 'config'} is a run config (it has a "
                          f"{run_keys[0]!r} section): load it with cls=RunConfig (or leave cls out), or take its "
                          f"model with model_config()")
    return load_dataclass(cls, data)


def model_config(source: str | Path | dict[str, Any], overrides: list[str] | None = None) -> ModelConfig:
    """Loads just the model section of a config.

    Args:
        source: a model or run config (file, registered name, or dict with a ``model:`` key), or a bare model
            mapping.
        overrides: dotted overrides with or without the ``model.`` prefix (``"depth=4"`` = ``"model.depth=4"``).

    Raises:
        ConfigError: naming the offending key (as ``model.<key>``).
    """
    data = _read(source)
    if "model" not in data:
        data = {"model": data}
    prefixed = [f"model.{o.lstrip()}" if "=" in o and o.split("=", 1)[0].strip().split(".")[0] not in
                ("model", "loss") else o for o in overrides or []]
    return load_config({"model": data["model"]}, prefixed, cls=SquadConfig).model
