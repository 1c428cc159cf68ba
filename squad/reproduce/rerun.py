"""A run of a report trained again here, and checked against the report's stated tolerance.

``python tools/reproduce.py CLAIM --scale S --out OUT --rerun RUN --against REPORT/results.json`` trains ``RUN`` of
the plan again on this machine (its own config and seed, this machine's threads; the data rendered into OUT as the
report's was) into ``OUT/rerun/RUN``, and compares each task's final validation metric with the value the report
recorded for that run (``results.json``'s ``run_metrics``) as a relative change in percent, oriented as Δt (> 0:
better here). The report's tolerance for one run is the largest such change its own thread-count reruns showed
(``tolerance.metric_change.max``, `squad.reproduce.tolerance`): a rerun is *inside* when every task the report
recorded has a change no larger. A task the rerun lacks, or whose change is undefined (a recorded metric of 0 that
the rerun does not equal), is not inside. The outcome goes to ``OUT/rerun/RUN/check.json``, and the command exits 1
when a run lands outside.

The report is read and checked before anything is rendered or trained (`load_report`): it must be a results.json
with per-run metrics and a measured tolerance, of the scale and steps this invocation plans, holding the runs asked
for. A finished rerun is reused only when it was trained with the settings this invocation plans.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from squad.reproduce.report import read_results
from squad.reproduce.runs import RunSpec, final_metrics, is_done, settings_of, train_run
from squad.reproduce.scales import Scale
from squad.reproduce.specs import Context
from squad.reproduce.tolerance import threads_in_use
from squad.reproduce.verdicts import delta
from squad.tasks import get_task


def run_metrics(ctx: Context, specs: Sequence[RunSpec]) -> dict[str, dict]:
    """Each finished run's final validation metrics by run name (what a rerun is compared with)."""
    return {s.name: final_metrics(ctx.runner.path(s)) for s in specs if is_done(ctx.runner.path(s))}


def load_report(against: str | Path, scale: Scale, names: Sequence[str]) -> tuple[dict[str, dict], float]:
    """The recorded metrics of ``names`` and the per-run tolerance (percent) of the report ``against``, checked
    against the invocation's ``scale`` (its name and steps).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a results.json, one written before per-run metrics were kept, one with no measured tolerance,
            one of another scale or budget, or one that records none of a run asked for (each names the file).
    """
    against = Path(against)
    results = read_results(against, "--against")
    recorded = results.get("run_metrics")
    if not isinstance(recorded, dict) or not recorded:
        raise ValueError(f"--against {against} records no per-run metrics (a report written before they were kept): "
                         "make it again with its own command (finished runs are reused) before checking a rerun "
                         "against it")
    tolerance = results.get("tolerance")
    change = tolerance.get("metric_change") if isinstance(tolerance, dict) else None
    tol = change.get("max") if isinstance(change, dict) else None
    if not isinstance(tol, int | float) or isinstance(tol, bool) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"--against {against} states no cross-machine tolerance (tolerance.metric_change.max: "
                         f"{tol!r}; modsquad-table2 at a scale that reruns a sample, such as cpu, measures it)")
    steps = (results.get("scale_settings") or {}).get("steps")
    if results.get("scale") != scale.name or steps != scale.steps:
        raise ValueError(f"--against {against} is a report of scale {results.get('scale')} at {steps} steps; this "
                         f"invocation plans scale {scale.name} at {scale.steps} steps (give the report's --scale and "
                         "--steps)")
    missing = [n for n in names if n not in recorded]
    if missing:
        raise ValueError(f"--rerun {', '.join(missing)}: {against} records no metrics for it; it records "
                         f"{', '.join(sorted(recorded))}")
    return {n: recorded[n] for n in names}, float(tol)


def _change(task: str, report: dict | None, again: dict | None) -> float | None:
    """The relative change of ``task``'s primary metric, rerun against report (percent, oriented as Δt); 0 for the
    same value; None when the rerun lacks the task or the change is undefined (a recorded 0)."""
    if not report or not again:
        return None
    primary = get_task(task).primary_metric
    if report.get(primary) == again.get(primary):
        return 0.0
    value = delta({task: again}, {task: report})["per_task"].get(task, float("nan"))
    return value if math.isfinite(value) else None


def _reuse(ctx: Context, spec: RunSpec, run_dir: Path) -> bool:
    """Whether a finished rerun in ``run_dir`` can stand: trained for this spec's steps and settings, else refused."""
    if not is_done(run_dir):
        return False
    file = run_dir / "reproduce.json"
    done = json.loads(file.read_text()) if file.is_file() else {}
    planned = settings_of(ctx.runner.config(spec), ctx.out)
    if done.get("steps") != spec.steps or done.get("settings") != planned:
        raise ValueError(f"{run_dir} was trained with other settings than this invocation plans (steps "
                         f"{done.get('steps')} against {spec.steps}): use another --out")
    return True


def check_reruns(ctx: Context, specs: Sequence[RunSpec], names: Sequence[str], recorded: dict[str, dict],
                 tolerance: float, say: Callable[[str], None]) -> list[dict]:
    """Trains each of ``names`` again into ``OUT/rerun/NAME`` (a finished rerun of the same settings is reused) and
    compares it with the report's ``recorded`` metrics (`load_report`); returns one dict per run: ``{"run",
    "threads", "tolerance", "tasks": {task: {"report", "rerun", "change"}}, "undefined", "largest", "inside"}`` (also
    written to the rerun's ``check.json``).

    Raises:
        ValueError: a name not in this invocation's plan (listing the plan's runs), or a rerun folder trained with
            other settings.
    """
    by_name = {s.name: s for s in specs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"--rerun {', '.join(unknown)}: not a run of these claims at scale {ctx.scale.name}; its "
                         f"runs: {', '.join(sorted(by_name))}")
    checks = []
    for name in names:
        spec = by_name[name]
        run_dir = ctx.out / "rerun" / name
        threads = threads_in_use()
        if not _reuse(ctx, spec, run_dir):
            cfg = ctx.runner.config(spec)
            init = spec.init()[1] if spec.init is not None else None  # trains the run it starts from, if need be
            say(f"rerun {name}: training {spec.steps} steps with {threads} thread{'s' if threads != 1 else ''} "
                f"into {run_dir}")
            train_run(cfg, str(run_dir), init, {**ctx.runner.record(spec, cfg), "threads": threads})
        again, report = final_metrics(run_dir), recorded[name]
        tasks = {t: {"report": report[t], "rerun": again.get(t), "change": _change(t, report[t], again.get(t))}
                 for t in report}
        undefined = [t for t, v in tasks.items() if v["change"] is None]
        largest = max((abs(v["change"]) for v in tasks.values() if v["change"] is not None), default=0.0)
        check = {"run": name, "threads": threads, "tolerance": tolerance, "tasks": tasks, "undefined": undefined,
                 "largest": largest, "inside": bool(tasks) and not undefined and largest <= tolerance}
        (run_dir / "check.json").write_text(json.dumps(check, indent=1, default=str) + "\n")
        for t, v in tasks.items():
            say(f"rerun {name}: {t} " + (f"{v['change']:+.2f} % against the report" if v["change"] is not None else
                                         f"not comparable (report {report[t]}, rerun {again.get(t)})"))
        why = f"; not comparable: {', '.join(undefined)}" if undefined else ""
        say(f"rerun {name}: largest change {largest:.2f} % against the report's tolerance of {tolerance:.2f} %{why}: "
            f"{'inside' if check['inside'] else 'OUTSIDE'}")
        checks.append(check)
    return checks
