"""The watchdog of a training run: a peer rank that stopped answering, a peer that died, the launcher gone, and a
signal that arrives while this rank is stuck waiting for a peer.

A rank inside a collective call waits in C code, where no Python signal handler runs and no timeout of DeepSpeed's
CPU communication op applies: a peer stopped with ``kill -STOP`` (or hung, or on a node that vanished) would hold
every other rank forever, deaf to SIGTERM. `PeerWatch` is a thread on every rank that

- keeps a heartbeat in the rendezvous store (a counter each rank's thread adds to every `POLL_S`: a stopped or
  frozen process stops adding, a busy one does not) and, on the same host, reads each peer's process state;
- ends the run with one line naming the rank when a peer has not answered for ``train.peer_timeout`` seconds, or has
  died (exit 3, `EXIT_PEER_LOST`): nothing is saved (a checkpoint needs every rank), the newest checkpoint stays, and
  running the same command again resumes from it;
- sees every signal through `SignalWatch.wakeup_fd`, so a stop signal that this rank's handler cannot run (stuck in
  a collective with a silent peer) still ends the run at once with exit 75 and the stop record, and a second signal
  exits as the handler would (128 + its number);
- asks for a stop (a checkpoint at the next step boundary, exit 75) when the ``deepspeed`` runner or launcher that
  started this rank is gone (killed with SIGTERM, SIGHUP: the ranks would otherwise train on as orphans).

The lowest-numbered rank still alive prints the line; the others exit with the same code quietly.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path

from squad.io.checkpoints import find_resume_tag
from squad.runtime import pid_alive
from squad.train.signals import SignalWatch, say, signal_name

EXIT_PEER_LOST = 3  # the run cannot go on (squad.cli: 3); rerunning resumes from the newest checkpoint


def process_state(pid: int) -> str | None:
    """The state letter of a local process (``R``, ``S``, ``T`` stopped, ``Z`` zombie...) from /proc; None when it is
    gone (or /proc is not there: then `pid_alive` decides)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        return "S" if pid_alive(pid) else None
    return stat.rpartition(")")[2].split()[0]


def launcher_ancestors() -> list[tuple[int, str]]:
    """The ``deepspeed`` runner and ``deepspeed.launcher.launch`` processes above this one (pid, what), nearest
    first; [] under other launchers (torchrun's agent ends its ranks itself) or none."""
    found = []
    pid = os.getppid()
    for _ in range(3):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        words = [a.decode(errors="replace") for a in argv[:3]]
        if "deepspeed.launcher.launch" in words:
            found.append((pid, "deepspeed.launcher.launch"))
        elif any(w.endswith("/deepspeed") or w == "deepspeed" or w == "deepspeed.launcher.runner" for w in words):
            found.append((pid, "the deepspeed runner"))
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent <= 1:
            break
        pid = parent
    return found


class PeerWatch:
    """One rank's watchdog thread (module docstring). `start` after the process group exists, `stop` when the rank
    leaves the run normally (it then tells its peers it left, so none reports it dead).

    Args:
        rank, world: this rank and the number of ranks.
        run_dir: the run folder (its newest checkpoint is named in the line).
        signals: the run's `SignalWatch` (its clean-ups run before an exit; its stop request is made here).
        timeout: seconds a peer may stay silent (``train.peer_timeout``; 0: never end the run for that).
    """

    POLL_S = 1.0
    STUCK_S = 3.0  # a signal not handled this long after it arrived: the main thread is stuck in C code
    DEAD_GRACE_S = 5.0  # a dead peer: the main thread's own error (`lost_peer`) gets this long to report it first

    def __init__(self, rank: int, world: int, run_dir: str | Path, signals: SignalWatch, timeout: float):
        self.rank, self.world = rank, world
        self.run_dir = Path(run_dir)
        self.signals = signals
        self.timeout = timeout
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._wakeup: int | None = None
        self._counts: dict[int, int] = {}
        self._changed: dict[int, float] = {}  # when each peer's heartbeat last moved (this host's clock)
        self._pids: dict[int, tuple[str, int]] = {}
        self._left: set[int] = set()
        self._dead_since: dict[int, float] = {}
        self._ancestors: list[tuple[int, str]] = []
        self._arrived: list[tuple[float, int]] = []  # stop signals seen on the wake-up pipe, not yet handled
        self._runner_gone = False

    # ------------------------------------------------------------------------------------------ life cycle
    def start(self) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self._ancestors = launcher_ancestors()
        self._wakeup = self.signals.wakeup_fd()
        if self.world > 1:
            try:
                self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                            is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
                self._store.set(f"squad/pid/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
                self._store.add(f"squad/alive/{self.rank}", 1)
            except (KeyError, ValueError, RuntimeError) as e:  # no store to reach: the peers go unwatched
                say(f"[squad] rank {self.rank}: no watchdog over the peers ({e})")
                self._store = None
        now = time.monotonic()
        self._changed = {p: now for p in range(self.world) if p != self.rank}
        self._thread = threading.Thread(target=self._loop, name="squad-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread; tells the peers this rank left the run on purpose."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.mark_left()

    def mark_left(self) -> None:
        """Tells the peers this rank leaves the run on purpose (a stop, an error of its own), not dead."""
        if self._store is not None:
            try:
                self._store.set(f"squad/left/{self.rank}", "1")
            except RuntimeError:
                pass

    # --------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._read_signals()
            if self._stop.is_set():
                return
            now = time.monotonic()
            self._beat(now)
            self._check_launcher()
            self._check_stuck(now)
            self._check_peers(now)

    def _read_signals(self) -> None:
        if self._wakeup is None:
            self._stop.wait(self.POLL_S)
            return
        try:
            ready, _, _ = select.select([self._wakeup], [], [], self.POLL_S)
            data = os.read(self._wakeup, 64) if ready else b""
        except (OSError, ValueError):  # the pipe was closed (the run is ending)
            self._wakeup = None
            return
        now = time.monotonic()
        self._arrived += [(now, s) for s in data if s in self.signals.signals]

    def _beat(self, now: float) -> None:
        if self._store is None:
            return
        try:
            self._store.add(f"squad/alive/{self.rank}", 1)
            for p in list(self._changed):
                count = self._store.add(f"squad/alive/{p}", 0)
                if count != self._counts.get(p):
                    self._counts[p], self._changed[p] = count, now
                if p not in self._pids and self._store.check([f"squad/pid/{p}"]):
                    host, pid = self._store.get(f"squad/pid/{p}").decode().split()
                    self._pids[p] = (host, int(pid))
                if p not in self._left and self._store.check([f"squad/left/{p}"]):
                    self._left.add(p)
        except RuntimeError:  # the store (in rank 0's process) does not answer: no heartbeat moves
            pass

    def _check_launcher(self) -> None:
        if self._runner_gone:
            return
        for pid, what in self._ancestors:
            if process_state(pid) in (None, "Z", "X"):
                self._runner_gone = True
                self.signals.request(f"the exit of {what} (pid {pid})")
                return

    def _dead(self, p: int) -> bool:
        host, pid = self._pids.get(p, ("", 0))
        return host == socket.gethostname() and pid > 0 and process_state(pid) in (None, "Z", "X")

    def _silence(self, p: int, now: float) -> float:
        return now - self._changed.get(p, now)

    def _check_stuck(self, now: float) -> None:
        """A stop signal the main thread has not handled `STUCK_S` after it arrived: it waits in C code."""
        self._arrived = [(t, s) for t, s in self._arrived if self.signals.handled_at < t]
        if self.signals.ignoring:  # on its way out: the signals that follow ask for nothing
            self._arrived = []
        if not self._arrived or now - self._arrived[0][0] < self.STUCK_S:
            return
        first, signum = self._arrived[0]
        silent = [p for p in self._changed if p not in self._left and
                  (self._dead(p) or self._silence(p, now) >= self.STUCK_S)]
        if silent:
            self.signals.exit_stopped(signal_name(signum), (
                f"while rank {self.rank} waits for {self._describe(silent, now)}: no checkpoint can be written "
                f"without every rank, so none is; the newest checkpoint stays"), announce=self._speaks(silent))
        repeat = [(t, s) for t, s in self._arrived if t - first >= self.signals.REPEAT_S]
        if repeat:
            say(f"[squad] {signal_name(repeat[0][1])} again while rank {self.rank} waits in a collective call: "
                f"exiting at once ({128 + repeat[0][1]})")
            self.signals.leave(128 + repeat[0][1])

    def _check_peers(self, now: float) -> None:
        live = [p for p in self._changed if p not in self._left]
        for p in live:
            if self._dead(p):
                self._dead_since.setdefault(p, now)
        dead = [p for p in live if now - self._dead_since.get(p, now) >= self.DEAD_GRACE_S]
        silent = [p for p in live if self.timeout and self._silence(p, now) >= self.timeout]
        if dead or silent:
            lost = sorted(set(dead) | set(silent))
            if self._speaks(lost):
                say(f"error: {self.lost_message(lost, now)}")
            self.signals.leave(EXIT_PEER_LOST)

    # ------------------------------------------------------------------------------------------- messages
    def _speaks(self, lost: list[int]) -> bool:
        """Whether this rank is the lowest one still in the run (it prints the line)."""
        return all(p in lost or p in self._left for p in range(self.rank))

    def _describe(self, ranks: list[int], now: float) -> str:
        parts = []
        for p in ranks:
            host, pid = self._pids.get(p, ("", 0))
            where = f" (pid {pid}{'' if host == socket.gethostname() else ' on ' + host})" if pid else ""
            state = process_state(pid) if pid and host == socket.gethostname() else "?"
            if self._dead(p):
                what = "which died (killed, or crashed: its own output says why)"
            elif state == "T":
                what = f"which is stopped (SIGSTOP) and has not answered for {self._silence(p, now):.0f} s"
            else:
                what = f"which has not answered for {self._silence(p, now):.0f} s (hung, or its node is gone)"
            parts.append(f"rank {p}{where}, {what}")
        return "; ".join(parts)

    def lost_message(self, lost: list[int], now: float | None = None) -> str:
        """The line for peers that died or went silent: who, and what a rerun does."""
        now = time.monotonic() if now is None else now
        latest = find_resume_tag(self.run_dir / "checkpoints")
        resume = (f"the newest checkpoint, {self.run_dir / 'checkpoints' / latest}, is intact: run the same command "
                  f"again to resume from it" if latest else "the run has no checkpoint yet: running the same command "
                  "again starts it over")
        limit = f" (train.peer_timeout={self.timeout:g} s)" if any(not self._dead(p) for p in lost) else ""
        return (f"the run cannot go on without {self._describe(lost, now)}{limit}. Nothing partial was saved; "
                f"{resume}")

    def lost_peer(self, wait: float = 3.0) -> tuple[str, bool] | None:
        """The line for a peer that died (a collective call failed on this rank: gloo's "Connection closed by
        peer"), once the process states say which (waiting up to ``wait`` seconds), and whether this rank prints it;
        None when no peer died."""
        deadline = time.monotonic() + wait
        while True:
            lost = [p for p in self._changed if p not in self._left and self._dead(p)]
            if lost:
                return self.lost_message(lost), self._speaks(lost)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)
