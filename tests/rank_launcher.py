"""``deepspeed --num_gpus N --master_port P script ...`` for the tests whose subject is not the launcher: N ranks
forked from one interpreter that imported torch, DeepSpeed and squad once.

A 2-rank ``deepspeed`` launch starts four interpreters that each import torch and DeepSpeed (the runner,
``deepspeed.launcher.launch`` and the two ranks; a rank of tools/train.py imports ~9 s of CPU): most of a tiny test
run's work (the README's tiny 2-rank demo training took 24.5 s of CPU, a tiny one-process training forked from the
tool server 4-5 s; a loaded 2-core machine). Here one
interpreter imports them (`tests.toolserver.PRELOAD`, no tensor op: no thread pool exists yet, forking is safe) and
forks the ranks. Each rank gets what ``deepspeed.launcher.launch`` gives it on one node: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``/``CROSS_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, the checkout's folder
first on ``PYTHONPATH`` (the runner's), unbuffered output and ``--local_rank=I`` before the script's arguments; it
runs the script as ``__main__`` (`runpy.run_path`). The ranks write to this process's stdout and stderr (one stream
each, as the launcher's). When a rank fails, the others get SIGTERM (then SIGKILL 30 s later), and this exits with
the first failure's status, as the launcher does; SIGTERM and SIGINT are passed on to the ranks.

`tests.helpers.launcher` names it; `tests.helpers.run_command` hands such a command to the test worker's tool server
(`tests.toolserver`), which forks the ranks from its own preloaded interpreter (no import at all). The tests of the
launchers themselves (signals handed through them, a peer stopped or killed, the README's commands) run the real
``deepspeed``: `tests.helpers.DEEPSPEED`.

Usage: ``python tests/rank_launcher.py --num_gpus N --master_port P SCRIPT [ARGS...]``
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import sys
import time
import traceback

from toolserver import preload  # this folder is sys.path[0]


def _rank(rank: int, world: int, port: str, script: str, args: list[str]) -> None:
    """In the fork: becomes rank ``rank``, runs ``script`` as ``__main__``, leaves with its exit status (`_leave`)."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_SIZE": str(world), "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": port, "PYTHONUNBUFFERED": "1"})
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    path = os.path.abspath(script)
    sys.argv = [path, f"--local_rank={rank}", *args]
    sys.path[0] = os.path.dirname(path)
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter would print and exit 1 with
        traceback.print_exc()
        code = 1
    _leave(code)


def _leave(code: int) -> None:
    """Python's exit handlers, then the end of the process without C++'s static destructors: a fork holds the
    std::thread objects of threads its parent's libraries started, which it does not have, and destroying a joinable
    one aborts the rank at exit ("terminate called without an active exception", exit 134; seen once in the ZeRO-3
    run of a clean-clone `make test`)."""
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def parse(argv: list[str]) -> tuple[int, str, str, list[str]]:
    """``--num_gpus N --master_port P SCRIPT ARGS...`` as (N, P, SCRIPT, ARGS)."""
    opts = {}
    while argv and argv[0] in ("--num_gpus", "--master_port"):
        opts[argv[0]] = argv[1]
        argv = argv[2:]
    return int(opts["--num_gpus"]), opts["--master_port"], argv[0], argv[1:]


def main() -> None:
    world, port, script, args = parse(sys.argv[1:])
    preload()
    launch(world, port, script, args)


def launch(world: int, port: str, script: str, args: list[str]) -> None:
    """Forks the ``world`` ranks of ``script`` from this (preloaded) process, waits for them and exits with the first
    failure's status (0 when every rank succeeded); `tests.toolserver` calls it in a fork of its own."""
    cwd = os.getcwd()
    os.environ["PYTHONPATH"] = cwd + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    if cwd not in sys.path:
        sys.path.insert(1, cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, script, args)  # never returns (os._exit)
        pids.append(pid)

    def forward(sig, _frame):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed, killed_at = 0, None
    alive = set(pids)
    while alive:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if killed_at is not None and time.monotonic() - killed_at > 30:
                forward(signal.SIGKILL, None)
                killed_at = float("inf")
            time.sleep(0.05)
            continue
        alive.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            forward(signal.SIGTERM, None)
            killed_at = time.monotonic()
    sys.exit(failed)


if __name__ == "__main__":
    main()
