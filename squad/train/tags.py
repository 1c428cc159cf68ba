"""A run's checkpoint tags on disk, without the engine: which tags ``--resume`` names (`resolve_resume`), whether a
tag is whole (`verify_tag`, `select_tag`: every file read with ``weights_only``, shared out over the ranks), whether
it was trained on the same data (`check_same_data`), and a save's last steps (`commit_tag`: COMPLETE, the rename into
place, ``latest``, pruning; `remove_save`, `remove_interrupted_saves`). `squad.train.checkpointer` runs these around
DeepSpeed's own save and load; the layout's names and the torch-free reading of a tag are `squad.io.checkpoints`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from squad.io.checkpoints import (
    COMPLETE,
    CONVERTED,
    LATEST,
    SAVING,
    TAG_CONFIG,
    CheckpointError,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    check_tag_file,
    complete_tags,
    marked_step,
    model_states_file,
    read_marker,
    resume_candidates,
    tag_files,
)
from squad.io.expert_files import check_shards
from squad.io.files import atomic_write_text


# ------------------------------------------------------------------------------------------ resume resolution
@dataclasses.dataclass
class ResumeSource:
    """What ``--resume`` names: the run it belongs to and the complete tags to try, best first."""

    run_dir: Path  # the run folder the checkpoints belong to (its config.yaml is the one to compare)
    ckpt_dir: Path  # the folder holding the tags
    tags: list[str]

    @property
    def tag_dir(self) -> Path:
        return self.ckpt_dir / self.tags[0]

    @property
    def step(self) -> int:
        return marked_step(self.tag_dir) or 0


def resolve_resume(run_dir: str | Path, resume: str | None) -> ResumeSource | None:
    """What a run in ``run_dir`` resumes from; None when it starts at step 0. Torch-free (the tools call it before
    importing torch).

    Args:
        run_dir: the run folder (``--out``).
        resume: ``"auto"`` (the folder's own newest complete tag, if any), ``"none"``/``"no"``/None, or a path: a
            run folder, its ``checkpoints`` folder, or one tag.

    Raises:
        FileNotFoundError: a path with no complete checkpoint.
    """
    if resume in (None, "none", "no"):
        return None
    if resume == "auto":
        ckpt_dir = Path(run_dir) / "checkpoints"
        tags = resume_candidates(ckpt_dir)
        return ResumeSource(Path(run_dir), ckpt_dir, tags) if tags else None
    path = Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"--resume {resume}: no such file or folder (a run folder, its checkpoints folder or "
                                "one checkpoint tag; or auto)")
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if marked_step(path) is not None:  # one tag, exactly
        return ResumeSource(path.parent.parent, path.parent, [path.name])
    tags = resume_candidates(path) if path.is_dir() else []
    if not tags:
        raise FileNotFoundError(f"--resume {resume}: no complete checkpoint there")
    return ResumeSource(path.parent, path, tags)


# ---------------------------------------------------------------------------------- damaged and unsafe tags
def gather_objects(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group of several ranks)."""
    from squad.distributed import is_distributed

    if not is_distributed():
        return [obj]
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def verify_tag(tag_dir: str | Path, rank: int = 0, world: int = 1) -> CheckpointError | None:
    """Reads every file of a tag with ``weights_only`` (`check_tag_file`), the files shared out over the ranks.

    Every rank of the process group must call it with the same tag; every rank gets the same answer.

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
        if found is None and rank == 0:  # the layout: every expert of every sharded weight in some shard file
            try:
                record = read_marker(tag_dir) or {}
                check_shards(tag_dir, record.get("expert_shards") or ())
            except CheckpointError as e:
                found = (len(files), type(e).__name__, str(e), e.file)
            except (KeyError, TypeError, AttributeError, ValueError) as e:  # a shard file's index of another shape
                found = (len(files), DamagedCheckpointError.__name__, f"{tag_dir}: unreadable expert shard index "
                         f"({type(e).__name__}: {e})", str(tag_dir))
    if world > 1:
        problems = [p for p in gather_objects(found) if p is not None]
        found = min(problems) if problems else None
    if found is None:
        return None
    kind = UnsafeCheckpointError if found[1] == UnsafeCheckpointError.__name__ else DamagedCheckpointError
    return kind(found[2], found[3])


def select_tag(ckpt_dir: str | Path, tags: list[str], rank: int = 0, world: int = 1,
               warn: Callable[[str], None] | None = None) -> str:
    """The first of ``tags`` whose every file loads safely (`verify_tag`); the same answer on every rank.

    Args:
        ckpt_dir: the folder holding the tags.
        tags: candidate tags, best first (`ResumeSource.tags`).
        rank, world: as for `verify_tag`.
        warn: called with a message for each damaged tag that is skipped (rank 0's log), or None.

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
                                 "damaged checkpoints to start over, or train into a new --out folder)", ckpt_dir)


# ------------------------------------------------------------------------------------------- the same data
class DataChangedError(ValueError):
    """A resume with other training data than the checkpoint was trained on (its sample count or fingerprint
    differs): the saved data position would be applied to other data. Every rank raises it alike."""

    every_rank = True


def check_same_data(tag_dir: Path, data: dict | None, config: dict | None = None) -> None:
    """Refuses to resume ``tag_dir`` on other training data than it was trained on.

    Args:
        tag_dir: the tag the run resumes from; its marker's ``data`` record (written by this version on) is compared.
        data: this run's training data identity (``{"samples", "fingerprint"}``), or None (not checked).
        config: this run's resolved config (its ``data.root`` named in the message).

    Raises:
        DataChangedError: the count or the fingerprint differs (the message names ``data.root``, old and new).
    """
    saved = (read_marker(tag_dir) or {}).get("data")
    if data is None or not isinstance(saved, dict) or saved == data:
        return
    old_cfg = tag_config(tag_dir)
    old_root = ((old_cfg or {}).get("data") or {}).get("root", "?")
    new_root = ((config or {}).get("data") or {}).get("root", "?")
    raise DataChangedError(
        f"data.root: {tag_dir} was trained on {old_root} ({saved.get('samples')} training samples, fingerprint "
        f"{saved.get('fingerprint')}), this run reads {new_root} ({data.get('samples')} samples, fingerprint "
        f"{data.get('fingerprint')}): the saved data position would be applied to other data. Resume with the data "
        f"it was trained on (data.root may move the same data elsewhere), or start a new run (another --out)")


def tag_config(tag_dir: Path) -> dict | None:
    """The run config a tag was trained with (its ``config.yaml``), or None for a tag written without one."""
    import yaml

    try:
        data = yaml.safe_load((Path(tag_dir) / TAG_CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def commit_tag(ckpt_dir: Path, tag: str, record: dict, keep: int) -> None:
    """Rank 0, once every rank has written ``<ckpt_dir>/.saving/<tag>``: writes COMPLETE (``record``: ``step``,
    ``world_size``, ``zero_stage``), renames the tag into place (replacing a folder of that name), moves DeepSpeed's
    recovery scripts beside the tags, points ``latest`` at it and keeps the newest ``keep`` complete tags of the line
    it is on (`prune_tags`)."""
    ckpt_dir = Path(ckpt_dir)
    staging, final = ckpt_dir / SAVING / tag, ckpt_dir / tag
    atomic_write_text(staging / COMPLETE, json.dumps(record))
    replaced = staging.with_name(f"{tag}.replaced")
    if final.exists():  # left by an interrupted save of an older version, or this step saved before
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    staging.rename(final)
    try:
        for script in staging.parent.glob("*.py"):  # DeepSpeed's recovery scripts, copied beside the tag it wrote
            os.replace(script, ckpt_dir / script.name)
        atomic_write_text(ckpt_dir / LATEST, tag)
    except OSError:
        # the tag is complete in place: ``latest`` must not name an older one (without it a resume picks the newest
        # complete tag); removing a file needs no room
        with contextlib.suppress(OSError):
            (ckpt_dir / LATEST).unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(replaced, ignore_errors=True)
        with contextlib.suppress(OSError):
            staging.parent.rmdir()  # when no other save is in progress
        prune_tags(ckpt_dir, tag, record["step"], keep)


def prune_tags(ckpt_dir: Path, tag: str, step: int, keep: int) -> list[str]:
    """Removes the complete tags older than the newest ``keep`` at or below ``step`` (the one just written, ``tag``,
    is never removed). Tags of a later step are left alone and not counted: they are what a resume fell back from
    (damaged) or left behind (an earlier tag resumed on purpose), and no resume takes them while ``latest`` names
    ``tag``. Returns the tags removed."""
    ckpt_dir = Path(ckpt_dir)
    line = [t for t in complete_tags(ckpt_dir) if (marked_step(ckpt_dir / t) or 0) <= step and t != tag]
    removed = line[:max(0, len(line) - (keep - 1))] if keep > 0 else []
    for old in removed:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    return removed


def remove_save(staging: Path) -> None:
    """Removes a save in progress: ``.saving`` with the tag and the recovery scripts DeepSpeed copied beside it (a run
    saves one tag at a time)."""
    shutil.rmtree(staging.parent, ignore_errors=True)


def remove_interrupted_saves(ckpt_dir: Path) -> list[str]:
    """Rank 0, with the run folder's lock held: removes the saves and conversions earlier runs left unfinished.

    Returns:
        Notes for ``train.log``.
    """
    notes = []
    for scratch in (Path(ckpt_dir) / SAVING, Path(ckpt_dir) / CONVERTED):
        if scratch.is_dir():
            left = sorted(p.name for p in scratch.iterdir() if p.is_dir())
            shutil.rmtree(scratch, ignore_errors=True)
            if left:
                notes.append(f"removed what an interrupted save or conversion left in {scratch}: {', '.join(left)}")
    return notes
