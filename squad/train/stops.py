"""How a run stops before its end, as the exceptions the tools turn into exit codes (`squad.cli.run`): light (no
torch), so the tools can tell them apart before anything heavy is imported.

- `TrainingError` (exit 3): the run cannot go on — too many non-finite losses in a row, a checkpoint that could not be
  written; the message says why and what to try.
- `Preempted` (exit 75, `EXIT_PREEMPTED`): a signal (``train.save_on_signal``) stopped the run after a complete
  checkpoint; running the same command again resumes it. 75 is EX_TEMPFAIL (sysexits.h), "try again later", which a
  requeue script tells apart from a failure.
"""

from __future__ import annotations

EXIT_PREEMPTED = 75


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite losses in a row); the message says why and what to try."""

    every_rank = True  # raised on every rank alike (losses are reduced, failed saves broadcast): printed once


class Preempted(Exception):  # noqa: N818 - an outcome, not a failure
    """The run stopped on a signal after saving a checkpoint; the message names it. Rerun the command to resume."""

    every_rank = True  # every rank stops at the same step boundary: printed once
