"""Rendering jobs in this process or in spawned ones: the synthetic datasets' one pool.

A spawned worker imports numpy, SciPy and squad's renderer before its first job (~2–3 s of CPU each), so a small
render is faster in this process: `default_workers` takes one process below `SMALL_RENDER` pixels in all (64 images
of 64 px), else up to 2. The bytes written are the same whatever the number of processes (each job seeds itself).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from squad.runtime import SINGLE_THREADED, environment

SMALL_RENDER = 64 * 64 * 64
"""Pixels (images × side²) below which a render runs in this process: less work than two workers' start-up."""


def default_workers(images: int, image_size: int) -> int:
    """Processes for rendering ``images`` images of ``image_size`` px when the caller names none: 1 for a small
    render (`SMALL_RENDER`), else up to 2 CPUs."""
    if images * image_size * image_size < SMALL_RENDER:
        return 1
    return min(2, os.cpu_count() or 1)


def run_jobs(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int) -> list[Any]:
    """``fn`` over ``jobs`` in order, in ``workers`` spawned processes (1: in this process), each single-threaded."""
    if workers > 1 and len(jobs) > 1:
        with environment(SINGLE_THREADED), ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            return list(pool.map(fn, jobs, chunksize=max(1, len(jobs) // (8 * workers))))
    return [fn(job) for job in jobs]
