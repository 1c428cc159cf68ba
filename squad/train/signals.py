"""Catching the signals that stop a training run with a checkpoint (``train.save_on_signal``; what happens then is
`squad.train.checkpointer`'s).

`SignalWatch` replaces the signals' default action (terminate) with a request: the first signal sets `requested`,
which the engine all-reduces with the step's loss check so that every rank sees it at the same step boundary, and the
checkpointer saves and stops there. A second signal, at least `SignalWatch.REPEAT_S` after the first, exits at once
with 128 + its number, after the clean-ups registered with `SignalWatch.at_exit` (a save in progress is discarded,
the run folder's lock released). The handler runs between Python instructions: a rank inside a long collective call
acts once the call returns (SIGKILL always ends it).

Which process gets the signal matters under the launchers. SLURM sends SIGTERM to every process of a job step at the
time limit and on ``scancel`` (and SIGUSR1 with ``--signal=USR1@S``, to the batch shell only with ``B:``).
``deepspeed.launcher.launch`` forwards SIGTERM and SIGINT to its ranks (it SIGKILLs them 30 s later); the
``deepspeed`` runner forwards nothing and dies, and SIGUSR1 ends both launchers: signal the ranks themselves
(``pkill -USR1 -f "tools/train.py --local_rank"``). A launcher that forwards the signal it received too delivers it
twice within milliseconds, which counts once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

from squad.train.stops import EXIT_PREEMPTED


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name


def _say(text: str) -> None:
    """Writes a line to stderr from a signal handler (``os.write``: no lock a logging call might hold)."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


class SignalWatch:
    """The signals of ``train.save_on_signal``: the first asks for a checkpoint and a stop, a second exits at once.

    `requested` is the first signal's number (None before); the engine all-reduces it with the step's loss check.
    A second signal at least `REPEAT_S` after the first runs the `at_exit` clean-ups (a save in progress is
    discarded, the run folder's lock released) and exits with 128 + its number. Handlers are installed in the main
    thread only; a forked DataLoader worker, which inherits them, ignores the signal (its rank decides).

    Args:
        names: signal names (``TERM``, ``SIGUSR1``, ...).
        announce: print one line when the first signal arrives (rank 0).
    """

    REPEAT_S = 2.0  # a launcher that forwards the signal it got too delivers it again within milliseconds

    def __init__(self, names: list[str], announce: bool = True):
        self.signals = [getattr(signal, "SIG" + n.upper().removeprefix("SIG")) for n in names]
        self.announce = announce
        self.requested: int | None = None
        self._first_at = 0.0
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._at_exit: list[Callable[[], None]] = []
        self._ignoring = False

    def at_exit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` before an immediate exit on a second signal (clean-ups; exceptions are ignored)."""
        self._at_exit.append(fn)

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)

    def restore(self) -> None:
        """Puts the signals' previous handlers back (a run that finished)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def ignore(self) -> None:
        """From now on the signals are ignored: a run on its way out of a stop or an interrupt still says so and exits
        with its own code when a launcher, seeing another rank leave, signals this one too."""
        self._ignoring = True

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid or self._ignoring:  # a forked worker, or a run already stopping
            return
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._first_at = signum, now
            if self.announce:
                _say(f"[squad] {signal_name(signum)}: every rank checkpoints at the next step boundary, then exits "
                     f"{EXIT_PREEMPTED} (send it again to exit at once)")
            return
        if now - self._first_at < self.REPEAT_S:
            return
        if self.announce:
            _say(f"[squad] {signal_name(signum)} again: exiting at once ({128 + signum}); a save in progress is "
                 f"discarded")
        for fn in self._at_exit:
            try:
                fn()
            except Exception:  # noqa: BLE001, S110 - leaving anyway
                pass
        os._exit(128 + signum)
