"""Opening what the tools are pointed at — a run folder, a ``model.pt``, or an extracted single-task file — with
errors that say what the file is and what was expected (never a bare unpickling or shape traceback).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from squad.analysis.usage import ExpertUsage
from squad.config.base import ConfigError, to_dict
from squad.config.model import load_config
from squad.models.single_task import SingleTaskModel
from squad.models.vit import SquadViT
from squad.posttrain.pruning import prune_model
from squad.posttrain.surgery import build_on_meta, load_assigned

MODEL_FORMAT = "squad.model/1"
EXTRACTED_FORMAT = "squad.extracted/1"


def read_payload(path: str | Path) -> dict:
    """Loads a squad file (``model.pt`` of a run, or an extracted model) with ``weights_only=True``.

    Raises:
        FileNotFoundError: nothing at ``path`` (a run folder without ``model.pt`` names what is missing).
        ValueError: the file is not a squad model (its format is named).
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "model.pt").is_file():
            hint = " (it has checkpoints: training has not finished)" if (path / "checkpoints").is_dir() else ""
            raise FileNotFoundError(f"{path} holds no model.pt{hint}; pass a run folder after training or a model file")
        path = path / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem means: not one of our files
        raise ValueError(f"{path}: not a loadable squad model file ({type(e).__name__}: {str(e)[:200]})") from e
    fmt = payload.get("format") if isinstance(payload, dict) else None
    if fmt not in (MODEL_FORMAT, EXTRACTED_FORMAT):
        found = fmt if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a squad model file (format {found!r}; expected {MODEL_FORMAT!r} from "
                         f"tools/train.py or {EXTRACTED_FORMAT!r} from tools/extract.py)")
    payload["path"] = str(path)
    return payload


def model_from_payload(payload: dict) -> SquadViT:
    """Builds the full model a ``model.pt`` payload describes, with a clear error when the weights do not fit."""
    source = payload.get("path", "model file")
    try:
        cfg = load_config({"model": payload["config"]}).model
    except (ConfigError, KeyError, TypeError) as e:
        raise ValueError(f"{source}: its model config is invalid ({e})") from e
    state = payload.get("state_dict")
    if not isinstance(state, dict):
        raise ValueError(f"{source}: no state_dict in the file")
    model = load_assigned(build_on_meta(cfg), {k: v.clone() for k, v in state.items()}, source)
    return model.eval()


def load_full_model(path: str | Path, with_usage: bool = True) -> tuple[SquadViT, ExpertUsage | None, dict]:
    """A multi-task model from a run folder or ``model.pt`` (not an extracted file).

    Returns:
        (model in eval mode, its saved usage statistics or None, the payload without weights).

    Raises:
        FileNotFoundError, ValueError: as `read_payload`, and for an extracted file or mismatched weights.
    """
    payload = read_payload(path)
    if payload.get("format") == EXTRACTED_FORMAT:
        raise ValueError(f"{payload['path']} is an extracted single-task model ({payload.get('task')}); "
                         f"this needs the full model (the run's model.pt)")
    model = model_from_payload(payload)
    usage = None
    if with_usage and payload.get("usage"):
        usage = ExpertUsage.from_state_dict(payload["usage"])
    meta = {k: v for k, v in payload.items() if k != "state_dict"}
    return model, usage, meta


def load_any(path: str | Path):
    """A full model or an extracted one, whichever the file holds.

    Returns:
        (model, kind) with kind ``"full"`` (a `SquadViT`) or ``"extracted"`` (a `SingleTaskModel`).
    """
    payload = read_payload(path)
    if payload.get("format") == EXTRACTED_FORMAT:
        return extracted_from_payload(payload), "extracted"
    return model_from_payload(payload), "full"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_model(path: Path, model, usage: ExpertUsage | None, extra: dict | None = None) -> None:
    """Writes ``model.pt``: config, task list, weights, expert-usage statistics (weights_only-loadable)."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    payload = {
        "format": MODEL_FORMAT,
        "config": to_dict(model.cfg),
        "tasks": list(model.task_names),
        "state_dict": state,
        "usage": usage.state_dict() if usage is not None else None,
        "extra": extra or {},
    }
    atomic_torch_save(payload, path)


def load_model(path: str | Path, with_usage: bool = False):
    """Loads a trained model from ``model.pt`` or a run folder, without DeepSpeed.

    Args:
        path: the file, or a run folder containing ``model.pt``.
        with_usage: also return the saved `ExpertUsage` (or None).

    Returns:
        The model in eval mode (and the usage statistics when asked).
    """
    model, usage, _ = load_full_model(path, with_usage=with_usage)
    return (model, usage) if with_usage else model


def save_extracted(path: str | Path, ext: SingleTaskModel, report: dict | None = None) -> Path:
    """Writes an extracted model (config, kept experts, routing mode, weights, report); weights_only-loadable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": EXTRACTED_FORMAT,
        "task": ext.task,
        "config": to_dict(ext.model.cfg),
        "kept": {k: list(v) for k, v in ext.kept.items()},
        "exact": bool(ext.exact),
        "mone_capacity": float(ext.model.mone_capacity),
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in ext.model.state_dict().items()},
        "report": _plain(report or {}),
    }
    atomic_torch_save(payload, path)
    return path


def _plain(obj):
    """JSON-like data only (what weights_only loading accepts)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def extracted_from_payload(payload: dict) -> SingleTaskModel:
    """Rebuilds an extracted model from its file contents (see `load_extracted`)."""
    source = payload.get("path", "extracted model")
    for key in ("task", "config", "kept", "exact", "state_dict"):
        if key not in payload:
            raise ValueError(f"{source}: extracted model file lacks {key!r}")
    try:
        cfg = load_config({"model": payload["config"]}).model
    except (ConfigError, TypeError) as e:
        raise ValueError(f"{source}: its model config is invalid ({e})") from e
    if cfg.task_names != [payload["task"]]:
        raise ValueError(f"{source}: config heads {cfg.task_names} do not match the task {payload['task']!r}")
    model = build_on_meta(cfg)
    kept = {str(k): [int(i) for i in v] for k, v in payload["kept"].items()}
    try:
        prune_model(model, kept, exact=bool(payload["exact"]))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    load_assigned(model, payload["state_dict"], source)
    model.mone_capacity = float(payload.get("mone_capacity", cfg.mone.capacity))
    return SingleTaskModel(model.eval(), payload["task"], kept, bool(payload["exact"]))


def load_extracted(path: str | Path) -> SingleTaskModel:
    """Loads a file written by `save_extracted` / tools/extract.py (no DeepSpeed, ``weights_only=True``).

    Returns:
        The `SingleTaskModel` in eval mode: ``model(images)`` → the task's prediction.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an extracted model (e.g. a full ``model.pt``: use `squad.load_model`), or its weights do
            not match its config.
    """
    payload = read_payload(path)
    if payload.get("format") != EXTRACTED_FORMAT:
        raise ValueError(f"{payload['path']} is a full multi-task model file, not an extracted one; load it with "
                         f"squad.load_model, or extract a task with tools/extract.py")
    return extracted_from_payload(payload)
