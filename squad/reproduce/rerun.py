"""A run of a report trained again here, and checked against the report's stated tolerance.

``python tools/reproduce.py CLAIM --scale S --out OUT --rerun RUN --against REPORT/results.json`` trains ``RUN`` of
the plan again on this machine (its own config and seed, this machine's threads; the data rendered into OUT as the
report's was) into ``OUT/rerun/RUN``, and compares each task's final validation metric with the value the report
recorded for that run (``results.json``'s ``run_metrics``) as a relative change in percent, oriented as Δt (> 0:
better here). The report's tolerance for one run is the largest such change its own thread-count reruns showed
(``tolerance.metric_change.max``, `squad.reproduce.tolerance`): a rerun is *inside* when every task's change is no
larger. The outcome goes to ``OUT/rerun/RUN/check.json``, and the command exits 1 when a run lands outside.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from squad.reproduce.runs import RunSpec, final_metrics, is_done, train_run
from squad.reproduce.specs import Context
from squad.reproduce.tolerance import threads_in_use
from squad.reproduce.verdicts import delta


def run_metrics(ctx: Context, specs: Sequence[RunSpec]) -> dict[str, dict]:
    """Each finished run's final validation metrics by run name (what a rerun is compared with)."""
    return {s.name: final_metrics(ctx.runner.path(s)) for s in specs if is_done(ctx.runner.path(s))}


def stated_tolerance(results: dict, source: str) -> tuple[dict[str, dict], float]:
    """The recorded per-run metrics and the per-run tolerance (percent) of a loaded ``results.json``.

    Raises:
        ValueError: the report records no per-run metrics or no measured tolerance (names ``source``).
    """
    recorded = results.get("run_metrics")
    if not recorded:
        raise ValueError(f"{source} records no per-run metrics (a report written before they were kept): make it "
                         "again with its own command (finished runs are reused) before checking a rerun against it")
    tol = ((results.get("tolerance") or {}).get("metric_change") or {}).get("max")
    if tol is None or not math.isfinite(tol):
        raise ValueError(f"{source} states no cross-machine tolerance (its thread-count reruns did not run: "
                         "modsquad-table2 at a scale with tolerance_threads measures it)")
    return recorded, float(tol)


def check_reruns(ctx: Context, specs: Sequence[RunSpec], names: Sequence[str], against: Path,
                 say: Callable[[str], None]) -> list[dict]:
    """Trains each of ``names`` again into ``OUT/rerun/NAME`` (a finished rerun is reused) and compares it with the
    report ``against``; returns one dict per run: ``{"run", "threads", "tolerance", "tasks": {task: {"report",
    "rerun", "change"}}, "largest", "inside"}`` (also written to the rerun's ``check.json``).

    Raises:
        ValueError: a name not in this invocation's plan (listing the plan's runs), or a report that cannot be
            checked against (`stated_tolerance`).
        FileNotFoundError: ``against`` is missing.
    """
    against = Path(against)
    if not against.is_file():
        raise FileNotFoundError(f"--against {against}: no such results.json (the report to check the rerun against)")
    recorded, tol = stated_tolerance(json.loads(against.read_text()), str(against))
    by_name = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"--rerun {', '.join(unknown)}: not a run of these claims at scale {ctx.scale.name}; its "
                         f"runs: {', '.join(sorted(by_name))}")
    missing = [n for n in names if n not in recorded]
    if missing:
        raise ValueError(f"--rerun {', '.join(missing)}: {against} records no metrics for it")
    checks = []
    for name in names:
        spec = by_name[name]
        run_dir = ctx.out / "rerun" / name
        threads = threads_in_use()
        if not is_done(run_dir):
            cfg = ctx.runner.config(spec)
            init = spec.init()[1] if spec.init is not None else None  # trains the run it starts from, if need be
            say(f"rerun {name}: training {spec.steps} steps with {threads} threads into {run_dir}")
            train_run(cfg, str(run_dir), init, {**ctx.runner.record(spec, cfg), "threads": threads})
        again, report = final_metrics(run_dir), recorded[name]
        change = delta({t: again[t] for t in again if t in report}, report)["per_task"]
        tasks = {t: {"report": report[t], "rerun": again[t], "change": change[t]} for t in change}
        largest = max((abs(c) for c in change.values() if math.isfinite(c)), default=0.0)
        check = {"run": name, "threads": threads, "tolerance": tol, "tasks": tasks, "largest": largest,
                 "inside": largest <= tol}
        (run_dir / "check.json").write_text(json.dumps(check, indent=1, default=str) + "\n")
        for t, c in change.items():
            say(f"rerun {name}: {t} {c:+.2f} % against the report")
        say(f"rerun {name}: largest change {largest:.2f} % against the report's tolerance of {tol:.2f} %: "
            f"{'inside' if check['inside'] else 'OUTSIDE'}")
        checks.append(check)
    return checks
