"""Reproduce the papers' claims on the embedded data and write a report.

The embedded data is the synthetic Taskonomy; the report is report.md, PNG figures and results.json.

    python tools/reproduce.py all --scale small --out reports/small            # every claim, 2 seeds, <= 90 min
    python tools/reproduce.py modsquad-table2 pruning --scale tiny --out /tmp/r  # the plumbing, in minutes
    python tools/reproduce.py all --scale paper --out plans/paper --data /data/taskonomy   # configs + commands

Claims: modsquad-table2 (Mod-Squad Table 2: STL, MTL, M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad;
Δt, parameters, MACs, step time, peak memory), pruning (extraction at θ and keep-top: parameters vs Δt),
router-finetune (router / head / full / linear-probe on 0.5-5 % of a new task's data), mi-vs-balance (MI loss vs a
per-task balance loss: expert-use sparsity, I(T;E), Δt), amod-table3 (dense → MoD with attention routing or a learned
router, no training then a short fine-tune), mone-budget (one MoNE model with e_c sampled per step vs fixed-e_c
models, with forward time per e_c), pascal-table3 (Mod-Squad Table 3 on the synthetic PASCAL-Context: STL, MTL,
Mod-Squad and the pruned Mod-Squad at θ = 0.01; Δm, parameters full vs pruned, MACs, step time); ``all`` for every
claim.

Scales: tiny (4 tasks, 32 px, a few steps: minutes), small (13 tasks, 64 px, width 96, 200 steps, 2 seeds: about an
hour on 2 CPU cores), paper (writes the real-Taskonomy run configs and the ``deepspeed --hostfile`` commands, runs
nothing). Without --data the synthetic data is rendered into OUT/data/synthetic (`make_data.py synthetic`) and
packed into HDF5 shards in OUT/data/shards (`make_data.py pack`), which the runs read; pascal-table3 renders its
synthetic PASCAL-Context into OUT/data/pascal and packs it into OUT/data/pascal_shards (or reads --pascal-data).

Every run is an ordinary run folder in OUT/runs (squad.load and the other tools open it); finished runs are skipped,
so the same command resumes an interrupted invocation. The estimated time (from step times measured at the start)
is printed before anything trains; on a busy machine pass --steps to fit the budget. The verdicts (reproduced /
not reproduced / inconclusive) follow the rule written in the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from squad.cli import run


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/reproduce.py`` / ``squad-reproduce``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claims", nargs="+", metavar="CLAIM", help="claims to measure (see above), or all")
    p.add_argument("--scale", choices=["tiny", "small", "paper"], default="small", help="default: small")
    p.add_argument("--out", required=True, help="output folder (report.md, results.json, figures/, runs/)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per run (default: the scale's; small: 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run instead of the scale's (small: 200); a folder's runs must all have "
                        "the same, so use another --out for another value")
    p.add_argument("--data", default=None,
                   help="dataset root: a Taskonomy tree or HDF5 shards (default: the synthetic Taskonomy rendered and "
                        "packed into OUT/data at the scale's size; paper: the Taskonomy root written into the "
                        "commands)")
    p.add_argument("--pascal-data", default=None,
                   help="pascal-table3's PASCAL-Context root: a PASCAL_MT folder or its HDF5 shards (default: the "
                        "synthetic PASCAL-Context rendered and packed into OUT/data at the scale's size; paper: the "
                        "root written into the commands)")
    p.add_argument("--hostfile", default="hostfile", help="paper scale: the DeepSpeed hostfile the commands name")
    return p


def _log_quietly() -> None:
    """Warnings only on the console (each run's full log is its train.log); keeps the engine from adding its own."""
    squad_log = logging.getLogger("squad")
    if not any(getattr(h, "_reproduce", False) for h in squad_log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setLevel(logging.WARNING)
        h.setFormatter(logging.Formatter("[squad] %(levelname)s %(message)s"))
        h._reproduce = True  # type: ignore[attr-defined]
        squad_log.addHandler(h)
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _data(args, scale, out: Path, say) -> tuple[Path, dict]:
    """The dataset root: --data, or the synthetic Taskonomy rendered into OUT/data/synthetic and packed into HDF5
    shards in OUT/data/shards (reads several times faster; both kept between invocations)."""
    if args.data:
        root = Path(args.data)
        if not root.exists():
            raise FileNotFoundError(f"--data {root} does not exist (render one with tools/make_data.py synthetic, "
                                    f"or leave --data out to render it into {out / 'data'})")
        manifest = root / "synthetic.json"
        return root, json.loads(manifest.read_text()) if manifest.is_file() else {}
    tree, shards = out / "data" / "synthetic", out / "data" / "shards"
    if not (tree / "synthetic.json").is_file():
        from squad.data.synthetic import render_dataset

        say(f"rendering {scale.images} synthetic images at {scale.img_size} px into {tree} "
            f"(tools/make_data.py synthetic)")
        t0 = time.perf_counter()
        render_dataset(tree, n=scale.images, image_size=scale.img_size, seed=0, buildings=scale.buildings,
                       overwrite=tree.exists())
        say(f"data rendered in {time.perf_counter() - t0:.0f} s")
    if not (shards / "shards.json").is_file():
        from squad.data import pack_shards

        t0 = time.perf_counter()
        pack_shards(tree, shards, image_size=scale.img_size, workers=scale.workers)
        say(f"data packed into HDF5 shards in {shards} in {time.perf_counter() - t0:.0f} s (tools/make_data.py pack)")
    return shards, json.loads((tree / "synthetic.json").read_text())


def _pascal_data(args, pscale, out: Path, say) -> tuple[Path, dict]:
    """pascal-table3's dataset root: --pascal-data, or the synthetic PASCAL-Context rendered into OUT/data/pascal
    (`make_data.py synthetic --dataset pascal_context`) and packed into OUT/data/pascal_shards (`make_data.py pack`)."""
    if args.pascal_data:
        root = Path(args.pascal_data)
        if not root.exists():
            raise FileNotFoundError(f"--pascal-data {root} does not exist (render one with tools/make_data.py "
                                    f"synthetic --dataset pascal_context, or leave --pascal-data out to render it "
                                    f"into {out / 'data'})")
        manifest = root / "synthetic.json"
        return root, json.loads(manifest.read_text()) if manifest.is_file() else {}
    tree, shards = out / "data" / "pascal", out / "data" / "pascal_shards"
    if not (tree / "synthetic.json").is_file():
        from squad.data.synthetic_pascal import render_pascal

        say(f"rendering {pscale.images} synthetic PASCAL-Context images at {pscale.img_size} px into {tree} "
            f"(tools/make_data.py synthetic --dataset pascal_context)")
        t0 = time.perf_counter()
        render_pascal(tree, n=pscale.images, image_size=pscale.img_size, seed=0, overwrite=tree.exists(),
                      workers=1 if pscale.images < 100 else None)  # a few images: not worth starting processes
        say(f"PASCAL-Context data rendered in {time.perf_counter() - t0:.0f} s")
    if not (shards / "shards.json").is_file():
        from squad.data import pack_shards

        t0 = time.perf_counter()
        pack_shards(tree, shards, image_size=pscale.img_size, workers=pscale.workers, dataset="pascal_context")
        say(f"PASCAL-Context data packed into HDF5 shards in {shards} in {time.perf_counter() - t0:.0f} s "
            f"(tools/make_data.py pack --dataset pascal_context)")
    return shards, json.loads((tree / "synthetic.json").read_text())


def _data_line(root: Path, info: dict) -> str:
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


def _reproduce(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from squad.reproduce.claims import CLAIMS, resolve_claims

    claims = resolve_claims(args.claims)  # an unknown name: ValueError listing the claims (exit 2)
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    from squad.reproduce.scales import get_scale

    scale = get_scale(args.scale)
    if args.steps is not None:
        scale = dataclasses.replace(scale, steps=args.steps)
    seeds = list(range(args.seeds or scale.seeds))
    out = Path(args.out)
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                else sys.argv[1:]))

    def say(text: str) -> None:
        print(f"[reproduce] {text}", flush=True)

    if scale.paper:
        from squad.reproduce.paper import write_paper_plan

        plan = write_paper_plan(claims, out, len(seeds), args.data, args.hostfile, args.pascal_data)
        say(f"paper scale: {len(plan['configs'])} run configs in {out / 'configs'}, commands in {plan['commands']} "
            f"(nothing was run)")
        return 0

    from squad.distributed import prepare_environment

    prepare_environment()  # before deepspeed is imported anywhere
    _log_quietly()
    import torch

    from squad.reproduce.claims import Context
    from squad.reproduce.report import write_report
    from squad.reproduce.runs import Runner, is_done
    from squad.reproduce.scales import estimate_seconds, format_duration, pascal_scale

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    previous = _previous(out, scale.name, seeds)
    pscale = pascal_scale(scale, args.steps)
    pascal_only = claims == ["pascal-table3"]
    if pascal_only and not args.data:  # no Taskonomy run: nothing to render
        data, info = out / "data" / "shards", {}
    else:
        data, info = _data(args, scale, out, say)
    pdata, pinfo = _pascal_data(args, pscale, out, say) if "pascal-table3" in claims else (None, {})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = Context(scale, seeds, data, out, Runner(out, scale, data), device, pascal=pscale, pascal_data=pdata)
    specs = list({s.name: s for c in claims for s in CLAIMS[c].specs(ctx)}.values())
    todo = [s for s in specs if not is_done(ctx.runner.path(s))]
    ctx.runner.total = len(specs)
    say(f"{len(claims)} claim{'s' if len(claims) > 1 else ''} at scale {scale.name}, seeds {seeds}: {len(specs)} runs "
        f"({len(specs) - len(todo)} done already)")
    if todo:
        measured = {}
        for s in todo:  # measure one step time per family (the cost table re-uses these)
            fam = s.family if s.family != "mod" else "mtl"
            key = fam if fam != "stl" else "stl"
            if key not in measured:
                probe = s if s.init is None else next((x for x in specs if x.family == "mtl"), None)
                if probe is not None:
                    measured[key] = ctx.cost(probe)["step_s"]
        plan = [("mtl" if s.family == "mod" else s.family, s.steps, len(s.train_tasks or s.tasks)) for s in todo]
        estimate = estimate_seconds(plan, measured, scale, claims, len(seeds))
        say(f"estimated time {format_duration(estimate)}: {len(todo)} runs to train (seconds per step measured just "
            f"now: {', '.join(f'{k} {v:.2f}' for k, v in measured.items())}) and the claims' evaluations")
    results = dict(previous)
    for name in claims:
        say(f"claim {name}")
        t_claim = time.perf_counter()
        results[name] = CLAIMS[name].measure(ctx)
        say(f"claim {name} measured in {format_duration(time.perf_counter() - t_claim)} (with the runs it trained)")
    seconds = time.perf_counter() - t0
    cache = out / "cache" / "claims.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"scale": scale.name, "seeds": seeds, "claims": results}) + "\n")
    meta = {"command": command, "scale": scale, "scale_settings": dataclasses.asdict(scale), "seeds": seeds,
            "data": {"root": str(data), "manifest": info}, "seconds": seconds,
            "data_line": _data_line(pdata, pinfo) if pascal_only else _data_line(data, info),
            "duration": format_duration(seconds),
            "runs": {"total": len(specs), "trained": ctx.runner.trained, "skipped": ctx.runner.skipped}}
    if pdata is not None:
        meta["data"]["pascal"] = {"root": str(pdata), "manifest": pinfo}
        if not pascal_only:
            meta["data_line"] += f"; pascal-table3: {_data_line(pdata, pinfo)}"
    meta["train_seconds"] = sum(json.loads(f.read_text()).get("train_seconds", 0.0)
                                for f in (out / "runs").glob("*/reproduce.json"))
    report = write_report(out, results, meta)
    verdicts = ", ".join(f"{n}: {results[n]['verdict']}" for n in results)
    say(f"report {report} ({verdicts}) in {format_duration(seconds)}")
    return 0


def _previous(out: Path, scale: str, seeds: list[int]) -> dict:
    """The claims an earlier invocation measured in ``out`` (kept in the report), if at the same scale and seeds."""
    cache = out / "cache" / "claims.json"
    if not cache.is_file():
        return {}
    data = json.loads(cache.read_text())
    if data.get("scale") != scale:
        raise ValueError(f"--out {out} holds a report at scale {data.get('scale')}; use another --out for scale "
                         f"{scale}")
    return data["claims"] if data.get("seeds") == seeds else {}


def main(argv: list[str] | None = None) -> int:
    """Measures the claims and writes the report; exit 2 on bad input (an unknown claim lists the claims)."""
    return run(_reproduce, argv)


def console() -> int:
    """The ``squad-reproduce`` console script: `main` with ``OMP_WAIT_POLICY=PASSIVE`` in effect (spinning OpenMP
    threads stall every step on a CPU shared with a data-loader worker or another process; `squad.runtime`)."""
    from squad.cli import rerun_with_passive_omp

    rerun_with_passive_omp(__name__)
    return main()


if __name__ == "__main__":
    sys.exit(main())
