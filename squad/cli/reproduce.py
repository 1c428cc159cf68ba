"""Reproduce the papers' claims on the embedded data and write a report.

The embedded data is the synthetic Taskonomy; the report is report.md, PNG figures and results.json.

    python tools/reproduce.py pruning --scale tiny --out /tmp/r                    # the plumbing, in minutes
    python tools/reproduce.py modsquad-table2 table2-curve pruning mi-vs-balance amod-table3 mone-budget \\
        --scale cpu --out runs/repro-cpu --report reports/cpu     # converged, CPU, hours (--dry-run: the plan)
    python tools/reproduce.py all --rejudge reports/cpu/results.json --out reports/cpu   # old data, current rule
    python tools/reproduce.py modsquad-table2 --scale cpu --out /tmp/rerun --rerun stl-class_scene-s0 \\
        --against reports/cpu/results.json      # one run trained again here, against the report's tolerance
    python tools/reproduce.py modsquad-table2 --scale gpu --parallel 10 --out reports/gpu   # one H100, <= 8 min
    python tools/reproduce.py all --scale paper --out plans/paper --data /data/taskonomy   # configs + commands

Claims: modsquad-table2 (Mod-Squad Table 2: STL against the scale's multi-task families — MTL, an MTL + task
embedding control, M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad; Δt, parameters, MACs, step time, peak
memory), table2-curve (Δt of MTL and Mod-Squad against STL at each of the scale's budgets, each a run of its own:
does the gap close with training, and how fast), pruning (extraction along a θ curve and keep-top: parameters, like
with like, vs Δt), router-finetune (router / head /
full / linear-probe on fractions of a new task's data, every mode with the same budget and stopping rule; only on a
converged pretrain, else untestable), mi-vs-balance (MI loss vs a balance loss over all tasks, a per-task one and
the untrained model beside: expert-use sparsity, I(T;E), Δt), amod-table3 (a dense model of 8 blocks trained to a
plateau → MoD with attention routing or a learned router, no training then a fine-tune of 1,000+ steps, beside the
dense model trained on for those steps), mone-budget
(one MoNE model with e_c drawn per step from 0.15-0.95 vs models trained at e_c 0.2/0.4/0.6/0.8, every one for the
same steps, training compute in MACs, forward time per e_c), pascal-table3 (Mod-Squad Table 3's plumbing on the
synthetic PASCAL-Context: STL, MTL, Mod-Squad and the pruned Mod-Squad; no verdict on synthetic data); ``all`` for
every claim.

Verdicts: a claim declares its parts; it is reproduced when every part holds, partly reproduced when some do (each
named), by one-sided paired t-tests on each comparison's own per-seed differences (Holm over the parts); a verdict
needs >= 5 seeds (3-4: "too few seeds", the parts shown), and a difference inside the cross-machine tolerance (a
sample of runs trained again with another thread count) is no finding. Δt counts only the tasks whose reference model
beats the best image-independent predictor fitted on the validation images by >= 5 % on every seed and beyond the
seed noise (the learnability gate).

Every run is an ordinary run folder in OUT/runs (squad.load and the other tools open it); finished runs are skipped,
so the same command resumes an interrupted invocation (runs of 400 steps or more resume from their last quarter).
The estimated time (from step times measured at the start) is printed before anything trains. Without --data the
synthetic data is rendered into OUT/data/synthetic on every core (`make_data.py synthetic`) and packed into HDF5
shards in OUT/data/shards (`make_data.py pack`), which the runs read.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from squad.cli import run


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/reproduce.py`` / ``squad-reproduce``."""
    from squad.reproduce.scales import GPU_PARALLEL, GPU_TABLE2_MINUTES, SCALES, describe_scale

    scales = "\n".join(f"  {describe_scale(s)}" for s in SCALES.values())
    epilog = (f"Scales:\n{scales}\nThe gpu scale's modsquad-table2 is planned at <= {GPU_TABLE2_MINUTES:g} minutes "
              f"on one H100 with --parallel {GPU_PARALLEL} (from MEASURED.md's step times; unmeasured at its "
              "widths); the other claims are planned longer than one lent GPU session gives.")
    p = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claims", nargs="+", metavar="CLAIM", help="claims to measure (see above), or all")
    p.add_argument("--scale", choices=list(SCALES), default="small", help="default: small (see the scales below)")
    p.add_argument("--out", required=True, help="output folder (runs/, data/, cache/; the report too unless --report)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="where report.md, results.json and figures/ go (default: OUT), e.g. a folder in the "
                        "repository while OUT, with the runs and data, stays outside it")
    p.add_argument("--seeds", type=int, default=None, help="seeds per run (default: the scale's)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run instead of the scale's; a folder's runs must all have the same, so "
                        "use another --out for another value")
    p.add_argument("--data", default=None,
                   help="dataset root: a Taskonomy tree or HDF5 shards (default: the synthetic Taskonomy rendered and "
                        "packed into OUT/data at the scale's size; paper: the Taskonomy root written into the "
                        "commands)")
    p.add_argument("--pascal-data", default=None,
                   help="pascal-table3's PASCAL-Context root: a PASCAL_MT folder or its HDF5 shards (default: the "
                        "synthetic PASCAL-Context rendered and packed into OUT/data at the scale's size; paper: the "
                        "root written into the commands)")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="train N runs at once, each in a process of its own (and router-finetune's fine-tunes); "
                        f"several GPUs: one run each; the gpu scale is planned with {GPU_PARALLEL} on one GPU; "
                        "default 1 (in this process)")
    p.add_argument("--hostfile", default="hostfile", help="paper scale: the DeepSpeed hostfile the commands name")
    p.add_argument("--rejudge", default=None, metavar="RESULTS",
                   help="judge a report's results.json again under the current rule from the per-seed numbers it "
                        "holds, training nothing: writes OUT/rejudged.md and OUT/rejudged.json, labelled as an "
                        "interim re-judgement")
    p.add_argument("--rerun", nargs="+", default=None, metavar="RUN",
                   help="train these runs of the claims' plan again here (into OUT/rerun/RUN, with this machine's "
                        "threads) and compare each task's metric with the report's (--against): exit 1 when a change "
                        "is larger than the report's cross-machine tolerance for one run, 2 when the report cannot "
                        "be checked (no per-run metrics or tolerance, another scale or budget, a run it lacks); "
                        "--dry-run lists the plan's run names")
    p.add_argument("--against", default=None, metavar="RESULTS",
                   help="the report --rerun checks against (default: the results.json in --report, else OUT)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (every run, those already done in OUT, the tolerance reruns) and its CPU "
                        "budget on one core, and run nothing")
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


def _reproduce(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                else sys.argv[1:]))
    modes = [flag for flag, on in (("--rerun", args.rerun), ("--rejudge", args.rejudge), ("--dry-run", args.dry_run))
             if on]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} do different things: give one of them")
    if args.against and not args.rerun:
        raise ValueError("--against names the report a --rerun is checked against: give --rerun RUN too")
    if args.rejudge:
        from squad.reproduce.claims import resolve_claims
        from squad.reproduce.rejudge import write_rejudged

        md = write_rejudged(args.rejudge, args.out, resolve_claims(args.claims), command)
        print(f"[reproduce] interim re-judgement: {md}")
        return 0
    if args.dry_run:
        from squad.reproduce.invocation import dry_run

        dry_run(args.claims, args.scale, args.out, seeds=args.seeds, steps=args.steps, parallel=args.parallel)
        return 0
    if args.scale != "paper":
        from squad.distributed import prepare_environment

        prepare_environment()  # before deepspeed is imported anywhere
        _log_quietly()
    from squad.reproduce.invocation import reproduce

    out = reproduce(args.claims, args.scale, args.out, seeds=args.seeds, steps=args.steps, data=args.data,
                    pascal=args.pascal_data, hostfile=args.hostfile, command=command, parallel=args.parallel,
                    report_dir=args.report, rerun=args.rerun or (), against=args.against)
    if args.rerun:
        import json

        return 0 if all(c["inside"] for c in json.loads(out.read_text())) else 1
    return 0


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
