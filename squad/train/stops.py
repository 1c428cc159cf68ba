"""How a run stops before its end, as the exceptions the tools turn into exit codes (`squad.cli.run`): light (no
torch), so the tools can tell them apart before anything heavy is imported.

- `TrainingError` (exit 3): the run cannot go on — too many non-finite losses in a row, a checkpoint that could not be
  written; the message says why and what to try.
- `Preempted` (exit 75, `EXIT_PREEMPTED`): a signal (``train.save_on_signal``) stopped the run after a complete
  checkpoint; running the same command again resumes it. 75 is EX_TEMPFAIL (sysexits.h), "try again later", which a
  requeue script tells apart from a failure; the run also leaves a record of it in its folder (`STOP_RECORD`), which
  a batch script reads where a launcher hides the ranks' exit code.
"""

from __future__ import annotations

import os
from pathlib import Path

EXIT_PREEMPTED = 75


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite losses in a row); the message says why and what to try."""

    every_rank = True  # raised on every rank alike (losses are reduced, failed saves broadcast): printed once


class PeerLost(TrainingError):
    """Another rank died or stopped answering (`squad.train.watchdog`): the run cannot go on; the message names the
    rank and the checkpoint a rerun resumes from. Printed by the lowest rank still alive (``every_rank`` is set per
    error)."""


class Preempted(Exception):  # noqa: N818 - an outcome, not a failure
    """The run stopped on a signal after saving a checkpoint; the message names it. Rerun the command to resume."""

    every_rank = True  # every rank stops at the same step boundary: printed once


# The run's own record of a stop it can resume from: rank 0 writes it into the run folder when the run exits 75, and
# the next start removes it. A requeue script reads it instead of the launcher's exit code (the ``deepspeed`` runner
# returns 1 or 143 while its ranks exit 75): docs/operating.md, "Preemption".
STOP_RECORD = "STOPPED"


def write_stop_record(run_dir: str | Path, message: str) -> None:
    """Writes ``<run_dir>/STOPPED``: one JSON line saying the run stopped on a signal and resumes when rerun."""
    import json
    import time

    path = Path(run_dir) / STOP_RECORD
    tmp = path.with_name(f".{STOP_RECORD}.tmp")
    try:
        tmp.write_text(json.dumps({"resumable": True, "exit_code": EXIT_PREEMPTED, "message": message,
                                   "time": time.time()}) + "\n")
        os.replace(tmp, path)
    except OSError:  # a full or read-only disk: the exit code still says it
        pass


def clear_stop_record(run_dir: str | Path) -> None:
    """Removes the record of an earlier stop (a run starting in the folder)."""
    try:
        (Path(run_dir) / STOP_RECORD).unlink()
    except OSError:
        pass
