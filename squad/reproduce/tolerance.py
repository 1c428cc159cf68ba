"""The cross-machine tolerance of a report: how far the same runs land when only the arithmetic's order changes.

A run is deterministic on one machine with one thread count, but another CPU, BLAS or thread count sums in another
order, and training amplifies the last bits (a rerun of ``stl-class_scene-s0`` on another machine gave 93.2 %
against the report's 92.2 %). A difference between methods smaller than that is no finding. So the report reruns a
sample of its runs (`tolerance_specs`: every single-task model and the multi-task families of Δt, on the first
seed) under another thread count (``OMP_NUM_THREADS``, each in a process of its own) into
``OUT/tolerance/threads<N>/``, and measures:

* per run and task, the relative change of the primary metric (percent, oriented as Δt: > 0 is better);
* per multi-task family, the change of its Δt against STL when every run of it is the rerun one;

and states ``{"Δt": the largest |change of Δt|, ...}``: the tolerance of every comparison in Δt points
(`squad.reproduce.verdicts.judge`), so that a part whose mean difference is no larger is *within tolerance*.
Reruns are resumable like every run (a finished one is skipped).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from squad.reproduce.parallel import Job, run_jobs
from squad.reproduce.runs import final_metrics, is_done, train_run
from squad.reproduce.specs import Context, cached, method_spec, stl_specs
from squad.reproduce.verdicts import delta, finite
from squad.runtime import cpu_threads_per_rank

TOLERANCE_FAMILIES = ("mtl", "modsquad")  # the multi-task families whose Δt the sample reruns


def tolerance_specs(ctx: Context) -> list:
    """The runs the tolerance reruns: the first seed's single-task models and `TOLERANCE_FAMILIES`."""
    seed = ctx.seeds[0]
    return [*stl_specs(ctx, seed), *(method_spec(ctx, f, seed) for f in TOLERANCE_FAMILIES)]


def threads_in_use() -> int:
    """The intra-op threads this process's runs train with (`squad.runtime.cpu_threads_per_rank`, else torch's)."""
    import torch

    return cpu_threads_per_rank() or torch.get_num_threads()


def other_threads(wanted: int, used: int | None = None) -> int:
    """A thread count other than the one the runs used: ``wanted``, unless that is the same (then 1, or 2 when the
    runs used 1) — a rerun with the same count sums in the same order and measures nothing."""
    used = threads_in_use() if used is None else used
    if wanted != used:
        return wanted
    return 1 if used != 1 else 2


def rerun_dir(ctx: Context, threads: int) -> Path:
    return ctx.out / "tolerance" / f"threads{threads}"


def train_with_threads(threads: int, **kwargs) -> None:
    """`train_run` with ``threads`` intra-op threads (the body of a rerun's process)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    train_run(**kwargs)


def rerun(ctx: Context, threads: int, say: Callable[[str], None]) -> list[Path]:
    """Trains the sample again with ``threads`` threads (finished reruns skipped); returns the rerun folders."""
    where = rerun_dir(ctx, threads)
    jobs, dirs = [], []
    for spec in tolerance_specs(ctx):
        ctx.runner.ensure(spec)
        run_dir = where / spec.name
        dirs.append(run_dir)
        if is_done(run_dir):
            continue
        cfg = ctx.runner.config(spec)
        jobs.append(Job(f"{spec.name}@{threads}t", train_with_threads,
                        {"threads": threads, "cfg": cfg, "run_dir": str(run_dir), "init_state": None,
                         "record": {**ctx.runner.record(spec, cfg), "threads": threads}},
                        what=f"retrained {spec.steps} steps with {threads} threads"))
    if jobs:
        say(f"tolerance: {len(jobs)} runs again with {threads} threads")
        run_jobs(jobs, 1, say)
    return dirs


def spread(original: dict[str, Path], again: dict[str, Path], tasks: Sequence[str],
           families: Sequence[str] = TOLERANCE_FAMILIES) -> dict:
    """The tolerance from run folders by run name (``original`` and ``again``: the same runs, another thread count).

    Returns ``{"per_run": {run: {task: relative change %}}, "dt": {family: {"original", "again", "change"}},
    "tolerance": {"Δt": largest |change of Δt|}}``.
    """
    per_run = {}
    for name, run in original.items():
        if name in again and is_done(again[name]):
            a, b = final_metrics(run), final_metrics(again[name])
            per_run[name] = delta({t: b[t] for t in b if t in a}, a)["per_task"]

    def stl(runs: dict[str, Path]) -> dict:
        return {t: final_metrics(runs[f"stl-{t}-s{_seed(original)}"])[t] for t in tasks}

    dts = {}
    for f in families:
        name = next((n for n in original if n.startswith(f"{f.replace('_', '-')}-s")), None)
        if name is None or name not in again or not is_done(again[name]):
            continue
        before = delta(final_metrics(original[name]), stl(original), tasks)["mean"]
        after = delta(final_metrics(again[name]), stl(again), tasks)["mean"]
        dts[f] = {"original": before, "again": after, "change": after - before}
    changes = finite(abs(v["change"]) for v in dts.values())
    metric = finite(abs(v) for r in per_run.values() for v in r.values())
    return {"per_run": per_run, "dt": dts,
            "metric_change": {"max": max(metric) if metric else float("nan"),
                              "mean": statistics.fmean(metric) if metric else float("nan")},
            "tolerance": {"Δt": max(changes)} if changes else {}}


def _seed(runs: dict[str, Path]) -> int:
    return int(next(iter(runs)).rsplit("-s", 1)[1])


def measure_tolerance(ctx: Context, threads: int, say: Callable[[str], None], tasks: Sequence[str]) -> dict:
    """Reruns the sample with ``threads`` threads (`other_threads`: never the count the runs used) and measures the
    spread (cached in ``OUT/cache``)."""
    used = threads_in_use()
    threads = other_threads(threads, used)
    specs = tolerance_specs(ctx)
    dirs = rerun(ctx, threads, say)
    original = {s.name: ctx.runner.path(s) for s in specs}
    again = {s.name: d for s, d in zip(specs, dirs, strict=True)}
    key = {"runs": [ctx.run_settings(s) for s in specs], "threads": threads, "tasks": list(tasks)}
    out = cached(ctx.cache_file(f"tolerance-threads{threads}.json"), key,
                 lambda: spread(original, again, tasks))
    return {**out, "threads": threads, "threads_used": used, "runs": [s.name for s in specs]}


def tolerance_line(t: dict) -> str:
    """The report's sentence on the tolerance."""
    runs = ", ".join(t.get("runs", []))
    dts = "; ".join(f"{f} {v['original']:+.2f} → {v['again']:+.2f}" for f, v in t.get("dt", {}).items())
    tol = t.get("tolerance", {}).get("Δt")
    mc = t.get("metric_change", {})
    return (f"Cross-machine tolerance: the runs {runs} trained again with {t.get('threads')} threads instead of "
            f"{t.get('threads_used', '?')} (another summation order, as another machine gives) move each task's "
            f"metric by up to {mc.get('max', 0):.2f} % "
            f"(mean {mc.get('mean', 0):.2f} %) and Δt by {dts}: a tolerance of {tol:.2f} Δt points. A part whose "
            "mean difference is no larger is **within tolerance** (no finding)." if tol is not None else
            "Cross-machine tolerance: not measured (no rerun finished).")


def with_tolerance(ctx: Context, tolerance: dict | None) -> Context:
    """``ctx`` with the tolerance's units set for the claims' comparisons."""
    return dataclasses.replace(ctx, tolerance=(tolerance or {}).get("tolerance") or None)
