"""Reproduce the papers' claims on the embedded data and write a report.

The embedded data is the synthetic Taskonomy; the report is report.md, PNG figures and results.json.

    python tools/reproduce.py all --scale small --out reports/small            # every claim, 2 seeds, CPU
    python tools/reproduce.py modsquad-table2 pruning --scale tiny --out /tmp/r  # the plumbing, in minutes
    python tools/reproduce.py pruning --scale gpu --parallel 8 --out reports/gpu  # one claim at convergence, a GPU
    python tools/reproduce.py all --scale paper --out plans/paper --data /data/taskonomy   # configs + commands

Claims: modsquad-table2 (Mod-Squad Table 2: STL, MTL, M3ViT-like, MoE MLP only, MoE attention only, Mod-Squad, and
an MTL + task embedding control; Δt, parameters, MACs, step time, peak memory), pruning (extraction at θ and
keep-top: parameters, like with like, vs Δt), router-finetune (router / head / full / linear-probe on fractions of a
new task's data, every mode with the same budget and stopping rule), mi-vs-balance (MI loss vs a per-task balance
loss: expert-use sparsity, I(T;E), Δt), amod-table3 (a dense model of 8 blocks trained to a plateau → MoD with
attention routing or a learned router, no training then a fine-tune of 1,000+ steps), mone-budget (one MoNE model
with e_c drawn per step from 0.15-0.95, trained at equal FLOPs, vs models trained at e_c 0.2/0.4/0.6/0.8, with
forward time per e_c), pascal-table3 (Mod-Squad Table 3 on the synthetic PASCAL-Context: STL, MTL, Mod-Squad and the
pruned Mod-Squad at θ = 0.01; Δm, parameters full vs pruned, MACs, step time); ``all`` for every claim.

Scales: tiny (4 tasks, 32 px, a few steps: minutes), small (13 tasks, 64 px, width 96, 200 steps, 2 seeds: hours on
2 CPU cores), gpu (13 tasks, 64 px, width 192, depth 6, 2,000 steps of 64 images, 3 seeds: the claims at
convergence; planned at 25 minutes or less per claim on one H100 with --parallel 8), paper (writes the
real-Taskonomy run configs and the ``deepspeed --hostfile`` commands, runs nothing). --parallel N trains N runs at
once, each in a process of its own (one GPU each on a machine with several; on a CPU the cores are split between
them). Without --data the synthetic data is rendered into OUT/data/synthetic (`make_data.py synthetic`) and
packed into HDF5 shards in OUT/data/shards (`make_data.py pack`), which the runs read; pascal-table3 renders its
synthetic PASCAL-Context into OUT/data/pascal and packs it into OUT/data/pascal_shards (or reads --pascal-data).

Every run is an ordinary run folder in OUT/runs (squad.load and the other tools open it); finished runs are skipped,
so the same command resumes an interrupted invocation. The estimated time (from step times measured at the start)
is printed before anything trains; on a busy machine pass --steps to fit the budget. The verdicts (reproduced /
not reproduced / inconclusive) follow the rule written in the report.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys

from squad.cli import run


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/reproduce.py`` / ``squad-reproduce``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("claims", nargs="+", metavar="CLAIM", help="claims to measure (see above), or all")
    p.add_argument("--scale", choices=["tiny", "small", "gpu", "paper"], default="small", help="default: small")
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
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="train N runs at once, each in a process of its own (and router-finetune's fine-tunes); "
                        "several GPUs: one run each; default 1 (in this process)")
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


def _reproduce(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                else sys.argv[1:]))
    if args.scale != "paper":
        from squad.distributed import prepare_environment

        prepare_environment()  # before deepspeed is imported anywhere
        _log_quietly()
    from squad.reproduce.invocation import reproduce

    reproduce(args.claims, args.scale, args.out, seeds=args.seeds, steps=args.steps, data=args.data,
              pascal=args.pascal_data, hostfile=args.hostfile, command=command, parallel=args.parallel)
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
