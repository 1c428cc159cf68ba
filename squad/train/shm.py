"""DeepSpeed's shared-memory segments on one node: freed as soon as every rank has mapped them, and those of an earlier
run of the same folder that crashed removed by the next (`squad.train.run_folder.RunFolder` calls these).

Under the deepspeed launcher on one node, DeepSpeed's CPU communication op creates one ~66 MB POSIX shared-memory
segment per rank (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``) and never
unlinks it. Each rank unlinks its own once every rank has mapped them all (the mappings stay valid), and rank 0
records the names (``.shm-<host>-<pid>.json``) before the process group starts, so the segments of a run that
crashed even earlier are removed by the next run of the same folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

from squad.io.files import atomic_write_text
from squad.runtime import pid_alive

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"  # deepspeed/ops/csrc/cpu/comm/shm.cpp: SHM_BUFFER_NAME


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
        if rec.get("host") != host or pid == os.getpid() or pid_alive(pid):
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
