"""Typed dataclass configs from YAML: strict loading, dotted overrides, `base:` inheritance, writing back.

Every config in squad is a tree of dataclasses. `load_dataclass` builds one from a plain dict and rejects what
does not fit, naming the dotted key: an unknown key (with the valid ones listed), a wrong type, a value outside a
`Literal`'s choices, a float that is not finite (``.nan``, ``.inf``). Semantic checks (ranges) live in each
dataclass's ``check(path)`` method, which raises `ConfigError` with the key's full name; `load_dataclass` calls it
on every node after building the tree.

The paper configs (the repository's configs/, installed as package data under ``squad/configs``) are found with
`config_root`, `model_names` and `find_config`, so a registered name such as ``"modsquad_vit_s"`` works from any
working directory and from an installed wheel.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.resources
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the dotted key."""

    every_rank = True  # every rank reads the same config: the tools print it once (`squad.cli.run`)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Converts a YAML value to the annotated type, or raises ConfigError naming ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, val_tp = get_args(tp)
        return {str(k): _convert(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .nan / .inf: no config value means "not a number" or "unbounded"
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {key}")


def _build(cls: type[T], data: dict[str, Any], prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]!s} (valid keys here: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(value, hints[name], key)
    return cls(**kwargs)


def check_tree(node: Any, prefix: str = "") -> None:
    """Runs ``check(path)`` on every dataclass in the tree (children first)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            key = f"{prefix}.{f.name}" if prefix else f.name
            check_tree(getattr(node, f.name), key)
        if hasattr(node, "check"):
            node.check(prefix)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            check_tree(item, f"{prefix}[{i}]")


def load_dataclass(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Builds and checks a config dataclass from a plain dict (unknown keys and wrong types rejected)."""
    obj = _build(cls, data or {}, prefix)
    check_tree(obj, prefix)
    return obj


def to_dict(obj: Any) -> Any:
    """The config as plain YAML-able data (dataclasses → dicts, tuples → lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursively merges ``over`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def config_root() -> Path:
    """The folder of squad's own configs (``model/*.yaml``, ``taskonomy/*.yaml``, ``demo.yaml``).

    In an installed wheel it is the package data ``squad/configs``; in a source checkout or an editable install
    it is the repository's ``configs/`` beside the ``squad`` package.

    Raises:
        ConfigError: neither exists (a broken installation).
    """
    packaged = importlib.resources.files("squad") / "configs"
    if isinstance(packaged, Path) and (packaged / "model").is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "configs"  # squad/config/base.py → the repository root
    if (checkout / "model").is_dir():
        return checkout
    raise ConfigError(f"squad's configs are missing: neither {packaged} nor {checkout} holds model/*.yaml "
                      "(reinstall squad)")


def model_names(pattern: str | None = None) -> list[str]:
    """Registered model names: the stems of ``configs/model/*.yaml`` (``_``-prefixed fragments left out), sorted.

    Args:
        pattern: optional `fnmatch` glob, e.g. ``"*vit_s"``.
    """
    names = sorted(p.stem for p in (config_root() / "model").glob("*.yaml") if not p.name.startswith("_"))
    return [n for n in names if pattern is None or fnmatch.fnmatchcase(n, pattern)]


def find_config(source: str | Path) -> Path:
    """The YAML file for a path or a registered model name.

    Args:
        source: an existing file, or a name from `model_names` (e.g. ``"modsquad_vit_s"``).

    Raises:
        ConfigError: neither a file nor a registered name; the message lists the names.
    """
    path = Path(source)
    if path.is_file():
        return path
    if isinstance(source, str) and "/" not in source and "\\" not in source and path.suffix not in (".yaml", ".yml"):
        named = config_root() / "model" / f"{source}.yaml"
        if not source.startswith("_") and named.is_file():
            return named
        raise ConfigError(f"unknown model {source!r}: not a config file and not a registered name "
                          f"(squad.list_models(): {', '.join(model_names())})")
    raise ConfigError(f"config file not found: {path}")


def _find_base(path: Path, base: str) -> Path:
    """Resolves a ``base:`` entry: relative to the including file, else inside squad's configs, else a name."""
    candidates = [path.parent / base, config_root() / base]
    if "/" not in base and Path(base).suffix not in (".yaml", ".yml"):
        candidates.append(config_root() / "model" / f"{base}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{path}: base {base!r} not found (looked for {path.parent / base}, for {base} in squad's "
                      f"configs {config_root()}, and among the registered model names)")


YAML_SOURCE = '"<unicode string>"'  # what PyYAML calls a string it parsed, in its messages


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML config, following ``base:`` (a list is merged in order).

    A base is looked up relative to the including file, then relative to squad's configs (`config_root`: e.g.
    ``base: model/modsquad_vit_s.yaml`` from a file anywhere), then as a registered model name
    (``base: modsquad_vit_s``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).replace(YAML_SOURCE, str(path))}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    bases = data.pop("base", None)
    if bases is None:
        return data
    merged: dict[str, Any] = {}
    for b in [bases] if isinstance(bases, str) else bases:
        if not isinstance(b, str):
            raise ConfigError(f"{path}: base must be a file name or a list of them, got {b!r}")
        merged = deep_merge(merged, read_yaml(_find_base(path, b)))
    return deep_merge(merged, data)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Applies ``key.sub=value`` overrides (values parsed as YAML: numbers, booleans, lists, mappings)."""
    data = dict(data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: value {raw!r} is not valid YAML: "
                              f"{str(e).replace(f'in {YAML_SOURCE}, ', 'at ')}") from e
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is not a mapping")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def write_yaml(obj: Any, path: str | Path) -> None:
    """Writes a config (dataclass or dict) as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
