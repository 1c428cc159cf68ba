"""Catching the signals that stop a training run (``train.save_on_signal``; what happens then is
`squad.train.checkpointer`'s).

`SignalWatch` replaces the signals' default action (terminate) from the moment the tool starts (`squad.cli.train`
installs it before parsing anything). Until the first training step (`SignalWatch.start_training`: start-up, the
resume, the step-0 validation) there is nothing new to save, so the first signal exits 75 at once with a line saying
so. From then on it is a request: the first signal sets `requested`, which the engine all-reduces with the step's loss
check so that every rank sees it at the same step boundary, and the checkpointer saves and stops there. A second
signal, at least `SignalWatch.REPEAT_S` after the first, exits at once with 128 + its number, after the clean-ups
registered with `SignalWatch.at_exit` (a save in progress is discarded, the run folder's lock released). A stop that
is not a signal (the ``deepspeed`` runner gone: `squad.train.watchdog`) goes through `SignalWatch.request`.

The handler runs between Python instructions: a rank inside a long collective call acts once the call returns. While
it is stuck there (a peer stopped or dead), `squad.train.watchdog` sees the signal through the wake-up pipe
(`SignalWatch.wakeup_fd`) and ends the run itself. SIGKILL always ends it.

Which process gets the signal matters under the launchers. SLURM sends SIGTERM to every process of a job step at the
time limit and on ``scancel`` (and SIGUSR1 with ``--signal=USR1@S``, to the batch shell only with ``B:``).
``deepspeed.launcher.launch`` forwards SIGTERM and SIGINT to its ranks (it SIGKILLs them 30 s later); the
``deepspeed`` runner forwards nothing and dies (its ranks see it gone and stop as on a signal), and SIGUSR1 ends both
launchers: signal the ranks themselves (``pkill -USR1 -f "tools/train.py --local_rank"``). A launcher that forwards
the signal it received too delivers it twice within milliseconds, which counts once. A closed terminal sends SIGHUP,
in the default ``save_on_signal`` too.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from squad.train.stops import EXIT_PREEMPTED

DEFAULT_SIGNALS = ("TERM", "USR1", "HUP")  # train.save_on_signal's default (squad.config.run)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name


def say(text: str) -> None:
    """Writes a line to stderr from a signal handler or a watchdog thread (``os.write``: no lock a logging call might
    hold)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class SignalWatch:
    """The signals of ``train.save_on_signal``: during start-up the first exits 75 at once; once training runs it
    asks for a checkpoint and a stop, and a second exits at once.

    `requested` is the first stop's signal number (0 for a stop that is no signal, `reason` says what; None before);
    the engine all-reduces it with the step's loss check. A second signal at least `REPEAT_S` after the first runs
    the `at_exit` clean-ups and exits with 128 + its number. Handlers are installed in the main thread only; a forked
    DataLoader worker, which inherits them, ignores the signal (its rank decides).

    Args:
        names: signal names (``TERM``, ``SIGUSR1``, ...).
        announce: print one line when the first signal arrives (rank 0).
    """

    REPEAT_S = 2.0  # a launcher that forwards the signal it got too delivers it again within milliseconds

    def __init__(self, names: list[str] | tuple[str, ...], announce: bool = True):
        self.signals = [_number(n) for n in names]
        self.announce = announce
        self.requested: int | None = None
        self.reason: str | None = None
        self.starting = True  # until `start_training`: a stop exits 75 at once
        self.handled_at = 0.0  # when the handler last ran (the watchdog compares it with when a signal arrived)
        self._first_at = 0.0
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._at_exit: list[Callable[[], None]] = []
        self._on_stop: list[Callable[[str], None]] = []
        self._ignoring = False
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup = -1

    def at_exit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` before an immediate exit (clean-ups; exceptions are ignored)."""
        self._at_exit.append(fn)

    def on_stop(self, fn: Callable[[str], None]) -> None:
        """Runs ``fn(message)`` before an immediate exit 75 (rank 0's stop record: `squad.train.stops`)."""
        self._on_stop.append(fn)

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for s in self.signals:
            self._take(s)

    def _take(self, s: int) -> None:
        # a process started with the signal ignored keeps ignoring it (``nohup`` ignores SIGHUP), as Python does
        if signal.getsignal(s) is not signal.SIG_IGN:
            self._previous[s] = signal.signal(s, self._handle)

    def watch(self, names: list[str] | tuple[str, ...]) -> None:
        """Handles ``names`` from now on instead (the run's ``train.save_on_signal``, known once its config is read);
        a signal dropped from the set gets its previous handler back."""
        wanted = [_number(n) for n in names]
        for s in [s for s in self.signals if s not in wanted]:
            if s in self._previous:
                signal.signal(s, self._previous.pop(s))
        installed = bool(self._previous) or not self.signals
        self.signals = wanted
        if installed:
            for s in wanted:
                if s not in self._previous:
                    self._take(s)

    def wakeup_fd(self) -> int | None:
        """The read end of a pipe that receives one byte (the signal's number) for every signal, even while the main
        thread is blocked in C code and its handler cannot run (``signal.set_wakeup_fd``); None outside the main
        thread. Read by `squad.train.watchdog`."""
        import threading

        if self._wakeup is None and threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._wakeup = (r, w)
            if not _WAKEUP_PIPES and not _FORK_HOOK:
                os.register_at_fork(after_in_child=_forget_wakeup_in_child)
                _FORK_HOOK.append(True)
            _WAKEUP_PIPES.add((r, w))
        return self._wakeup[0] if self._wakeup else None

    def restore(self) -> None:
        """Puts the signals' previous handlers back (a run that finished)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        self._close_wakeup()

    def _close_wakeup(self) -> None:
        import threading

        if self._wakeup is not None and threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._wakeup:
                os.close(fd)
            _WAKEUP_PIPES.discard(self._wakeup)
            self._wakeup = None

    def ignore(self) -> None:
        """From now on the signals are ignored: a run on its way out of a stop or an interrupt still says so and exits
        with its own code when a launcher, seeing another rank leave, signals this one too."""
        self._ignoring = True

    @property
    def ignoring(self) -> bool:
        """Whether the run is on its way out (`ignore`)."""
        return self._ignoring

    def start_training(self) -> None:
        """The first training step begins: from now on a stop is a checkpoint at the next step boundary."""
        self.starting = False

    def request(self, reason: str, signum: int = 0) -> None:
        """Asks for a stop that is no signal (``reason``: what happened, e.g. the runner is gone), as a signal does."""
        if self.requested is not None or self._ignoring:
            return
        if self.starting:
            self.exit_stopped(reason)
        self.requested, self.reason, self._first_at = signum, reason, time.monotonic()
        if self.announce:
            say(f"[squad] {reason}: every rank checkpoints at the next step boundary, then exits {EXIT_PREEMPTED}")

    def exit_stopped(self, what: str, detail: str = "before the first training step: nothing new to save",
                     announce: bool | None = None) -> None:
        """Exits 75 at once (a stop during start-up, or one a stuck rank cannot checkpoint): one line, the stop
        record, the clean-ups."""
        message = (f"{what} {detail}; exiting {EXIT_PREEMPTED} at once. Run the same command again to go on (from "
                   f"the newest checkpoint, if there is one)")
        if self.announce if announce is None else announce:
            say(f"stopped: {message}")
        for fn in self._on_stop:
            try:
                fn(message)
            except Exception:  # noqa: BLE001, S110 - leaving anyway
                pass
        self.leave(EXIT_PREEMPTED)

    def leave(self, code: int) -> None:
        """Runs the `at_exit` clean-ups and exits with ``code`` at once."""
        for fn in self._at_exit:
            try:
                fn()
            except Exception:  # noqa: BLE001, S110 - leaving anyway
                pass
        os._exit(code)

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid or self._ignoring:  # a forked worker, or a run already stopping
            return
        now = time.monotonic()
        self.handled_at = now
        if self.requested is None:
            if self.starting:
                self.exit_stopped(signal_name(signum))
            self.requested, self._first_at = signum, now
            if self.announce:
                say(f"[squad] {signal_name(signum)}: every rank checkpoints at the next step boundary, then exits "
                    f"{EXIT_PREEMPTED} (send it again to exit at once)")
            return
        if now - self._first_at < self.REPEAT_S:
            return
        if self.announce:
            say(f"[squad] {signal_name(signum)} again: exiting at once ({128 + signum}); a save in progress is "
                f"discarded")
        self.leave(128 + signum)


_WAKEUP_PIPES: set[tuple[int, int]] = set()
_FORK_HOOK: list[bool] = []  # registered once per process (os.register_at_fork has no undo)


def _forget_wakeup_in_child() -> None:
    """A forked process (a DataLoader worker) writes its signals to no pipe of its parent's."""
    if _WAKEUP_PIPES:
        try:
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):
            pass
        for pipe in _WAKEUP_PIPES:
            for fd in pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _WAKEUP_PIPES.clear()


def _number(name: str) -> int:
    return getattr(signal, "SIG" + name.upper().removeprefix("SIG"))
