"""Checkpoints that survive a kill at any moment: the write side of squad's checkpoint layout and choosing what to
resume from (the layout itself, and reading its files with ``weights_only``, are `squad.io.checkpoints`).

DeepSpeed writes a checkpoint's files into ``checkpoints/<tag>/``; only after every rank has finished does rank 0
write ``<tag>/COMPLETE`` and atomically replace ``checkpoints/latest`` (`mark_complete`). Before a resume,
`select_resume_tag` reads every file of the tag with `squad.io.checkpoints.load_checkpoint_file` (the ranks share the
files) and all ranks agree on the outcome:

* a file that would need arbitrary unpickling (`UnsafeCheckpointError`) stops the run: squad never writes one, so the
  checkpoint was modified or planted;
* a damaged file (truncated, missing, unreadable: `DamagedCheckpointError`) is named in a warning and the previous
  complete checkpoint is tried instead.

`guard_engine` also routes DeepSpeed's own checkpoint reads through `load_checkpoint_file` (DeepSpeed itself calls
``torch.load(weights_only=False)``), and records a failed write (a full disk) instead of letting one rank raise in
the middle of DeepSpeed's collective save, so every rank learns of it at the same point (`EngineGuard.take`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from squad.distributed import is_distributed
from squad.io.checkpoints import (
    COMPLETE,
    CheckpointError,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    check_tag_file,
    complete_tags,
    load_checkpoint_file,
    model_states_file,
    tag_files,
)
from squad.io.files import atomic_write_text


def mark_complete(ckpt_dir: Path, tag: str, step: int, keep: int) -> None:
    """Rank 0, after every rank saved: marks ``tag`` complete, points ``latest`` at it, prunes old tags."""
    atomic_write_text(ckpt_dir / tag / COMPLETE, json.dumps({"step": step}))
    atomic_write_text(ckpt_dir / "latest", tag)
    tags = complete_tags(ckpt_dir)
    for old in tags[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def gather_objects(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group of several ranks)."""
    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def verify_tag(tag_dir: str | Path, rank: int = 0, world: int = 1) -> CheckpointError | None:
    """Reads every file of a checkpoint tag with `load_checkpoint_file`, the files shared out over the ranks.

    Every rank of the process group must call it with the same tag; every rank gets the same answer.

    Args:
        tag_dir: the tag folder (``checkpoints/step00000060``).
        rank, world: this process's rank and the number of ranks sharing the reads.

    Returns:
        None when every file loads; else the first problem (in file order): an `UnsafeCheckpointError` or a
        `DamagedCheckpointError`, naming the file.
    """
    tag_dir = Path(tag_dir)
    try:
        files = tag_files(tag_dir)
    except OSError as e:
        files, listing = [], DamagedCheckpointError(f"{tag_dir}: unreadable ({e.strerror or e})", tag_dir)
    else:
        states = model_states_file(tag_dir)
        listing = None if any(f.name == states.name for f in files) else DamagedCheckpointError(
            f"{states}: missing", states)
    names = {f.name for f in files}
    found: tuple[int, str, str, str] | None = None  # (file index, kind, message, file)
    if listing is not None:
        found = (-1, type(listing).__name__, str(listing), listing.file)
    else:
        for i in range(rank, len(files), world):
            try:
                check_tag_file(tag_dir, files[i], names)
            except CheckpointError as e:
                found = (i, type(e).__name__, str(e), e.file)
                break
    if world > 1:
        problems = [p for p in gather_objects(found) if p is not None]
        found = min(problems) if problems else None
    if found is None:
        return None
    kind = UnsafeCheckpointError if found[1] == UnsafeCheckpointError.__name__ else DamagedCheckpointError
    return kind(found[2], found[3])


def select_resume_tag(ckpt_dir: str | Path, tags: list[str], rank: int = 0, world: int = 1,
                      warn: Callable[[str], None] | None = None) -> str:
    """The first of ``tags`` whose every file loads safely (`verify_tag`); the same answer on every rank.

    Args:
        ckpt_dir: the folder holding the tags.
        tags: candidate tags, best first (`resume_candidates`, or the one tag the user named).
        rank, world: as for `verify_tag`.
        warn: called with a message for each damaged tag that is skipped (rank 0's log), or None.

    Returns:
        The tag to resume from.

    Raises:
        UnsafeCheckpointError: a file needs arbitrary unpickling (it is never loaded; no fallback: the folder was
            tampered with).
        DamagedCheckpointError: no candidate loads (each problem is named).
    """
    ckpt_dir = Path(ckpt_dir)
    problems = []
    for i, tag in enumerate(tags):
        problem = verify_tag(ckpt_dir / tag, rank, world)
        if problem is None:
            return tag
        if isinstance(problem, UnsafeCheckpointError):
            raise UnsafeCheckpointError(
                f"refusing to resume from {ckpt_dir / tag}: {problem} (squad never writes such a file: it was "
                f"modified or planted). Remove that checkpoint to resume from an earlier one, or train into a new "
                f"--out folder", problem.file)
        problems.append(str(problem))
        if warn is not None:
            then = f"falling back to {ckpt_dir / tags[i + 1]}" if i + 1 < len(tags) else "no earlier checkpoint"
            warn(f"checkpoint {ckpt_dir / tag} is damaged: {problem}; {then}")
    raise DamagedCheckpointError(f"no loadable checkpoint in {ckpt_dir}: " + "; ".join(problems) + " (remove the "
                                 "damaged checkpoints to start over, or train into a new --out folder)",
                                 ckpt_dir)


# ------------------------------------------------------------------------------------ guarding DeepSpeed's I/O
class EngineGuard:
    """Routes a DeepSpeed engine's checkpoint reads through `load_checkpoint_file` and records its failed writes.

    DeepSpeed saves with collective calls between the writes; a write that raised on one rank only (a full disk)
    would leave the other ranks waiting in DeepSpeed's barrier. The failure is recorded instead (the half-written
    file stays until the caller removes the tag) and `failure` reports it once DeepSpeed's save has returned.
    """

    def __init__(self, engine: Any):
        self.errors: list[tuple[str, BaseException]] = []
        ce = engine.checkpoint_engine
        save = ce.save

        def guarded_save(state_dict: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            try:
                return save(state_dict, path, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - recorded and raised by the caller on every rank
                self.errors.append((str(path), e))
                return None

        def safe_load(path: str, map_location: Any = None) -> Any:
            return load_checkpoint_file(path, map_location=map_location)

        ce.save = guarded_save
        ce.load = safe_load
        copy_script = getattr(engine, "_copy_recovery_script", None)  # rank 0 copies zero_to_fp32.py beside the tags
        if copy_script is not None:
            def guarded_copy(*args: Any, **kwargs: Any) -> Any:
                try:
                    return copy_script(*args, **kwargs)
                except Exception as e:  # noqa: BLE001
                    self.errors.append((os.path.join(str(args[0]) if args else "", "zero_to_fp32.py"), e))
                    return None

            engine._copy_recovery_script = guarded_copy

    def take(self) -> tuple[str, BaseException] | None:
        """The first write that failed since the last call (then forgotten), or None."""
        first = self.errors[0] if self.errors else None
        self.errors.clear()
        return first


def guard_engine(engine: Any) -> EngineGuard:
    """Installs an `EngineGuard` on a DeepSpeed engine (call once, right after ``deepspeed.initialize``)."""
    return EngineGuard(engine)
