"""Checkpoints that survive a kill at any moment, and the exported ``model.pt``.

DeepSpeed writes a checkpoint's files into ``checkpoints/<tag>/``; only after every rank has finished does rank 0
write ``<tag>/COMPLETE`` and atomically replace ``checkpoints/latest`` (write to a temporary file, then
``os.replace``). Resuming reads ``latest`` and checks the marker; a tag without its marker (a run killed while
saving) is never loaded. ``model.pt`` is written the same way and holds plain tensors and lists only, so it loads
with ``torch.load(weights_only=True)`` and `load_model` rebuilds the model without DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from squad.config import ModelConfig, load_config
from squad.configbase import to_dict
from squad.usage import ExpertUsage

MODEL_FORMAT = "squad.model/1"
COMPLETE = "COMPLETE"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def mark_complete(ckpt_dir: Path, tag: str, step: int, keep: int) -> None:
    """Rank 0, after every rank saved: marks ``tag`` complete, points ``latest`` at it, prunes old tags."""
    atomic_write_text(ckpt_dir / tag / COMPLETE, json.dumps({"step": step}))
    atomic_write_text(ckpt_dir / "latest", tag)
    tags = complete_tags(ckpt_dir)
    for old in tags[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and (p / COMPLETE).is_file()]
    return sorted(tags, key=lambda t: json.loads((ckpt_dir / t / COMPLETE).read_text())["step"])


def find_resume_tag(ckpt_dir: Path) -> str | None:
    """The tag to resume from: ``latest`` if it is complete, else the newest complete tag, else None."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (ckpt_dir / tag / COMPLETE).is_file():
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


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


def read_model_file(path: str | Path) -> dict:
    """Loads and checks a ``model.pt`` (or the ``model.pt`` inside a run folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path} (a run folder holds model.pt once training ends)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - report any unpickling problem as a bad file
        raise ValueError(f"{path}: not a loadable squad model file ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or payload.get("format") != MODEL_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a squad model file (format {found!r}, expected {MODEL_FORMAT!r})")
    payload["path"] = str(path)
    return payload


def model_from_payload(payload: dict):
    """Builds the model a payload describes and loads its weights."""
    from squad.model import build_model

    cfg: ModelConfig = load_config({"model": payload["config"]}).model
    model = build_model(cfg)
    missing, unexpected = model.load_state_dict(payload["state_dict"], strict=False)
    if missing or unexpected:
        raise ValueError(f"{payload.get('path')}: weights do not match the config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model


def load_model(path: str | Path, with_usage: bool = False):
    """Loads a trained model from ``model.pt`` or a run folder, without DeepSpeed.

    Args:
        path: the file, or a run folder containing ``model.pt``.
        with_usage: also return the saved `ExpertUsage` (or None).

    Returns:
        The model in eval mode (and the usage statistics when asked).
    """
    payload = read_model_file(path)
    model = model_from_payload(payload).eval()
    if not with_usage:
        return model
    usage = ExpertUsage.from_state_dict(payload["usage"]) if payload.get("usage") else None
    return model, usage
