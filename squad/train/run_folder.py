"""The run folder as one run's property: a lock, a config that may change on resume only where exactness allows it,
the world size the checkpoints were written with, and no shared memory left behind.

Rank 0 opens the folder (`RunFolder.prepare`) before anything is written into it, and every rank learns the
outcome, so a refusal exits every rank with the same message (exit 2):

- **Lock.** ``run.lock`` holds an exclusive ``fcntl`` lock for the whole run and says who holds it (host, pid, start,
  command). A second run into the same ``--out`` is refused with the holder named. The kernel drops the lock when its
  process dies, so a run killed with ``kill -9`` (or a crashed node, on file systems with working locks) leaves a
  lock the next run takes over, saying whose it was. Only global rank 0 locks: the other ranks of a run, on any node,
  share it. Where the file system has no ``fcntl`` locks, the holder's host and pid decide (a dead pid on this host is
  taken over; a holder on another host is respected).
- **Config on resume.** The resolved config is compared with the ``config.yaml`` of the run being resumed before
  ``config.yaml`` is written: a change to any key outside `RESUMABLE_KEYS` would break exact resumption (or load
  wrongly sized weights) and is refused, listing each key as old → new and how to start afresh. Changes to the keys
  in `RESUMABLE_KEYS` are applied; they are logged in ``train.log``, the previous config is kept as
  ``config.prev.yaml``, and ``run_history.jsonl`` gets one line per start of the run (host, pid, world size, the
  checkpoint actually loaded and the step it started from, damaged checkpoints passed over, what changed),
  written once the checkpoint has loaded (`RunFolder.record_start`).
- **World size.** Resuming on another number of ranks changes the global batch (and the per-rank data position), so
  it is refused unless ``--allow-world-size-change``.
- **Fresh starts.** ``--resume none`` into a folder that holds a run (a complete checkpoint or ``model.pt``), or
  ``--resume PATH`` into such a folder when PATH belongs to another run, is refused unless ``--overwrite``, which
  deletes the run's outputs (`OUTPUTS`; other files stay) first. A restart with nothing to resume (a run killed
  before its first checkpoint) drops that attempt's ``metrics.jsonl`` and TensorBoard events, so histories never mix.
- **Shared memory.** Under the deepspeed launcher on one node, DeepSpeed's CPU communication op creates one ~66 MB
  POSIX shared-memory segment per rank
  (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``) and never unlinks it.
  Each rank unlinks its own once every rank has mapped them all (the mappings stay valid), and rank 0 records the
  names (``.shm-<host>-<pid>.json``) before the process group starts, so the segments of a run that crashed even
  earlier are removed by the next run of the same folder.
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
from squad.distributed import barrier, broadcast_object, on_every_rank
from squad.io.checkpoints import COMPLETE, complete_tags, find_resume_tag
from squad.io.files import atomic_write_text, fail
from squad.runtime import launch_rank

log = logging.getLogger("squad.train")

LOCK_FILE = "run.lock"
HISTORY_FILE = "run_history.jsonl"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # deepspeed/ops/csrc/cpu/comm/shm.cpp: SHM_BUFFER_NAME

# Keys that may change when a run resumes: its length and lr floor, clipping, cadences, safety limits, where the
# (same) data lives, how it is read, and validation. Any other change breaks exact resumption and is refused.
RESUMABLE_KEYS = (
    "train.compile",  # how the step runs, not what it computes
    "optim.steps", "optim.epochs", "optim.min_lr", "optim.clip",
    "train.log_every", "train.eval_every", "train.ckpt_every", "train.keep_checkpoints", "train.stop_at",
    "train.max_nonfinite", "train.progress", "train.init",  # init is read only by a fresh start
    "train.activation_checkpointing", "train.checkpoint_every",  # memory only: same losses and gradients
    "data.root", "data.workers", "data.val_split", "data.val_batches",
    "model.moe.expert_parallel", "model.moa.expert_parallel",  # where experts live, not what they compute
)

# What a run writes into its folder (what ``--overwrite`` deletes); the lock and shared-memory records stay.
OUTPUTS = ("config.yaml", "config.prev.yaml", "ds_config.json", "train.log", "metrics.jsonl", "tensorboard",
           "checkpoints", "model.pt", HISTORY_FILE)


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (locked, changed config, other world size, a run already there)."""

    every_rank = True  # rank 0 decides and every rank raises it (`RunFolder.prepare`): the tools print it once


class RunFolderLocked(RunFolderError):
    """Another live run holds the run folder's lock."""


# ------------------------------------------------------------------------------------------------------ lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


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
                if holder and (holder.get("host") != socket.gethostname() or _pid_alive(int(holder.get("pid", 0)))):
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


# ------------------------------------------------------------------------------------------- shared memory
@dataclasses.dataclass
class ShmSegments:
    """The ``/dev/shm`` segments DeepSpeed's CPU communication op creates for this run (none when it creates none).

    DeepSpeed creates them (deepspeed/comm/torch.py → ``shm_comm_op.initialize``) when every rank runs on this node
    (the launcher's ``LOCAL_SIZE`` equals the world size), named from the user id, ``MASTER_ADDR``, ``MASTER_PORT``
    and the rank.
    """

    names: list[str]
    rank: int
    addr: str = ""
    port: str = ""

    @classmethod
    def from_env(cls) -> ShmSegments:
        """The names this process's run will create, from the launcher's variables (before the group starts)."""
        env = os.environ
        world, local = env.get("WORLD_SIZE", "1"), env.get("LOCAL_SIZE", "0")
        rank = int(env.get("RANK", "0") or 0)
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        if not (local.isdigit() and world.isdigit() and int(local) >= 1 and local == world):
            return cls([], rank, addr, port)
        return cls([shm_name(addr, port, r) for r in range(int(world))], rank, addr, port)

    def record(self, run_dir: Path) -> None:
        """Rank 0: writes the names into the run folder before they exist (best effort; a failure to write is
        reported later by the run folder's own checks)."""
        if self.rank != 0 or not self.names:
            return
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self._record_path(run_dir), json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "addr": self.addr, "port": self.port,
                 "names": self.names}))
        except OSError:
            pass

    @staticmethod
    def _record_path(run_dir: Path) -> Path:
        return run_dir / f".shm-{socket.gethostname()}-{os.getpid()}.json"

    def unlink_own(self) -> None:
        """Unlinks this rank's segment; call once every rank has mapped every segment (after a barrier)."""
        if self.names:
            _unlink(self.names[self.rank])

    def close(self, run_dir: Path) -> None:
        """At the end of the run: unlinks whatever of this run's segments is left, and rank 0 drops its record."""
        self.unlink_own()
        if self.rank == 0:
            for name in self.names:
                _unlink(name)
        if self.names:
            try:
                self._record_path(run_dir).unlink(missing_ok=True)
            except OSError:
                pass


def shm_name(addr: str, port: str | int, rank: int) -> str:
    """The file name DeepSpeed gives rank ``rank``'s segment (``/dev/shm/<name>``)."""
    return f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def _unlink(name: str) -> int:
    """Removes ``/dev/shm/<name>``; returns the bytes freed (0 if it was not there)."""
    path = SHM_DIR / name
    try:
        size = path.stat().st_size
        path.unlink()
        return size
    except OSError:
        return 0


def _port_in_use(addr: str, port: str) -> bool:
    """Whether a live process listens on ``addr:port`` (a live run's rendezvous: its segments are not stale)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr or "127.0.0.1", int(port)))
    except (OSError, ValueError):
        return True
    return False


def remove_stale_shm(run_dir: Path) -> list[str]:
    """Removes the segments recorded in ``run_dir`` by earlier runs on this host whose process is gone.

    Call with the run folder's lock held. A record whose process still runs, which was written on another host, or
    whose rendezvous port is in use again is left alone.

    Returns:
        Notes on what was removed (for ``train.log``).
    """
    notes = []
    host = socket.gethostname()
    for path in sorted(run_dir.glob(".shm-*.json")):
        try:
            rec = json.loads(path.read_text())
            pid = int(rec["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if rec.get("host") != host or pid == os.getpid() or _pid_alive(pid):
            continue
        if _port_in_use(rec.get("addr", ""), rec.get("port", "")):
            continue
        freed = [(n, _unlink(n)) for n in rec.get("names", []) if isinstance(n, str) and n.startswith(SHM_PREFIX)]
        path.unlink(missing_ok=True)
        gone = [n for n, size in freed if size]
        if gone:
            notes.append(f"removed {len(gone)} shared-memory files ({sum(s for _, s in freed) / 2**20:.0f} MB) that "
                         f"an earlier run of this folder (pid {pid}) left in {SHM_DIR}: {', '.join(gone)}")
    return notes


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


def _tag_step(tag_dir: Path) -> int:
    try:
        return int(json.loads((tag_dir / COMPLETE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        digits = "".join(c for c in tag_dir.name if c.isdigit())
        return int(digits) if digits else 0


def resume_source(run_dir: Path, resume: str | None) -> tuple[Path, Path] | None:
    """The run folder and complete tag ``--resume`` will load, or None when the run starts at step 0.

    Mirrors `squad.train.engine.Trainer._maybe_resume` (a PATH with no complete checkpoint is left to it to report).
    """
    if resume in (None, "none", "no"):
        return None
    if resume == "auto":
        tag = find_resume_tag(run_dir / "checkpoints")
        return (run_dir, run_dir / "checkpoints" / tag) if tag else None
    path = Path(resume)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / COMPLETE).is_file():
        return path.parent.parent, path
    tag = find_resume_tag(path)
    return (path.parent, path / tag) if tag else None


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
    """The world size the checkpoint at ``step`` was written with (the last start before it), if recorded."""
    starts = [h for h in _history(source_dir) if isinstance(h.get("world_size"), int) and h.get("start_step", 0) < step]
    return starts[-1]["world_size"] if starts else None


class RunFolder:
    """One run's folder, opened by every rank (`prepare`) and closed at the end (`close`).

    Args:
        run_dir: the run folder (``--out``).
        rank: this process's global rank.
        world: the number of ranks.
        shm: this run's shared-memory segments (`ShmSegments.from_env`, recorded before the process group started).
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
        self._start: dict | None = None  # rank 0: this start's history entry, recorded once the checkpoint loads

    def prepare(self, cfg, resume: str | None, *, overwrite: bool = False,
                allow_world_size_change: bool = False) -> None:
        """Every rank: rank 0 creates and locks the folder, checks the resume against the folder's run, writes
        ``config.yaml``; every rank then frees its shared-memory name and learns the outcome.

        Raises:
            PermissionError: the folder cannot be created or written.
            RunFolderError: the folder is locked, or the resume would change what must not change (the message says
                what and how to proceed).
        """
        error = None
        if self.rank == 0:
            try:
                self._open(cfg, resume, overwrite, allow_world_size_change)
            except OSError as e:
                error = ("permission", f"run folder {self.run_dir} is not writable: {e.strerror or e}")
            except RunFolderError as e:
                error = ("run_folder", str(e))
            except Exception as e:  # the other ranks must not be left waiting in the broadcast
                error = ("other", f"opening run folder {self.run_dir} failed: {type(e).__name__}: {e}")
        error = broadcast_object(error)
        barrier()  # every rank has mapped every shared-memory segment: the names can go
        self.shm.unlink_own()
        if self.rank == 0 and self.lock is not None:
            self.notes += remove_stale_shm(self.run_dir)
        if error:
            kind = {"permission": PermissionError, "run_folder": RunFolderError}.get(error[0], RuntimeError)
            raise on_every_rank(kind(error[1]))

    def _open(self, cfg, resume: str | None, overwrite: bool, allow_world_size_change: bool) -> None:
        d = self.run_dir
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".write_test"
        probe.write_text("ok")
        probe.unlink()
        if self.lock is None:  # else taken before the process group started (`lock_before_start`)
            self.lock = RunLock.acquire(d, {"world_size": self.world})
        if self.lock.previous:
            self.notes.append(f"took over the lock of a run that is no longer running: {_describe(self.lock.previous)}")

        source = resume_source(d, resume)
        if source is None and resume not in (None, "none", "no", "auto"):
            raise RunFolderError(f"--resume {resume}: no complete checkpoint there")
        same_run = source is not None and source[0].resolve() == d.resolve()
        if overwrite:
            if same_run:
                raise RunFolderError(f"--overwrite would delete the checkpoint --resume {resume} loads "
                                     f"({source[1]}); resume without --overwrite, or pass another --out")
            if resume == "auto":
                source = None
            gone = clear_outputs(d)
            if gone:
                self.notes.append(f"--overwrite: deleted the earlier run's {', '.join(gone)} from {d}")
        elif has_run(d) and not same_run:
            if source is not None:
                what = f"--resume {resume} loads another run's checkpoint, but"
            elif resume == "auto":
                what = f"--resume auto: {d / 'checkpoints'} holds no complete checkpoint to resume, but"
            else:
                what = "--resume none:"
            raise RunFolderError(
                f"{what} run folder {d} already holds a run ({self._holdings()}); starting another one in it "
                f"would mix the two. Pass another --out, resume it (--resume auto), or add --overwrite to delete "
                f"its outputs and start over")
        elif source is None and (d / "config.yaml").exists():
            # an attempt killed before its first checkpoint: start again, without its logged history
            gone = clear_outputs(d, ("metrics.jsonl", "tensorboard", "ds_config.json"))
            self.notes.append(f"no complete checkpoint in {d / 'checkpoints'}: starting at step 0"
                              + (f" (deleted the earlier attempt's {', '.join(gone)})" if gone else ""))

        changes: dict = {}
        start_step = 0
        if source is not None:
            src_dir, tag_dir = source
            start_step = _tag_step(tag_dir)
            changes = self._check_config(cfg, src_dir, tag_dir)
            self._check_world_size(src_dir, tag_dir, start_step, allow_world_size_change)
        self._write(cfg, changes, source, start_step, same_run)

    def _holdings(self) -> str:
        tags = complete_tags(self.run_dir / "checkpoints")
        parts = [f"checkpoint {tags[-1]}"] if tags else []
        if (self.run_dir / "model.pt").exists():
            parts.append("model.pt")
        return ", ".join(parts)

    def _check_config(self, cfg, src_dir: Path, tag_dir: Path) -> dict:
        old_file = src_dir / "config.yaml"
        if not old_file.is_file():
            self.notes.append(f"{old_file} is missing: the config could not be compared with the checkpoint's")
            return {}
        refused, allowed = config_changes(read_run_config(old_file), to_dict(cfg))
        if refused:
            fresh = (f"pass another --out (or --resume none --overwrite to delete the run in {self.run_dir} and "
                     f"start over there)")
            raise RunFolderError(
                f"cannot resume {tag_dir} with a changed config: these keys would break exact resumption\n"
                f"{_fmt(refused)}\nTo train with the new values, start a new run: {fresh}. Keys that may change on "
                f"resume: {', '.join(RESUMABLE_KEYS)}")
        if allowed:
            self.notes.append(f"config changed on resume from {tag_dir}:\n{_fmt(allowed)}")
        return allowed

    def _check_world_size(self, src_dir: Path, tag_dir: Path, step: int, allow: bool) -> None:
        before = world_size_of(src_dir, step)
        if before is None:
            self.notes.append(f"the world size {tag_dir} was written with is not recorded: not checked")
            return
        if before == self.world:
            return
        what = (f"{tag_dir} was written by {before} ranks, this run has {self.world}: the global batch "
                f"(batch_per_rank × grad_accum × ranks) and each rank's share of the data would change")
        if not allow:
            raise RunFolderError(f"{what}. Resume on {before} ranks, or pass --allow-world-size-change to go on "
                                 f"(the run is then no longer equal to one trained on a fixed world size)")
        self.notes.append(f"world size changed on resume (--allow-world-size-change): {what}")

    def _write(self, cfg, changes: dict, source, start_step: int, same_run: bool) -> None:
        d = self.run_dir
        if changes and same_run and (d / "config.yaml").is_file():
            shutil.copyfile(d / "config.yaml", d / "config.prev.yaml")
        atomic_write_text(d / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), "the run's config")
        self._start = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": socket.gethostname(),
                       "pid": os.getpid(), "world_size": self.world,
                       "config_changes": {k: [old, new] for k, (old, new) in changes.items()}}

    def record_start(self, loaded: Path | None, step: int, skipped: list[Path] | None = None) -> None:
        """Rank 0, once the checkpoint is loaded: appends this start to ``run_history.jsonl`` with what was actually
        loaded (a damaged latest checkpoint is skipped for the one before it: `squad.train.checkpoint`).

        Args:
            loaded: the checkpoint tag loaded, or None for a start at step 0.
            step: the step the run starts from.
            skipped: damaged tags passed over before ``loaded``.
        """
        if self.rank != 0 or self._start is None:
            return
        entry = {**self._start, "start_step": int(step), "resumed_from": str(loaded) if loaded else None}
        if skipped:
            entry["skipped_damaged"] = [str(p) for p in skipped]
        path = self.run_dir / HISTORY_FILE
        try:
            with open(path, "a") as f:  # appended: the earlier lines stay whatever happens to this one
                f.write(json.dumps(entry) + "\n")
        except OSError as e:
            raise fail("the run history", path, e) from e
        self._start = None

    def close(self) -> None:
        """Frees what the run holds: its shared-memory segments, its record of them, the lock."""
        self.shm.close(self.run_dir)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
