"""The command-line tools: one module per tool (its argparse parser and ``main(argv)``), one error policy for all.

Every tool runs the same ``main`` three ways:

    python tools/extract.py ...        # the script in a checkout (the one launched under deepspeed / torchrun)
    squad-extract ...                  # console script installed by ``pip install -e .`` ([project.scripts])
    python -m squad.cli.extract ...

Exit codes, the same for every tool (`run`):

- 0: done;
- 1: the tool ran but reports a failure of its own (a benchmark case errored, the demo did not learn);
- 2: bad input: a wrong argument, config key, missing or unreadable file (``error: ...`` on stderr; argparse's
  usage errors exit 2 too);
- 3: training stopped (`squad.train.stops.TrainingError`, e.g. too many non-finite losses in a row), or a file
  could not be written (`squad.io.files.WriteError`: a full disk; the message names the file and the free space,
  and no partial file is left);
- 75: training stopped on a signal (``train.save_on_signal``: SIGTERM, SIGUSR1, SIGHUP) after a complete checkpoint
  (`squad.train.stops.Preempted`), or before its first step with nothing to save; running the same command again
  resumes it. 75 is EX_TEMPFAIL, "try again later"; the run also leaves ``<out>/STOPPED``, which a requeue script
  reads where a launcher hides the ranks' code (the ``deepspeed`` runner returns 1 or 143);
- 130: interrupted (Ctrl-C), one ``interrupted`` line per launch: a rank whose collective call failed because a peer
  left on the same Ctrl-C exits 130 too, without a traceback; 128 + N: a second ``train.save_on_signal`` signal N
  (143 for SIGTERM) ended the run at once.

Nothing here imports torch: a tool checks its arguments, config and paths first, so bad input exits 2 in a fraction
of a second (`squad.lazy`).

`run` also prints, at the end of every tool, one line per dataset the tool read and did not report itself: the
files it could not use (corrupt, wrong size, missing; `squad.data.accounting`). A multi-rank run's process group is
torn down before the exit (`squad.distributed.shutdown`), so a rank never aborts on its way out and the
launcher passes the tool's own exit code on. Every ``--device`` is checked by `device_arg` (exit 2 naming it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_TRAINING_FAILED = 3
EXIT_WRITE_FAILED = 3  # the same code: the job stopped, and rerunning it once the cause is fixed goes on
EXIT_PREEMPTED = 75  # squad.train.stops.EXIT_PREEMPTED
EXIT_INTERRUPTED = 130
PEER_GRACE_S = 5.0  # how long a rank that leaves an error to rank 0 waits before it exits (rank 0 prints it)

# What a user can fix: a wrong value or config key (`squad.config.base.ConfigError` is a ValueError), a path that is
# missing, not a folder, a folder, or not writable.
BAD_INPUT: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                                              FileExistsError, PermissionError)


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]  # str(KeyError("text")) would quote it
    return str(e) or type(e).__name__


def run(body: Callable[[list[str] | None], int], argv: list[str] | None = None, *,
        bad_input: tuple[type[BaseException], ...] = ()) -> int:
    """Runs a tool's body and maps what it raises to the exit codes above.

    Args:
        body: parses ``argv`` and does the work; returns the exit status (0, or 1 for a failure it reports itself).
        argv: the arguments (``None``: ``sys.argv[1:]``, argparse's default).
        bad_input: more exception types this tool reports as bad input (exit 2), beside `BAD_INPUT`.

    Returns:
        The exit status. Other exceptions propagate with their traceback: they are bugs, not bad input.
    """
    from squad.runtime import watch_interrupts

    watch_interrupts()
    try:
        code = _run(body, argv, bad_input)
    except KeyboardInterrupt:  # Ctrl-C while an error was being reported
        code = _interrupted()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _leave_rank(code)
    if "torch.distributed" in sys.modules:
        from squad.distributed import shutdown

        shutdown()
    return code


def _run(body: Callable[[list[str] | None], int], argv: list[str] | None,
         bad_input: tuple[type[BaseException], ...]) -> int:
    from squad.data.accounting import track  # these three import no torch
    from squad.io.files import WriteError
    from squad.runtime import interrupted
    from squad.train.stops import Preempted, TrainingError

    try:
        with track() as tracked:
            code = body(argv)
        for line in dict.fromkeys(d.line() for d in tracked.pending()):  # datasets the tool read and did not report
            print(f"[squad] {line}", file=sys.stderr)  # (the same split read twice is one line)
        return code
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as e:
        if interrupted():  # e.g. a collective whose peer left on the same Ctrl-C: not an error of its own
            return _interrupted()
        if isinstance(e, Preempted):
            _error(e, "stopped")
            return EXIT_PREEMPTED
        if isinstance(e, TrainingError):
            _error(e)
            return EXIT_TRAINING_FAILED
        if isinstance(e, WriteError):
            _error(e)
            return EXIT_WRITE_FAILED
        if isinstance(e, BAD_INPUT + bad_input):
            _error(e)
            return EXIT_BAD_INPUT
        raise


def _interrupted() -> int:
    """Ctrl-C: one ``interrupted`` line per launch (rank 0's, or the one process's)."""
    from squad.runtime import launch_rank

    if not launch_rank():
        print("interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def _group_started() -> bool:
    if "torch.distributed" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _error(e: BaseException, what: str = "error") -> None:
    """Prints ``error: ...`` once per launch: on rank 0, and on another rank only when the error is its own — not
    one every rank raises alike (marked ``every_rank``: `squad.distributed.on_every_rank`), nor one met before the
    process group started (every rank parsed the same arguments and config), which rank 0 prints."""
    from squad.runtime import launch_rank

    rank = launch_rank() or 0
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and rank != 0:
        if getattr(e, "every_rank", False) or not _group_started():
            time.sleep(PEER_GRACE_S)  # the launcher kills every rank once one fails: rank 0, which says it, first
            return
        print(f"{what} (rank {rank}): {_message(e)}", file=sys.stderr)
        return
    print(f"{what}: {_message(e)}", file=sys.stderr)


def _leave_rank(code: int) -> None:
    """Ends a launched rank (``WORLD_SIZE`` > 1) with ``code`` and without the interpreter's C++ teardown.

    A rank whose peer has already gone can die while gloo's and DeepSpeed's comm threads are destroyed at exit
    ("terminate called without an active exception", SIGABRT), and the launcher then reports 250 instead of the
    tool's exit code; tearing the process group down first does not prevent it. Everything a run writes is closed by
    then (checkpoints, model.pt, TensorBoard, the run folder's lock and /dev/shm segments), so the rank flushes its
    logs and output and leaves at once.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def device_arg(name: str) -> str:
    """The ``type=`` of every tool's ``--device``: a device this machine has (else argparse's exit 2, naming it).
    ``cpu`` is taken without importing torch; a GPU is asked about through torch.

    Returns:
        `name` unchanged (the tools pass the string on).
    """
    if name == "cpu":
        return name
    from squad.distributed import check_device

    try:
        check_device(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device ")) from None  # argparse names the flag
    return name


def require_paths(checkpoint: str | list[str] | None = None, data: str | None = None) -> None:
    """Refuses a ``--checkpoint`` or ``--data`` that does not exist before the tool imports anything heavy (exit 2
    at once; `squad.load` and the data readers say the same after loading torch). A hub id (``hf-hub:org/name``)
    is resolved later, by `squad.load`.

    Raises:
        FileNotFoundError: naming the path.
    """
    from pathlib import Path

    from squad.io.hf_folder import is_hub_id

    for path in [checkpoint] if isinstance(checkpoint, str) else checkpoint or []:
        if not is_hub_id(path) and not Path(path).exists():
            raise FileNotFoundError(f"model file not found: {path}")
    if data is not None:
        missing_data(data)


def beside(checkpoint: str):
    """The folder a tool writes its default outputs into for ``--checkpoint``: the run folder (or the folder) it
    names, the folder of a file, or the working folder for a hub id (never huggingface_hub's cache): a `Path`. A
    checkpoint tag, a file in one, or a run's ``checkpoints`` folder gives the run folder: a tag is removed whole
    when the run prunes it, and anything written into it with it."""
    from pathlib import Path

    from squad.io.checkpoints import LATEST, complete_tags, marked_step
    from squad.io.hf_folder import is_hub_id

    if is_hub_id(checkpoint):
        return Path(".")
    path = Path(checkpoint)
    folder = path if path.is_dir() else path.parent
    if marked_step(folder) is not None:  # a tag (or a file in one): its run folder
        return folder.parent.parent
    if (folder / LATEST).is_file() or complete_tags(folder):  # a run's checkpoints folder
        return folder.parent
    return folder


def missing_data(root: str, dataset: str | None = None) -> None:
    """Refuses a data root that does not exist, saying how to make one (torch-free: `require_paths`, the train tool).

    Raises:
        FileNotFoundError: naming the folder.
    """
    from pathlib import Path

    if not Path(root).exists():
        kind = f" --dataset {dataset}" if dataset not in (None, "taskonomy") else ""
        raise FileNotFoundError(f"data root {root} does not exist. Make a small synthetic one with: python "
                                f"tools/make_data.py synthetic{kind} --out {root} (or point it at the real data)")


def rerun_with_passive_omp(module: str) -> None:
    """Puts ``OMP_WAIT_POLICY=PASSIVE`` in effect for a console script (``squad-train``, ``squad-bench``).

    OpenMP threads that spin while waiting stall every parallel region when another process holds a core (see
    `squad.runtime`). libgomp reads the variable once, when torch loads it, and a console script has imported
    torch (through ``import squad``) before any tool code runs; so this sets the variable and runs the same command
    again as ``python -m <module>``. Nothing happens when the variable is already set.

    Args:
        module: the tool's module, e.g. ``"squad.cli.train"`` (it must end in ``sys.exit(main())``).
    """
    if "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]])
