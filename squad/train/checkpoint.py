"""Checkpoints that survive a kill at any moment, and the atomic writes every squad file uses.

DeepSpeed writes a checkpoint's files into ``checkpoints/<tag>/``; only after every rank has finished does rank 0
write ``<tag>/COMPLETE`` and atomically replace ``checkpoints/latest`` (write to a temporary file, then
``os.replace``). Resuming reads ``latest`` and checks the marker; a tag without its marker (a run killed while
saving) is never loaded. ``model.pt`` and extracted files are written the same way (`atomic_torch_save`) and hold
plain tensors and lists only, so they load with ``torch.load(weights_only=True)``. `squad.load` opens a run folder,
``model.pt``, or a complete tag (from ``<tag>/mp_rank_00_model_states.pt`` and the run's ``config.yaml``), without
DeepSpeed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"  # marker file of a tag every rank finished saving
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file with the module weights and the client state


def atomic_write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file and ``os.replace`` (never a half-written file)."""
    path = Path(path)
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
