"""Checkpoints that survive a kill at any moment, load without running code, and the atomic writes every squad file
uses.

DeepSpeed writes a checkpoint's files into ``checkpoints/<tag>/``; only after every rank has finished does rank 0
write ``<tag>/COMPLETE`` and atomically replace ``checkpoints/latest`` (write to a temporary file, then
``os.replace``). Resuming reads ``latest`` and checks the marker; a tag without its marker (a run killed while
saving) is never loaded. ``model.pt`` and extracted files are written the same way (`atomic_torch_save`) and hold
plain tensors and lists only, so they load with ``torch.load(weights_only=True)``. `squad.load` opens a run folder,
``model.pt``, or a complete tag (from ``<tag>/mp_rank_00_model_states.pt`` and the run's ``config.yaml``), without
DeepSpeed.

Every file squad reads from a checkpoint goes through `load_checkpoint_file`: ``weights_only=True``, with exactly
DeepSpeed's few plain records allowed (`deepspeed_safe_globals`). Before a resume, `select_resume_tag` reads every
file of the tag that way (the ranks share the files) and all ranks agree on the outcome:

* a file that would need arbitrary unpickling (`UnsafeCheckpointError`) stops the run: squad never writes one, so the
  checkpoint was modified or planted;
* a damaged file (truncated, missing, unreadable: `DamagedCheckpointError`) is named in a warning and the previous
  complete checkpoint is tried instead.

`guard_engine` also routes DeepSpeed's own checkpoint reads through `load_checkpoint_file` (DeepSpeed itself calls
``torch.load(weights_only=False)``), and records a failed write (a full disk) instead of letting one rank raise in
the middle of DeepSpeed's collective save, so every rank learns of it at the same point (`save_failure`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"  # marker file of a tag every rank finished saving
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file with the module weights and the client state
_ZERO_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")

log = logging.getLogger("squad.train")


# ----------------------------------------------------------------------------------------------- atomic writes
def atomic_write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and ``os.replace`` (never a half-written file; the
    temporary file is removed when the write fails, e.g. on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file and ``os.replace`` (never a half-written file; the
    temporary file is removed when the write fails, e.g. on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------------------- tags
def tag_for(step: int) -> str:
    return f"step{step:08d}"


def mark_complete(ckpt_dir: Path, tag: str, step: int, keep: int) -> None:
    """Rank 0, after every rank saved: marks ``tag`` complete, points ``latest`` at it, prunes old tags."""
    atomic_write_text(ckpt_dir / tag / COMPLETE, json.dumps({"step": step}))
    atomic_write_text(ckpt_dir / "latest", tag)
    tags = complete_tags(ckpt_dir)
    for old in tags[:-keep]:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def _marked_step(tag_dir: Path) -> int | None:
    """The step in a tag's ``COMPLETE`` marker; None without a readable marker (the tag is not complete)."""
    try:
        return int(json.loads((tag_dir / COMPLETE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first (a tag whose marker is unreadable counts as incomplete)."""
    if not ckpt_dir.is_dir():
        return []
    steps = {p.name: _marked_step(p) for p in ckpt_dir.iterdir() if p.is_dir()}
    return sorted((t for t, s in steps.items() if s is not None), key=lambda t: steps[t])


def find_resume_tag(ckpt_dir: Path) -> str | None:
    """The tag to resume from: ``latest`` if it is complete, else the newest complete tag, else None."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and _marked_step(ckpt_dir / tag) is not None:
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def resume_candidates(ckpt_dir: Path) -> list[str]:
    """Complete tags to try, best first: `find_resume_tag`, then the older complete tags, newest first."""
    first = find_resume_tag(ckpt_dir)
    if first is None:
        return []
    tags = complete_tags(ckpt_dir)
    step = _marked_step(ckpt_dir / first)
    older = [t for t in reversed(tags) if t != first and (_marked_step(ckpt_dir / t) or 0) <= (step or 0)]
    return [first, *older]


# ---------------------------------------------------------------------------------------------- safe reading
class CheckpointError(ValueError):
    """A checkpoint file squad will not load; ``file`` names it."""

    def __init__(self, message: str, file: str | Path):
        super().__init__(message)
        self.file = str(file)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that only arbitrary unpickling would load (it could run code): never loaded."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file that is missing, truncated or otherwise unreadable."""


def deepspeed_safe_globals() -> list:
    """The only non-tensor classes allowed in a DeepSpeed checkpoint file beside plain data: the fp16 loss scalers, the
    bf16/ZeRO optimizers' fragment addresses and ZeRO's stage enum (plain attribute records; nothing else is allowed).
    DeepSpeed is imported only here, for such files: loading never needs it otherwise."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [DynamicLossScaler, LossScaler, fragment_address, ZeroStageEnum]


def refusal_reason(error: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its own message is a page long)."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    if found:
        return f"it holds {found.group(1)}, which weights_only loading does not allow"
    return f"{type(error).__name__}: {error}"[:200]


def load_checkpoint_file(file: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed checkpoint file; if DeepSpeed stored one of its own records
    beside the weights, once more with exactly those classes allowed (`deepspeed_safe_globals`).

    Args:
        file: the file (``mp_rank_00_model_states.pt``, a ZeRO optimizer shard, ...).
        map_location: as for ``torch.load``.

    Returns:
        The file's contents.

    Raises:
        UnsafeCheckpointError: only arbitrary unpickling would load it (the file names what it holds).
        DamagedCheckpointError: missing, truncated or otherwise unreadable.
    """
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        error: BaseException = e
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise DamagedCheckpointError(f"{file}: not a loadable DeepSpeed checkpoint ({type(e).__name__}: "
                                     f"{str(e)[:200]})", file) from e
    allowed = deepspeed_safe_globals()
    if allowed:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(file, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            error = e
        except Exception as e:  # noqa: BLE001
            raise DamagedCheckpointError(f"{file}: not a loadable DeepSpeed checkpoint ({type(e).__name__}: "
                                         f"{str(e)[:200]})", file) from e
    raise UnsafeCheckpointError(f"{file}: weights_only loading refuses this checkpoint ({refusal_reason(error)}); "
                                f"squad never unpickles files without weights_only", file) from error


def tag_files(tag_dir: Path) -> list[Path]:
    """Every file of a checkpoint tag that DeepSpeed may read (all but the ``COMPLETE`` marker), sorted."""
    return sorted(p for p in tag_dir.iterdir() if p.is_file() and p.name != COMPLETE)


def _check_file(tag_dir: Path, file: Path, names: set[str]) -> None:
    """Loads one file of a tag safely; the model-states file must also list every ZeRO shard the tag needs."""
    states = load_checkpoint_file(file)
    if file.name != MODEL_STATES:
        return
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise DamagedCheckpointError(f"{file}: no module weights in this DeepSpeed checkpoint", file)
    ds = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage or any(_ZERO_SHARD.match(n) for n in names):
        have = {int(m.group(1)) for n in names if (m := _ZERO_SHARD.match(n))}
        missing = [r for r in range(int(states.get("dp_world_size") or 1)) if r not in have]
        if missing:
            name = f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
            raise DamagedCheckpointError(f"{tag_dir / name}: missing (the optimizer shard of data-parallel rank "
                                         f"{missing[0]})", tag_dir / name)


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
        listing = None if any(f.name == MODEL_STATES for f in files) else DamagedCheckpointError(
            f"{tag_dir / MODEL_STATES}: missing", tag_dir / MODEL_STATES)
    names = {f.name for f in files}
    found: tuple[int, str, str, str] | None = None  # (file index, kind, message, file)
    if listing is not None:
        found = (-1, type(listing).__name__, str(listing), listing.file)
    else:
        for i in range(rank, len(files), world):
            try:
                _check_file(tag_dir, files[i], names)
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


def write_failure(what: str, path: str | Path, error: BaseException) -> str:
    """A message for a failed write: what was being written, where, the error, and the space left there.

    Args:
        what: e.g. ``"checkpoint step00000060"``.
        path: the file or folder written.
        error: what the write raised (torch reports a full disk as ``basic_ios::clear: iostream error``).
    """
    path = Path(path)
    if isinstance(error, OSError) and error.errno:
        reason = os.strerror(error.errno)
    else:
        reason = f"{type(error).__name__}: {str(error)[:200]}"
    where = path if path.exists() else path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
        space = f"; {free / 2**20:.1f} MiB free on that filesystem"
        if free < 64 * 2**20 or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
            space += " (the disk is full or nearly: free some space)"
    except OSError:
        space = ""
    return f"could not write {what} to {path}: {reason}{space}"
