"""Process-wide CPU settings for entry points (training, the bench): thread counts and malloc.

Nothing here runs on import. The entry points also set ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported
(importing squad imports torch, so that line lives in the tools themselves): with libgomp's default spinning, a core
shared with another process (a second rank, a data-loader worker) stalls every parallel region, which on small CPU
machines costs more than the spinning saves.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator

_MALLOC_TUNED = False

SINGLE_THREADED = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
"""Environment for worker processes that are the parallelism themselves (a pool of renderers, parallel runs on a
CPU): one BLAS/OpenMP thread each; idle BLAS threads spinning on 2 cores cost more than the small matmuls gain."""


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block (for the processes started there), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch_rank() -> int | None:
    """This process's global rank as its launcher set it (deepspeed, torchrun, MPI), readable before any process
    group exists; None when no launcher variable says (a plain ``python`` run)."""
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (someone else's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def launch_world() -> int | None:
    """The number of ranks the launcher started (deepspeed, torchrun, MPI), readable before any process group
    exists; None when no launcher variable says."""
    for key in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def cpu_threads_per_rank() -> int | None:
    """Intra-op threads for one of this node's ranks on a CPU-only run: cores / local ranks (None = leave as is).

    The deepspeed launcher (without ``--bind_cores_to_rank``) and torchrun start every rank with all cores' worth of
    threads; several ranks then oversubscribe the machine. An explicit ``OMP_NUM_THREADS`` wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None
    local = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    try:
        ranks = max(1, int(local))
    except ValueError:
        return None
    return max(1, (os.cpu_count() or 1) // ranks)


def tune_cpu_allocator() -> bool:
    """Keeps freed multi-MB tensors in the process (glibc ``mallopt``) instead of returning them to the kernel.

    PyTorch's CPU allocator gets every tensor from malloc, and glibc serves large blocks with fresh ``mmap``s (or
    trims the heap after a free), so each new activation-sized tensor is faulted in page by page again — on small
    VMs that costs up to ~0.4 ms per MB, more than the arithmetic of many ops. Raising the mmap and trim thresholds
    makes malloc reuse freed blocks, which is what jemalloc/tcmalloc (the usual advice for PyTorch on CPUs) do by
    default. Process-wide; meant for entry points (the bench, training), never called on import.

    Returns:
        True when the thresholds were set (Linux with glibc), False otherwise.
    """
    global _MALLOC_TUNED
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    ok = all(libc.mallopt(param, value) == 1 for param, value in
             ((m_mmap_threshold, 1 << 30), (m_trim_threshold, 1 << 30), (m_top_pad, 64 << 20)))
    _MALLOC_TUNED = _MALLOC_TUNED or ok
    return ok


def malloc_tuned() -> bool:
    return _MALLOC_TUNED


_INTERRUPTED = False


def _on_sigint(signum: int, frame: object) -> None:
    global _INTERRUPTED
    _INTERRUPTED = True
    raise KeyboardInterrupt


def watch_interrupts() -> None:
    """Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` as usual and is remembered (`interrupted`), so a tool can tell an
    error that follows from it — a collective call whose peer rank left on the same Ctrl-C — from a real one. Call
    from the main thread of an entry point (`squad.cli.run`)."""
    import signal
    import threading

    # a process started with SIGINT ignored (a background job of a shell script) keeps ignoring it, as Python does
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
            signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """Whether this process got Ctrl-C (SIGINT) since `watch_interrupts`."""
    return _INTERRUPTED
