"""Several jobs of an invocation at once, each in a process of its own (``tools/reproduce.py --parallel N``).

A `Job` is a module-level function and its keyword arguments (both picklable: the process is started with
``spawn``, so nothing of the parent's state leaks into it — DeepSpeed's process group, CUDA, open files). `run_jobs`
keeps at most N processes running and starts the next job as one ends:

* every process gets its own rendezvous port (``MASTER_PORT``: a one-rank DeepSpeed group each);
* on a CPU every process gets cores / N threads (``OMP_NUM_THREADS``), so N runs do not oversubscribe the machine;
* on a machine with several GPUs process slot i sees GPU i mod G only (``CUDA_VISIBLE_DEVICES``): one run per GPU
  when N = G; with one GPU the N processes share it (a run at the reproduction's widths leaves it mostly idle).

The environment is set in the parent around each start (a spawned process inherits the parent's environment as it
is then), so it is in place before the child imports torch. A job that fails (its exit code is not 0) stops new jobs
from starting; the ones running are waited for, then `run_jobs` raises naming every failure (each job's own log —
a run's train.log — says why).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from squad.distributed import free_port, prepare_environment
from squad.runtime import environment


@dataclasses.dataclass
class Job:
    """One unit of work for a child process: ``target(**kwargs)``."""

    name: str
    target: Callable[..., object]  # a module-level function (pickled by reference)
    kwargs: dict
    what: str = ""  # how the progress line describes it when it ends (e.g. "trained 200 steps")



def _die_with_parent() -> None:
    """Asks Linux to end this process when its parent ends (``PR_SET_PDEATHSIG``): an invocation that is killed
    leaves no run training behind. Elsewhere nothing is done."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(target: Callable[..., object], kwargs: dict) -> None:
    """The body of a child process: the rendezvous variables of a one-rank group, quiet consoles (warnings only: a
    run's full log is its train.log; a console handler here keeps the engine from adding its own), the job."""
    _die_with_parent()
    prepare_environment()
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("[squad] %(levelname)s %(message)s"))
    logging.getLogger("squad").addHandler(console)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    target(**kwargs)


def child_environment(slot: int, parallel: int, gpus: int, cores: int | None = None) -> dict[str, str]:
    """The variables process slot ``slot`` of ``parallel`` starts with (see the module docstring)."""
    env = {"MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1")}
    if gpus > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
    if gpus == 0 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (cores or os.cpu_count() or 1) // parallel))
    return env


def run_jobs(jobs: Sequence[Job], parallel: int, say: Callable[[str], None], gpus: int = 0,
             label: Callable[[Job], str] | None = None) -> list[str]:
    """Runs ``jobs`` in at most ``parallel`` processes at once; returns the names in the order they ended.

    Args:
        jobs: the jobs, started in this order.
        parallel: processes at once (>= 1).
        say: a progress printer (one line per job that ends).
        gpus: GPUs on this machine (0: a CPU run).
        label: the progress line's prefix for a job (default: its name).

    Raises:
        ValueError: ``parallel`` below 1.
        RuntimeError: a job's process failed (after the running ones ended), naming each.
    """
    if parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {parallel}")
    mp = multiprocessing.get_context("spawn")
    pending = list(jobs)
    free = list(range(parallel))
    running: dict[int, tuple[Job, multiprocessing.Process, int, float]] = {}
    ended: list[str] = []
    failed: list[str] = []
    try:
        _schedule(pending, free, running, ended, failed, mp, parallel, gpus, say, label)
    finally:  # an interruption (or an error here) ends the children still running
        for _, proc, _, _ in running.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
    if failed:
        raise RuntimeError(f"{len(failed)} parallel job(s) failed: {', '.join(failed)}; see each run's train.log "
                           f"(or the error printed above)")
    return ended


def _schedule(pending: list[Job], free: list[int], running: dict, ended: list[str], failed: list[str], mp,
              parallel: int, gpus: int, say: Callable[[str], None], label: Callable[[Job], str] | None) -> None:
    """`run_jobs`'s loop: start jobs into free slots, wait for one to end, report it."""
    while pending or running:
        while pending and free and not failed:
            job, slot = pending.pop(0), free.pop(0)
            with environment(child_environment(slot, parallel, gpus)):
                proc = mp.Process(target=_child, args=(job.target, job.kwargs), name=f"reproduce-{job.name}")
                proc.start()
            running[proc.sentinel] = (job, proc, slot, time.perf_counter())
        if not running:
            break
        for sentinel in wait(list(running)):
            job, proc, slot, t0 = running.pop(sentinel)
            proc.join()
            free.append(slot)
            prefix = label(job) if label else job.name
            if proc.exitcode != 0:
                failed.append(f"{job.name} (exit code {proc.exitcode})")
                say(f"{prefix}: FAILED (exit code {proc.exitcode})")
                continue
            ended.append(job.name)
            seconds = time.perf_counter() - t0
            say(f"{prefix}: {job.what or 'done'} in {seconds:.0f} s (in a process of its own, {parallel} at once)")
