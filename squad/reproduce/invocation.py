"""One invocation of tools/reproduce.py: the data (rendered and packed unless given), the runs every chosen claim
needs (trained unless done), the claims measured, and the report written (`reproduce`).

`squad.cli.reproduce` parses the command line and calls `reproduce`; everything it does is here, importable and
tested.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from squad.data.offline.pack import pack_shards
from squad.data.synthetic.pascal import render_pascal
from squad.data.synthetic.taskonomy import render_dataset
from squad.reproduce.claims import CLAIMS, resolve_claims
from squad.reproduce.paper import write_paper_plan
from squad.reproduce.parallel import run_jobs
from squad.reproduce.report import write_report
from squad.reproduce.rerun import check_reruns, load_report, run_metrics
from squad.reproduce.runs import Runner, RunSpec, is_done
from squad.reproduce.scales import (
    GPU_PARALLEL,
    GPU_TABLE2_MINUTES,
    Planned,
    Scale,
    estimate_seconds,
    format_duration,
    get_scale,
    pascal_scale,
    render_seconds,
)
from squad.reproduce.specs import Context
from squad.reproduce.tolerance import measure_tolerance, tolerance_specs, with_tolerance


def say_to(stream=None) -> Callable[[str], None]:
    """A progress printer: ``[reproduce] text`` lines on ``stream`` (default stdout), flushed."""

    def say(text: str) -> None:
        print(f"[reproduce] {text}", file=stream or sys.stdout, flush=True)

    return say


def planned(ctx: Context, spec: RunSpec) -> Planned:
    """A run as the time plan sees it (family, steps, tasks trained, depth, cost signature)."""
    model = (spec.base or spec).model
    depth = model.get("depth", (spec.scale or ctx.scale).depth)
    fam = spec.family
    return Planned(fam, spec.steps, len(spec.train_tasks or spec.tasks), depth, ctx.cost_key(spec))


def plan_table(scale: str | Scale, claims: Sequence[str] = ("all",), parallel: int = 1, device: str = "cuda",
               seeds: int | None = None, gpus: int = 1, cores: int = 16) -> dict[str, float]:
    """Every claim's planned seconds when it runs alone into an empty folder, rendering its data first (nothing
    measured: the constants of `squad.reproduce.scales`), e.g. the gpu scale's plan on one H100 with
    ``--parallel 10``."""
    scale = get_scale(scale) if isinstance(scale, str) else scale
    out = Path("/nonexistent/plan")
    seeds_ = list(range(seeds or scale.seeds))
    ctx = Context(scale, seeds_, out / "data", out, Runner(out, scale, out / "data"), device,
                  pascal=pascal_scale(scale), pascal_data=out / "pascal", parallel=parallel)
    table = {}
    for name in resolve_claims(claims):
        specs = list({s.name: s for s in CLAIMS[name].specs(ctx)}.values())
        plan = [Planned(s.family, s.steps, len(s.train_tasks or s.tasks),
                        (s.base or s).model.get("depth", (s.scale or scale).depth)) for s in specs]
        table[name] = estimate_seconds(plan, {}, scale, [name], len(seeds_), parallel, device, gpus, cores) + \
            (0.0 if name == "pascal-table3" else render_seconds(scale, cores))
    return table


def plan_invocation(scale: str | Scale, claims: Sequence[str] = ("all",), parallel: int = 1, device: str = "cuda",
                    seeds: int | None = None, gpus: int = 1, cores: int = 16) -> float:
    """The planned seconds of one invocation of ``claims`` into an empty folder: the data rendered once, every run
    they share trained once, each claim's own work (nothing measured: the constants of `squad.reproduce.scales`)."""
    scale = get_scale(scale) if isinstance(scale, str) else scale
    out = Path("/nonexistent/plan")
    seeds_ = list(range(seeds or scale.seeds))
    ctx = Context(scale, seeds_, out / "data", out, Runner(out, scale, out / "data"), device,
                  pascal=pascal_scale(scale), pascal_data=out / "pascal", parallel=parallel)
    names = resolve_claims(claims)
    specs = list({s.name: s for n in names for s in CLAIMS[n].specs(ctx)}.values())
    plan = [Planned(s.family, s.steps, len(s.train_tasks or s.tasks),
                    (s.base or s).model.get("depth", (s.scale or scale).depth)) for s in specs]
    render = render_seconds(scale, cores) if any(n != "pascal-table3" for n in names) else 0.0
    return estimate_seconds(plan, {}, scale, names, len(seeds_), parallel, device, gpus, cores) + render


def dry_run(claims: Sequence[str], scale: str = "small", out: str | Path = "reports/small", *,
            seeds: int | None = None, steps: int | None = None, parallel: int = 1,
            say: Callable[[str], None] | None = None) -> dict:
    """The plan of an invocation without running anything: every run it needs (those finished in ``out`` already
    marked), the tolerance reruns, and the planned CPU time of what is left on one core (`estimate_seconds`'s
    constants: nothing is measured), per claim and in all. Prints it with ``say``; returns it as data."""
    say = say or say_to()
    names = resolve_claims(claims)
    sc = get_scale(scale)
    if steps is not None:
        sc = dataclasses.replace(sc, steps=steps)
    seeds_ = list(range(seeds or sc.seeds))
    out = Path(out)
    ctx = Context(sc, seeds_, out / "data" / "shards", out, Runner(out, sc, out / "data" / "shards"), "cpu",
                  pascal=pascal_scale(sc, steps), pascal_data=out / "data" / "pascal_shards", parallel=parallel)

    def plan_of(specs: Sequence[RunSpec]) -> list[Planned]:
        return [Planned(s.family, s.steps, len(s.train_tasks or s.tasks),
                        (s.base or s).model.get("depth", (s.scale or sc).depth)) for s in specs]

    specs = list({s.name: s for n in names for s in CLAIMS[n].specs(ctx)}.values())
    todo = [s for s in specs if not is_done(ctx.runner.path(s))]
    refused = []  # finished runs trained with other settings: the real command refuses them
    for s in specs:
        if s not in todo:
            try:
                ctx.runner.check_done(s)
            except ValueError as e:
                refused.append(str(e))
    reruns = tolerance_specs(ctx) if sc.tolerance_threads and "modsquad-table2" in names else []
    left = [s for s in reruns if not is_done(out / "tolerance" / f"threads{sc.tolerance_threads}" / s.name)]
    per_claim = {}
    for n in names:
        mine = [s for s in CLAIMS[n].specs(ctx) if s.name in {t.name for t in todo}]
        per_claim[n] = {"runs": len({s.name for s in CLAIMS[n].specs(ctx)}), "to_train": len({s.name for s in mine}),
                        "seconds": estimate_seconds(plan_of(list({s.name: s for s in mine}.values())), {}, sc, [n],
                                                    len(seeds_), parallel, "cpu", 1, 1)}
    total = estimate_seconds(plan_of(todo + left), {}, sc, names, len(seeds_), parallel, "cpu", 1, 1)
    render = render_seconds(sc, 1) if not (out / "data" / "shards").is_dir() and names != ["pascal-table3"] else 0.0
    plan = {"scale": sc.name, "seeds": seeds_, "claims": per_claim, "runs": len(specs), "done": len(specs) - len(todo),
            "refused": refused,
            "tolerance_runs": len(reruns), "tolerance_left": len(left), "render_seconds": render,
            "seconds": total + render}
    say(f"plan (nothing runs): {len(names)} claim(s) at scale {sc.name}, seeds {seeds_}: {len(specs)} runs, "
        f"{plan['done']} done already in {out}")
    for n, c in per_claim.items():
        say(f"  {n}: {c['runs']} runs, {c['to_train']} to train, ~{format_duration(c['seconds'])} on one core "
            "(with its evaluations)")
        say(f"    runs: {', '.join(sorted({s.name for s in CLAIMS[n].specs(ctx)}))}")
    if reruns:
        say(f"  tolerance: {len(reruns)} runs again with {sc.tolerance_threads} threads, {len(left)} to train")
    for message in refused[:3]:
        say(f"  refused: {message}")
    if len(refused) > 3:
        say(f"  refused: {len(refused) - 3} more runs of {out} trained with other settings")
    if sc.paper:
        say(f"planned: ~{format_duration(plan['seconds'])} of one core at the paper's size (the constants of "
            "squad.reproduce.scales, not measured); the same command without --dry-run writes the configs and "
            "deepspeed commands and trains nothing")
        return plan
    say(f"budget left: ~{format_duration(plan['seconds'])} of one core (runs shared by claims counted once"
        f"{', rendering the data' if render else ''}; planned from the constants of squad.reproduce.scales, not "
        "measured); " + ("the same command without --dry-run refuses the runs above: use another --out"
                         if refused else "the same command without --dry-run runs it and resumes from the runs "
                         "already done"))
    return plan


def reproduce(claims: Sequence[str], scale: str = "small", out: str | Path = "reports/small", *,
              seeds: int | None = None, steps: int | None = None, data: str | Path | None = None,
              pascal: str | Path | None = None, hostfile: str = "hostfile", command: str = "", parallel: int = 1,
              report_dir: str | Path | None = None, say: Callable[[str], None] | None = None,
              rerun: Sequence[str] = (), against: str | Path | None = None) -> Path:
    """Measures ``claims`` at ``scale`` into ``out`` and writes the report; returns its path.

    Args:
        claims: claim names (`squad.reproduce.claims.CLAIMS`) or ``"all"``.
        scale: ``tiny``, ``small``, ``cpu``, ``gpu`` or ``paper`` (paper writes configs and commands and runs
            nothing).
        out: the output folder (report.md, results.json, figures/, runs/, data/).
        seeds: seeds per run (default: the scale's).
        steps: training steps per run instead of the scale's.
        data: a Taskonomy tree or shards (default: the synthetic Taskonomy rendered and packed into ``out/data``).
        pascal: pascal-table3's PASCAL-Context root (default: the synthetic one, rendered likewise).
        hostfile: paper scale: the DeepSpeed hostfile its commands name.
        command: the command line, recorded in the report.
        parallel: runs trained at once, each in a process of its own (one GPU each where there are several); the
            fine-tunes of router-finetune run that way too.
        report_dir: where report.md, results.json and figures/ go (default: ``out``).
        say: where progress lines go (default: stdout).
        rerun: instead of the report, train these runs of the plan again into ``out/rerun`` and check each against
            the report ``against`` (default: ``report_dir/results.json``, else ``out``'s): `squad.reproduce.rerun`.
        against: the results.json a ``rerun`` is checked against.

    Returns:
        ``report_dir/report.md`` (paper scale: the commands file; with ``rerun``: ``out/rerun/checks.json``, a list
        of `squad.reproduce.rerun.check_reruns`'s dicts).

    Raises:
        ValueError: an unknown claim (listing them), seeds, steps or parallel below 1, or an ``out`` holding another
            scale.
        FileNotFoundError: ``data`` or ``pascal`` given but missing.
    """
    say = say or say_to()
    claims = resolve_claims(claims)  # an unknown name: ValueError listing the claims
    if seeds is not None and seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {parallel}")
    scale = get_scale(scale)
    if steps is not None:
        scale = dataclasses.replace(scale, steps=steps)
    seeds = list(range(seeds or scale.seeds))
    out = Path(out)
    if scale.paper and rerun:
        raise ValueError("--rerun trains runs again: not at --scale paper, which writes configs and commands only")
    if scale.paper:
        plan = write_paper_plan(claims, out, len(seeds), data, hostfile, pascal)
        say(f"paper scale: {len(plan['configs'])} run configs in {out / 'configs'}, commands in {plan['commands']} "
            f"(nothing was run)")
        return Path(plan["commands"])
    if rerun:  # the report is read and checked before anything is rendered or trained
        rerun = list(dict.fromkeys(rerun))
        checked_against = load_report(Path(against) if against else Path(report_dir or out) / "results.json", scale,
                                      rerun)
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    pscale = pascal_scale(scale, steps)
    previous = previous_results(out, scale, seeds)
    pascal_only = claims == ["pascal-table3"]
    if pascal_only and not data:  # no Taskonomy run: nothing to render
        root, info = out / "data" / "shards", {}
    else:
        root, info = taskonomy_data(data, scale, out, say)
    pdata, pinfo = pascal_data(pascal, pscale, out, say) if "pascal-table3" in claims else (None, {})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cpu" and scale.name == "gpu":
        say("warning: --scale gpu on a machine without a GPU (it will take many hours; --scale cpu is the CPU's)")
    if scale.name == "gpu" and device == "cuda":
        minutes = plan_invocation(scale, claims, max(parallel, 1), device, len(seeds), max(1, gpus),
                                  os.cpu_count() or 1) / 60
        if minutes > GPU_TABLE2_MINUTES:
            say(f"note: planned at {minutes:.0f} min on this machine (MEASURED.md's step times, unmeasured at these "
                f"widths): more than one command of a lent GPU session gives ({GPU_TABLE2_MINUTES:g} min; "
                f"modsquad-table2 alone with --parallel {GPU_PARALLEL} is planned to fit); runs resume, so it can "
                "continue in a later session")
    ctx = Context(scale, seeds, root, out, Runner(out, scale, root), device, pascal=pscale, pascal_data=pdata,
                  parallel=parallel)
    specs = list({s.name: s for c in claims for s in CLAIMS[c].specs(ctx)}.values())
    if rerun:
        checks = check_reruns(ctx, specs, rerun, *checked_against, say)
        path = out / "rerun" / "checks.json"
        path.write_text(json.dumps(checks, indent=1, default=str) + "\n")
        return path
    todo = [s for s in specs if not is_done(ctx.runner.path(s))]
    ctx.runner.total = len(specs)
    say(f"{len(claims)} claim{'s' if len(claims) > 1 else ''} at scale {scale.name}, seeds {seeds}: {len(specs)} runs "
        f"({len(specs) - len(todo)} done already){f', {parallel} at once' if parallel > 1 else ''}")
    for s in specs:  # a finished run trained with other settings is refused before anything trains
        if is_done(ctx.runner.path(s)) and (s.init is None or is_done(ctx.runner.path(s.base or s))):
            ctx.runner.check_done(s)
    if todo:
        measured: dict[str, float] = {}
        for s in todo:  # one step time per cost signature (the cost table re-uses these)
            key = ctx.cost_key(s)
            if key not in measured:
                measured[key] = ctx.cost(s)["step_s"]
        msq = next((v for k, v in measured.items() if k.startswith("modsquad:")), None)
        if msq is not None:
            measured["modsquad"] = msq
        plan = [planned(ctx, s) for s in todo]
        estimate = estimate_seconds(plan, measured, scale, claims, len(seeds), parallel, device, max(1, gpus),
                                    os.cpu_count() or 1)
        per_family = {}
        for s in todo:
            per_family.setdefault(s.family, measured.get(ctx.cost_key(s)))
        say(f"estimated time {format_duration(estimate)}: {len(todo)} runs to train (seconds per step measured just "
            f"now: {', '.join(f'{k} {v:.2f}' for k, v in per_family.items() if v is not None)}) and the claims' "
            f"evaluations")
        if parallel > 1:
            ctx.runner.train_all(todo, parallel, gpus)
        else:  # every run first, seed by seed (a run from another's weights after it), then the claims measure
            for s in sorted(todo, key=lambda s: s.seed):
                ctx.runner.ensure(s)
    if parallel > 1:
        jobs = [j for c in claims if CLAIMS[c].jobs is not None for j in CLAIMS[c].jobs(ctx)]
        if jobs:
            say(f"{len(jobs)} post-training jobs, {parallel} at once")
            run_jobs(jobs, parallel, say, gpus)
    tolerance = None
    if scale.tolerance_threads and device == "cpu" and "modsquad-table2" in claims:
        tolerance = measure_tolerance(ctx, scale.tolerance_threads, say, ctx.tasks)
        ctx = with_tolerance(ctx, tolerance)
        say(f"tolerance: Δt moves by up to {tolerance['tolerance'].get('Δt', float('nan')):.2f} points with "
            f"{tolerance['threads']} thread{'s' if tolerance['threads'] != 1 else ''} instead of "
            f"{tolerance['threads_used']}")
    results = dict(previous)
    for name in claims:
        say(f"claim {name}")
        t_claim = time.perf_counter()
        results[name] = CLAIMS[name].measure(ctx)
        say(f"claim {name} measured in {format_duration(time.perf_counter() - t_claim)} (with the runs it trained)")
    seconds = time.perf_counter() - t0
    cache = out / "cache" / "claims.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"scale": scale.name, "settings": scale_key(scale), "seeds": seeds,
                                 "claims": results}) + "\n")
    meta = {"command": command, "scale": scale, "scale_settings": dataclasses.asdict(scale), "seeds": seeds,
            "data": {"root": str(root), "manifest": info}, "seconds": seconds, "parallel": parallel,
            "device": device, "data_line": data_line(pdata, pinfo) if pascal_only else data_line(root, info),
            "duration": format_duration(seconds),
            "runs": {"total": len(specs), "trained": ctx.runner.trained, "skipped": ctx.runner.skipped},
            "tolerance": tolerance}
    if pdata is not None:
        meta["data"]["pascal"] = {"root": str(pdata), "manifest": pinfo}
        if not pascal_only:
            meta["data_line"] += f"; pascal-table3: {data_line(pdata, pinfo)}"
    meta["run_metrics"] = run_metrics(ctx, specs)
    meta["train_seconds"] = sum(json.loads(f.read_text()).get("train_seconds", 0.0)
                                for f in (out / "runs").glob("*/reproduce.json"))
    report = write_report(Path(report_dir) if report_dir else out, results, meta)
    verdicts = ", ".join(f"{n}: {results[n]['verdict']}" for n in results)
    say(f"report {report} ({verdicts}) in {format_duration(seconds)}")
    return report


def taskonomy_data(data: str | Path | None, scale: Scale, out: Path,
                  say: Callable[[str], None]) -> tuple[Path, dict]:
    """The dataset root: ``data`` (--data), or the synthetic Taskonomy rendered into OUT/data/synthetic and packed
    into HDF5 shards in OUT/data/shards (reads several times faster; both kept between invocations)."""
    if data:
        root = Path(data)
        if not root.exists():
            raise FileNotFoundError(f"--data {root} does not exist (render one with tools/make_data.py synthetic, "
                                    f"or leave --data out to render it into {out / 'data'})")
        manifest = root / "synthetic.json"
        return root, json.loads(manifest.read_text()) if manifest.is_file() else {}
    tree, shards = out / "data" / "synthetic", out / "data" / "shards"
    if not (tree / "synthetic.json").is_file():
        say(f"rendering {scale.images} synthetic images at {scale.img_size} px into {tree} "
            f"(tools/make_data.py synthetic)")
        t0 = time.perf_counter()
        render_dataset(tree, n=scale.images, image_size=scale.img_size, seed=0, buildings=scale.buildings,
                       workers=os.cpu_count() or 1,  # every core (a GPU machine renders its own data in seconds)
                       overwrite=tree.exists())
        say(f"data rendered in {time.perf_counter() - t0:.0f} s")
    if not (shards / "shards.json").is_file():
        t0 = time.perf_counter()
        pack_shards(tree, shards, image_size=scale.img_size, workers=scale.workers)
        say(f"data packed into HDF5 shards in {shards} in {time.perf_counter() - t0:.0f} s (tools/make_data.py pack)")
    return shards, json.loads((tree / "synthetic.json").read_text())


def pascal_data(data: str | Path | None, pscale: Scale, out: Path,
                say: Callable[[str], None]) -> tuple[Path, dict]:
    """pascal-table3's dataset root: ``data`` (--pascal-data), or the synthetic PASCAL-Context rendered into
    OUT/data/pascal (`make_data.py synthetic --dataset pascal_context`) and packed into OUT/data/pascal_shards
    (`make_data.py pack`)."""
    if data:
        root = Path(data)
        if not root.exists():
            raise FileNotFoundError(f"--pascal-data {root} does not exist (render one with tools/make_data.py "
                                    f"synthetic --dataset pascal_context, or leave --pascal-data out to render it "
                                    f"into {out / 'data'})")
        manifest = root / "synthetic.json"
        return root, json.loads(manifest.read_text()) if manifest.is_file() else {}
    tree, shards = out / "data" / "pascal", out / "data" / "pascal_shards"
    if not (tree / "synthetic.json").is_file():
        say(f"rendering {pscale.images} synthetic PASCAL-Context images at {pscale.img_size} px into {tree} "
            f"(tools/make_data.py synthetic --dataset pascal_context)")
        t0 = time.perf_counter()
        render_pascal(tree, n=pscale.images, image_size=pscale.img_size, seed=0, overwrite=tree.exists(),
                      workers=1 if pscale.images < 100 else None)  # a few images: not worth starting processes
        say(f"PASCAL-Context data rendered in {time.perf_counter() - t0:.0f} s")
    if not (shards / "shards.json").is_file():
        t0 = time.perf_counter()
        pack_shards(tree, shards, image_size=pscale.img_size, workers=pscale.workers, dataset="pascal_context")
        say(f"PASCAL-Context data packed into HDF5 shards in {shards} in {time.perf_counter() - t0:.0f} s "
            f"(tools/make_data.py pack --dataset pascal_context)")
    return shards, json.loads((tree / "synthetic.json").read_text())


def data_line(root: Path, info: dict) -> str:
    if not info:
        return f"`{root}`"
    if info.get("dataset") == "pascal_context":
        splits = info.get("splits") or {}
        return (f"synthetic PASCAL-Context `{root}`, {info.get('n', '?')} images at {info.get('image_size', '?')} px "
                f"long side ({', '.join(f'{k} {v}' for k, v in splits.items())})")
    splits = info.get("buildings") or {}
    text = ", ".join(f"{k} {len(v)} buildings" for k, v in splits.items() if isinstance(v, list))
    return (f"synthetic Taskonomy `{root}`, {info.get('n', '?')} images at {info.get('image_size', '?')} px"
            + (f" ({text})" if text else ""))


def scale_key(scale: Scale) -> dict:
    """The settings of a scale as plain data (what earlier results in a folder must match to be kept)."""
    return json.loads(json.dumps(dataclasses.asdict(scale)))


def previous_results(out: Path, scale: Scale, seeds: list[int]) -> dict:
    """The claims an earlier invocation measured in ``out`` (kept in the report), if at the same scale, with the
    same settings (steps, widths ...) and seeds.

    Raises:
        ValueError: ``out`` holds a report at another scale.
    """
    cache = out / "cache" / "claims.json"
    if not cache.is_file():
        return {}
    data = json.loads(cache.read_text())
    if data.get("scale") != scale.name:
        raise ValueError(f"--out {out} holds a report at scale {data.get('scale')}; use another --out for scale "
                         f"{scale.name}")
    if data.get("seeds") != seeds or data.get("settings") != scale_key(scale):
        return {}
    return data["claims"]
