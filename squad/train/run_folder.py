"""The run folder as one run's property: a lock, a config that may change on resume only where exactness allows it,
the world size the checkpoints were written with, and no shared memory left behind.

Every check is made before anything is written into the folder, first by every rank before torch is imported
(`assess`, from `squad.cli.train`: a refusal exits 2 in a fraction of a second), then by rank 0 with the lock held
(`RunFolder.prepare`), and every rank learns the outcome, so a refusal exits every rank with the same message (exit 2).
What the run writes — ``config.yaml``, ``config.prev.yaml``, ``run_history.jsonl`` — is written only once its
checkpoint has loaded (`RunFolder.record_start`): a resume that fails changes nothing.

- **Lock.** ``run.lock`` holds an exclusive ``fcntl`` lock for the whole run and says who holds it (host, pid, start,
  command). A second run into the same ``--out`` is refused with the holder named. The kernel drops the lock when its
  process dies, so a run killed with ``kill -9`` (or a crashed node, on file systems with working locks) leaves a
  lock the next run takes over, saying whose it was. Only global rank 0 locks: the other ranks of a run, on any node,
  share it. Where the file system has no ``fcntl`` locks, the holder's host and pid decide (a dead pid on this host is
  taken over; a holder on another host is respected).
- **Config on resume.** The resolved config is compared with the ``config.yaml`` of the run being resumed: a change
  to any key outside `RESUMABLE_KEYS` would break exact resumption (or load wrongly sized weights) and is refused,
  listing each key as old → new and how to start afresh. Changes to the keys in `RESUMABLE_KEYS` are applied; they
  are logged in ``train.log``, the previous config is kept as ``config.prev.yaml``, and ``run_history.jsonl`` gets
  one line per start of the run (host, pid, world size, the checkpoint actually loaded and the step it started from,
  damaged checkpoints passed over, what changed).
- **World size.** A run may resume on another number of ranks when its global batch (batch_per_rank × grad_accum ×
  ranks) stays the same — ``optim.batch_per_rank`` and ``optim.grad_accum`` (`BATCH_KEYS`) may change for that — and
  then goes on as if on one world size (the checkpointer converts ZeRO's partitioned optimizer state:
  `squad.train.checkpointer`). Any other change of the global batch is refused unless ``--allow-world-size-change``.
- **Fresh starts.** ``--resume none`` into a folder that holds a run (a complete checkpoint or ``model.pt``), or
  ``--resume PATH`` into such a folder when PATH belongs to another run, is refused unless ``--overwrite``, which
  deletes the run's outputs (`OUTPUTS`; other files stay) first. A restart with nothing to resume (a run killed
  before its first checkpoint) drops that attempt's ``metrics.jsonl`` and TensorBoard events, so histories never mix.
- **Shared memory.** DeepSpeed's CPU communication op leaves ``/dev/shm`` segments behind: `squad.train.shm`
  frees them, and a crashed earlier run's.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from squad.config.base import ConfigError, to_dict
from squad.config.loading import load_config
from squad.config.run import RunConfig
from squad.io.checkpoints import TAG_CONFIG, complete_tags, read_marker
from squad.io.files import atomic_write_text, fail
from squad.io.hf_folder import is_hub_id, resolve
from squad.runtime import launch_rank, pid_alive
from squad.train.shm import ShmSegments, remove_stale_shm
from squad.train.tags import ResumeSource, remove_interrupted_saves, resolve_resume

log = logging.getLogger("squad.train")

LOCK_FILE = "run.lock"
HISTORY_FILE = "run_history.jsonl"

# Keys that may change when a run resumes: its length and lr floor, clipping, cadences, safety limits, where the
# (same) data lives, how it is read, and validation. Any other change breaks exact resumption and is refused.
RESUMABLE_KEYS = (
    "train.compile",  # how the step runs, not what it computes
    "optim.steps", "optim.epochs", "optim.min_lr", "optim.clip",
    "train.log_every", "train.eval_every", "train.ckpt_every", "train.keep_checkpoints", "train.stop_at",
    "train.max_nonfinite", "train.progress", "train.init",  # init is read only by a fresh start
    "train.activation_checkpointing", "train.checkpoint_every",  # memory only: same losses and gradients
    "data.root", "data.workers", "data.prefetch", "data.device_decode", "data.val_split", "data.val_batches",
    "train.save_on_signal", "train.peer_timeout",
    "model.moe.expert_parallel", "model.moa.expert_parallel",  # where experts live, not what they compute
)
# May change on resume when the global batch (batch_per_rank × grad_accum × ranks) stays the same: a run moved to
# another number of ranks keeps its batches by changing grad_accum (the sampler splits every global batch the same way
# whatever the ranks and micro-batches: squad.data.samplers).
BATCH_KEYS = ("optim.batch_per_rank", "optim.grad_accum")

# What a run writes into its folder (what ``--overwrite`` deletes); the lock and shared-memory records stay.
OUTPUTS = ("config.yaml", "config.prev.yaml", "ds_config.json", "train.log", "metrics.jsonl", "tensorboard",
           "checkpoints", "model.pt", HISTORY_FILE)


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (locked, changed config, other world size, a run already there)."""

    every_rank = True  # rank 0 decides and every rank raises it (`RunFolder.prepare`): the tools print it once


class RunFolderLocked(RunFolderError):
    """Another live run holds the run folder's lock."""


# ------------------------------------------------------------------------------------------------------ lock
def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "?"
    text = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


class RunLock:
    """An exclusive lock on a run folder (``<run_dir>/run.lock``), held until `release` or the process's end.

    Use `RunLock.acquire`. ``previous`` is the holder record a stale lock carried (a run that died holding it),
    else None.
    """

    _held: dict[str, RunLock] = {}  # POSIX locks belong to the process: a second lock here would "succeed"

    def __init__(self, path: Path, fd: int, previous: dict | None):
        self.path = path
        self.fd: int | None = fd
        self.previous = previous

    @classmethod
    def acquire(cls, run_dir: str | Path, info: dict | None = None) -> RunLock:
        """Takes the lock of ``run_dir`` (which must exist) and writes this process's holder record into it.

        Args:
            run_dir: the run folder.
            info: extra fields for the holder record (e.g. the rendezvous address).

        Raises:
            RunFolderLocked: another live process holds it; the message names the holder.
        """
        path = Path(run_dir) / LOCK_FILE
        key = os.path.realpath(path)
        if key in cls._held:
            raise RunFolderLocked(f"run folder {run_dir} is in use by this process (a run in it has not finished)")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            holder = _read_holder(fd)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise RunFolderLocked(_locked_message(run_dir, holder)) from None
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                # no fcntl locks on this file system: the holder record decides
                if holder and (holder.get("host") != socket.gethostname() or pid_alive(int(holder.get("pid", 0)))):
                    raise RunFolderLocked(_locked_message(run_dir, holder)) from None
            record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                      "command": " ".join(sys.argv)[:300], **(info or {})}
            data = json.dumps(record).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        previous = holder if holder and holder.get("pid") != os.getpid() else None
        lock = cls(path, fd, previous)
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        """Empties the holder record and drops the lock (the file stays: removing it would race other takers)."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)  # closing drops the process's lock
        self.fd = None
        RunLock._held.pop(os.path.realpath(self.path), None)


def _read_holder(fd: int) -> dict | None:
    raw = os.pread(fd, 65536, 0)
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return {"host": "?", "pid": "?"}
    return holder if isinstance(holder, dict) else None


def _locked_message(run_dir: str | Path, holder: dict | None) -> str:
    who = _describe(holder) if holder else "another process"
    return (f"run folder {run_dir} is in use by another training run: {who}. Wait for it to finish or pass "
            f"another --out (if that process is gone, e.g. its node crashed, delete {Path(run_dir) / LOCK_FILE})")


def lock_before_start(run_dir: str | Path) -> RunLock | None:
    """Global rank 0 takes the run folder's lock before anything heavy starts (the process group, DeepSpeed's
    communication op, the model): a second run into a folder in use is refused at once, not after start-up.

    The other ranks return None at once; rank 0's refusal ends the launch (the launchers stop the other ranks when
    one exits). Where the launcher's rank is unknown, or the folder has no lock file yet (no run has used it, so
    none can hold it; nothing is created here), the lock is taken later, by `RunFolder.prepare`.

    Returns:
        The held lock (rank 0), or None.

    Raises:
        RunFolderLocked: another live run holds the folder (the message names it; exit 2).
        PermissionError: the folder cannot be created or written.
    """
    d = Path(run_dir)
    if launch_rank() != 0 or not (d / LOCK_FILE).is_file():  # no lock file: no run to refuse; nothing is created
        return None
    try:
        world = os.environ.get("WORLD_SIZE", "")
        return RunLock.acquire(d, {"world_size": int(world)} if world.isdigit() else None)
    except RunFolderError:
        raise
    except OSError as e:
        raise PermissionError(f"run folder {d} is not writable: {e.strerror or e}") from e


# ------------------------------------------------------------------------------------------ config on resume
def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def read_run_config(path: Path) -> dict[str, Any]:
    """A run's ``config.yaml`` as a plain dict, resolved with today's defaults where it still loads."""

    try:
        return to_dict(load_config(path, cls=RunConfig))
    except ConfigError:  # written by another squad version (or damaged): compare what is there
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise RunFolderError(f"{path} is not valid YAML ({e}): the config cannot be compared with the "
                                 f"checkpoint's; restore it, or start a new run (another --out)") from e
        return data if isinstance(data, dict) else {}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict, dict]:
    """The keys whose value differs between two resolved run configs (as plain dicts).

    Returns:
        (refused, allowed): each maps a dotted key to ``(old, new)``; ``allowed`` holds the keys in
        `RESUMABLE_KEYS`, ``refused`` every other change (a key missing on one side counts as changed only when
        the other side has it and it is not None).
    """
    a, b = _flatten(old), _flatten(new)
    refused, allowed = {}, {}
    for key in sorted(set(a) | set(b)):
        if key in a and key in b and a[key] == b[key]:
            continue
        if key not in a or key not in b:
            # a key one squad version writes and the other does not: no evidence of a change
            continue
        (allowed if key in RESUMABLE_KEYS else refused)[key] = (a[key], b[key])
    return refused, allowed


def _fmt(changes: dict) -> str:
    return "\n".join(f"  {k}: {old!r} → {new!r}" for k, (old, new) in changes.items())


# ------------------------------------------------------------------------------------------------ the folder
def has_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run worth keeping: a complete checkpoint or an exported ``model.pt``."""
    return bool(complete_tags(run_dir / "checkpoints")) or (run_dir / "model.pt").exists()


def clear_outputs(run_dir: Path, names: tuple[str, ...] = OUTPUTS) -> list[str]:
    """Deletes a run's outputs (`OUTPUTS`) from ``run_dir``; other files stay. Returns what was deleted."""
    gone = []
    for name in names:
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        gone.append(name)
    return gone


def _history(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / HISTORY_FILE).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def world_size_of(source_dir: Path, step: int) -> int | None:
    """The world size the checkpoint at ``step`` was written with (the last start before it), if recorded (the
    checkpointer records it in the tag's COMPLETE marker too; this is for tags written before it did)."""
    starts = [h for h in _history(source_dir) if isinstance(h.get("world_size"), int) and h.get("start_step", 0) < step]
    return starts[-1]["world_size"] if starts else None


def _global_batch(cfg: dict, world: int) -> int | None:
    """batch_per_rank × grad_accum × ranks of a resolved run config (as a plain dict), or None if unreadable."""
    optim = cfg.get("optim") if isinstance(cfg.get("optim"), dict) else {}
    try:
        return int(optim.get("batch_per_rank")) * int(optim.get("grad_accum", 1)) * world
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass
class Assessment:
    """What opening a run folder would do, decided without changing anything (`assess`)."""

    source: ResumeSource | None  # what the run resumes from (None: step 0)
    same_run: bool  # the checkpoint belongs to this folder's own run
    changes: dict  # allowed config changes, key → (old, new)
    notes: list[str]  # for train.log
    clear: tuple[str, ...] = ()  # outputs to delete before the start (--overwrite; a restart without a checkpoint)


def assess(run_dir: str | Path, cfg, resume: str | None, world: int, *, overwrite: bool = False,
           allow_world_size_change: bool = False) -> Assessment:
    """Checks a run against its folder without writing anything: the resume source, the config changes a resume
    may make, the world size, a fresh start over an existing run. Torch-free: `squad.cli.train` calls it on every rank
    before torch is imported, and `RunFolder.prepare` again (rank 0, with the lock held) before the run writes.

    Args:
        run_dir: the run folder (``--out``; it need not exist).
        cfg: the resolved `RunConfig`.
        resume, overwrite, allow_world_size_change: as for `squad.train.engine.train`.
        world: the number of ranks this run has.

    Raises:
        RunFolderError: the resume would change what must not change, or start over a run (the message says what to
            do instead).
        FileNotFoundError: ``--resume PATH`` without a complete checkpoint there.
    """
    d = Path(run_dir)
    source = resolve_resume(d, resume)
    same_run = source is not None and source.run_dir.resolve() == d.resolve()
    notes: list[str] = []
    clear: tuple[str, ...] = ()
    if overwrite:
        if same_run:
            raise RunFolderError(f"--overwrite would delete the checkpoint --resume {resume} loads "
                                 f"({source.tag_dir}); resume without --overwrite, or pass another --out")
        clear = OUTPUTS
    elif has_run(d) and not same_run:
        if source is not None:
            what = f"--resume {resume} loads another run's checkpoint, but"
        elif resume == "auto":
            what = f"--resume auto: {d / 'checkpoints'} holds no complete checkpoint to resume, but"
        else:
            what = "--resume none:"
        raise RunFolderError(
            f"{what} run folder {d} already holds a run ({_holdings(d)}); starting another one in it would mix the "
            f"two. Pass another --out, resume it (--resume auto), or add --overwrite to delete its outputs and "
            f"start over")
    elif source is None and (d / "config.yaml").exists():  # an attempt killed before its first checkpoint
        clear = ("metrics.jsonl", "tensorboard", "ds_config.json")
        notes.append(f"no complete checkpoint in {d / 'checkpoints'}: starting at step 0")
    changes: dict = {}
    if source is not None:
        old = _source_config(source, notes)
        changes = _check_config(cfg, old, source, world, d, notes) if old is not None else {}
        _check_world_size(cfg, old, source, world, allow_world_size_change, notes)
    return Assessment(source, same_run, changes, notes, clear)


def init_file(cfg, run_dir: str | Path, resume: str | None, overwrite: bool = False) -> str | None:
    """``train.init`` when the run starts at step 0, else None: a run that resumes loads its checkpoint, which takes
    precedence (the file need not exist any more then). A hub id ``hf-hub:org/name[@revision]`` gives its folder
    in huggingface_hub's cache.

    Raises:
        ConfigError: the file is missing (naming the key and the path).
    """
    init = cfg.train.init
    if not init:
        return None
    starts_over = overwrite and resume == "auto"  # --overwrite deletes the folder's checkpoints
    if not starts_over and resolve_resume(run_dir, resume) is not None:
        return None
    if is_hub_id(init):  # its folder in huggingface_hub's cache (downloaded unless HF_HUB_OFFLINE is set)
        try:
            return str(resolve(init))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"train.init: {e}") from e
    if not Path(init).exists():
        raise ConfigError(f"train.init: {init} not found (a model file from tools/upcycle.py, a squad model or run "
                          f"folder, a hub id hf-hub:ORG/NAME, or a timm ViT state dict)")
    return init


def _holdings(run_dir: Path) -> str:
    tags = complete_tags(run_dir / "checkpoints")
    parts = [f"checkpoint {tags[-1]}"] if tags else []
    if (run_dir / "model.pt").exists():
        parts.append("model.pt")
    return ", ".join(parts)


def _source_config(source: ResumeSource, notes: list[str]) -> dict | None:
    """The config the checkpoint was trained with: the one stored in its tag (`squad.train.checkpointer` writes it
    into every tag), else (a tag of an earlier version) the run folder's ``config.yaml``."""
    for old_file in (source.tag_dir / TAG_CONFIG, source.run_dir / "config.yaml"):
        if old_file.is_file():
            return read_run_config(old_file)
    notes.append(f"neither {source.tag_dir / TAG_CONFIG} nor {source.run_dir / 'config.yaml'} exists: the config could "
                 f"not be compared with the checkpoint's")
    return None


def _saved_world(source: ResumeSource) -> int | None:
    record = read_marker(source.tag_dir) or {}
    if isinstance(record.get("world_size"), int):
        return record["world_size"]
    return world_size_of(source.run_dir, source.step)


def _check_config(cfg, old: dict, source: ResumeSource, world: int, run_dir: Path, notes: list[str]) -> dict:
    """The allowed changes; refuses any other (listing each key as old → new). The per-rank batch and gradient
    accumulation may change when the global batch stays the same on this run's number of ranks."""
    new = to_dict(cfg)
    refused, allowed = config_changes(old, new)
    saved = _saved_world(source)
    if saved is not None and set(refused) <= set(BATCH_KEYS) and refused:
        if _global_batch(old, saved) == _global_batch(new, world):
            allowed.update(refused)
            refused = {}
    if refused:
        fresh = (f"pass another --out (or --resume none --overwrite to delete the run in {run_dir} and start over "
                 f"there)")
        raise RunFolderError(
            f"cannot resume {source.tag_dir} with a changed config: these keys would break exact resumption\n"
            f"{_fmt(refused)}\nTo train with the new values, start a new run: {fresh}. Keys that may change on "
            f"resume: {', '.join(RESUMABLE_KEYS)}; {' and '.join(BATCH_KEYS)} when the global batch (batch_per_rank × "
            f"grad_accum × ranks) stays the same")
    if allowed:
        notes.append(f"config changed on resume from {source.tag_dir}:\n{_fmt(allowed)}")
    return allowed


def _check_world_size(cfg, old: dict | None, source: ResumeSource, world: int, allow: bool, notes: list[str]) -> None:
    before = _saved_world(source)
    if before is None:
        notes.append(f"the world size {source.tag_dir} was written with is not recorded: not checked")
        return
    if before == world:
        return
    new_batch = _global_batch(to_dict(cfg), world)
    if old is not None and _global_batch(old, before) == new_batch:
        notes.append(f"world size changed on resume: {source.tag_dir} was written by {before} ranks, this run has "
                     f"{world}; the global batch stays {new_batch} images, split the same way (the run goes on as if "
                     f"on one world size, but for the MI loss, which sums over each micro-step's images)")
        return
    what = (f"{source.tag_dir} was written by {before} ranks, this run has {world}: the global batch "
            f"(batch_per_rank × grad_accum × ranks) and each rank's share of the data would change")
    if not allow:
        raise RunFolderError(f"{what}. Resume on {before} ranks, keep the global batch (e.g. --set "
                             f"optim.grad_accum=N), or pass --allow-world-size-change to go on (the run is then no "
                             f"longer equal to one trained on a fixed world size)")
    notes.append(f"world size changed on resume (--allow-world-size-change): {what}")


class RunFolder:
    """One run's folder, opened by every rank (`prepare`) and closed at the end (`close`).

    Args:
        run_dir: the run folder (``--out``).
        rank: this process's global rank.
        world: the number of ranks.
        shm: this run's shared-memory segments (`ShmSegments.from_env`, recorded before the process group started).
        lock: the lock, if already taken (`lock_before_start`).
    """

    def __init__(self, run_dir: Path, rank: int, world: int, shm: ShmSegments | None = None,
                 lock: RunLock | None = None):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world = world
        self.shm = shm or ShmSegments([], rank)
        self.shm.rank = rank  # the launcher's RANK may be unset before the group starts (MPI launchers)
        self.lock: RunLock | None = lock
        self.notes: list[str] = []  # rank 0: what to log once train.log is open
        self.assessment: Assessment | None = None  # rank 0: recorded once the checkpoint loads

    def prepare(self, cfg, resume: str | None, *, overwrite: bool = False,
                allow_world_size_change: bool = False) -> ResumeSource | None:
        """Every rank: rank 0 creates and locks the folder, checks the run against it (`assess`) and deletes what
        ``--overwrite`` (or a restart without a checkpoint) asks; every rank then frees its shared-memory name and
        learns the outcome. Nothing of the run's is written here: ``config.yaml`` and the history wait until the
        checkpoint has loaded (`record_start`).

        Returns:
            What the run resumes from (the same on every rank), or None.

        Raises:
            PermissionError: the folder cannot be created or written.
            RunFolderError: the folder is locked, or the resume would change what must not change (the message says
                what and how to proceed).
        """
        from squad.distributed import barrier, broadcast_object, on_every_rank

        outcome: tuple = ("ok", None)
        if self.rank == 0:
            try:
                outcome = ("ok", self._open(cfg, resume, overwrite, allow_world_size_change))
            except OSError as e:
                outcome = ("permission", f"run folder {self.run_dir} is not writable: {e.strerror or e}")
            except RunFolderError as e:
                outcome = ("run_folder", str(e))
            except Exception as e:  # the other ranks must not be left waiting in the broadcast
                outcome = ("other", f"opening run folder {self.run_dir} failed: {type(e).__name__}: {e}")
        outcome = broadcast_object(outcome)
        barrier()  # every rank has mapped every shared-memory segment: the names can go
        self.shm.unlink_own()
        if self.rank == 0 and self.lock is not None:
            self.notes += remove_stale_shm(self.run_dir)
        kind, value = outcome
        if kind != "ok":
            error = {"permission": PermissionError, "run_folder": RunFolderError}.get(kind, RuntimeError)
            raise on_every_rank(error(value))
        return value

    def _open(self, cfg, resume: str | None, overwrite: bool, allow_world_size_change: bool) -> ResumeSource | None:
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write_test"
        probe.write_text("ok")
        probe.unlink()
        if self.lock is None:  # else taken before the process group started (`lock_before_start`)
            self.lock = RunLock.acquire(d, {"world_size": self.world})
        if self.lock.previous:
            self.notes.append(f"took over the lock of a run that is no longer running: {_describe(self.lock.previous)}")
        found = assess(d, cfg, resume, self.world, overwrite=overwrite,
                       allow_world_size_change=allow_world_size_change)
        self.notes += remove_interrupted_saves(d / "checkpoints")
        gone = clear_outputs(d, found.clear)
        if gone and overwrite:
            self.notes.append(f"--overwrite: deleted the earlier run's {', '.join(gone)} from {d}")
        elif gone:
            self.notes.append(f"deleted the earlier attempt's {', '.join(gone)}")
        self.notes += found.notes
        self.assessment = found
        return found.source

    def record_start(self, cfg, loaded: Path | None, step: int, skipped: list[Path] | None = None) -> None:
        """Rank 0, once the checkpoint has loaded (or the fresh model is built): writes ``config.yaml`` (keeping the
        previous one as ``config.prev.yaml`` when a resume changed it) and appends this start to
        ``run_history.jsonl`` with what was actually loaded (a damaged latest checkpoint is skipped for the one
        before it: `squad.train.checkpointer`).

        Args:
            cfg: the resolved run config.
            loaded: the checkpoint tag loaded, or None for a start at step 0.
            step: the step the run starts from.
            skipped: damaged tags passed over before ``loaded``.
        """
        found = self.assessment
        if self.rank != 0 or found is None:
            return
        d = self.run_dir
        if found.changes and found.same_run and (d / "config.yaml").is_file():
            shutil.copyfile(d / "config.yaml", d / "config.prev.yaml")
        atomic_write_text(d / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), "the run's config")
        entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname(), "pid": os.getpid(),
                 "command": " ".join(sys.argv)[:1000], "world_size": self.world,
                 "config_changes": {k: [old, new] for k, (old, new) in found.changes.items()},
                 "start_step": int(step), "resumed_from": str(loaded) if loaded else None}
        if skipped:
            entry["skipped_damaged"] = [str(p) for p in skipped]
        path = d / HISTORY_FILE
        try:
            with open(path, "a") as f:  # appended: the earlier lines stay whatever happens to this one
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            raise fail("the run history", path, e) from e
        self.assessment = None

    def release_lock(self) -> None:
        """Drops the lock (also from a signal handler on the way out: `squad.train.signals`)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        """Frees what the run holds: its shared-memory segments, its record of them, the lock."""
        self.shm.close(self.run_dir)
        self.release_lock()
