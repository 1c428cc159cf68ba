"""Small timing harness for `tools/bench.py`: cases measured side by side in one run, reported as ratios.

Machines here are noisy, so a case never compares against a stored number: it times the candidate and its baseline
interleaved (A, B, A, B, ...) in the same process and reports the ratio of medians. Each case is a function that
returns one or more `BenchResult` rows; `tools/bench.py` collects them into a table and a JSON file.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class BenchResult:
    """One row of the performance table.

    Attributes:
        case: short name of the case, e.g. ``"moe_mlp_vs_dense"``.
        value: the measured figure (usually a ratio of median times).
        target: the contract, as text (``"<= 1.15"``), or ``""`` for informational rows.
        unit: what ``value`` is (``"x time"``, ``"x faster"``, ``"img/s"``...).
        ok: whether ``value`` meets ``target`` (``None`` for informational rows).
        details: extra figures (absolute times, shapes) kept in the JSON.
    """

    case: str
    value: float
    target: str = ""
    unit: str = ""
    ok: bool | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def check(value: float, target: str) -> bool | None:
    """Evaluates a target such as ``"<= 1.15"`` or ``">= 3"`` against ``value``."""
    if not target:
        return None
    op, num = target.split()
    bound = float(num)
    if op == "<=":
        return value <= bound
    if op == ">=":
        return value >= bound
    raise ValueError(f"target must look like '<= 1.15' or '>= 3', got {target!r}")


def time_interleaved(fns: Sequence[Callable[[], Any]], repeats: int = 10, warmup: int = 2,
                     device: str | torch.device | None = None) -> list[float]:
    """Times several callables interleaved and returns the median seconds of each.

    Args:
        fns: the callables; each runs one full measured unit (e.g. forward + backward).
        repeats: timed rounds; in each round every callable runs once, in order.
        warmup: untimed rounds first (allocator, caches, lazy init).
        device: a CUDA device times each call with CUDA events on its current stream (the device's own timeline,
            no synchronisation between calls; launch gaps a slow host leaves count); otherwise wall-clock time.

    Returns:
        Median seconds per callable, in the order given.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        events = [[] for _ in fns]
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[i].append((start, end))
        torch.cuda.synchronize(device)
        return [statistics.median(a.elapsed_time(b) / 1000 for a, b in pairs) for pairs in events]
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            samples[i].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def ratio_row(case: str, t_candidate: float, t_baseline: float, target: str, faster: bool = False,
              **details: Any) -> BenchResult:
    """Builds a row from two median times.

    Args:
        case: the case name.
        t_candidate: median seconds of the thing under test.
        t_baseline: median seconds of its baseline.
        target: the contract (``"<= 1.15"`` on a time ratio, ``">= 1.6"`` on a speed-up).
        faster: report ``baseline / candidate`` (a speed-up) instead of ``candidate / baseline``.
        **details: extra figures for the JSON.
    """
    value = t_baseline / t_candidate if faster else t_candidate / t_baseline
    unit = "x faster" if faster else "x time"
    details = {"candidate_s": t_candidate, "baseline_s": t_baseline, **details}
    return BenchResult(case, value, target, unit, check(value, target), details)
