"""squad's performance table: every case of `squad.bench.cases.CASES`, ratios timed side by side in one run.

    python tools/bench.py                       # all cases, the table on stdout (no file written)
    python tools/bench.py --json bench.json     # ... and every row with its details as JSON
    python tools/bench.py --quick --only moe_mlp mod --json out.json
    python tools/bench.py --profile             # params / MACs of every paper config (no timing)
    python tools/bench.py --list
    python tools/bench.py --device cuda --only moe_mlp moa mod mone   # the GPU rows (bf16, CUDA events)
    python tools/bench.py --only traffic       # bytes, kernels, syncs of the routed layers' CUDA path + H100 model
    python tools/bench.py --fit-traffic --json reports/bench/traffic_fit.json   # refit the H100 model to 84de653
    python tools/bench.py --plan configs/taskonomy/modsquad_vit_b.yaml --gpus 240   # capacity plan (an estimate)

A case whose module is missing or which fails is printed as an ERROR row (and the exit status is 1); a missed
target is printed as ``NO`` but is not an error.

Timing hygiene on a shared CPU machine (both recorded in the JSON; ``--no-tuning`` turns them off):
- OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless the variable is already set): with libgomp's
  default spinning, a core taken by another process stalls every parallel region and the ratios swing by 2-10x.
- glibc malloc keeps freed blocks (`squad.runtime.tune_cpu_allocator`), so activation-sized tensors are not
  faulted in afresh on every allocation (what jemalloc/tcmalloc do).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from pathlib import Path

from squad.cli import rerun_with_passive_omp, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments of ``tools/bench.py`` / ``squad-bench`` (unknown case names are a usage error, exit 2)."""
    from squad.bench.cases import CASES, COMPILED, gpu_present

    names = [c.name for c in CASES]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="cases:\n" + "\n".join(f"  {c.name:<18}{c.help}" for c in CASES))
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (CI, smoke tests)")
    p.add_argument("--only", nargs="+", metavar="CASE", help=f"run these cases only ({', '.join(names)})")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the results as JSON to this file (default: none; the table goes to stdout)")
    p.add_argument("--profile", action="store_true",
                   help="print the params/MACs table of the paper configs; timing cases run only with --only")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-tuning", action="store_true",
                   help="keep libgomp's spinning wait policy and glibc's default malloc thresholds")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--step-rate", type=float, default=None, metavar="IMG_S",
                   help="images/s one GPU trains at, for the data case's loader cores per GPU (default: the modelled "
                        "H100 rate of modsquad_vit_b, 3000)")
    p.add_argument("--fit-traffic", action="store_true",
                   help="refit the traffic profile's H100 cost model to what an H100 measured at 84de653 (records "
                        "that commit's code from git history) and print each case's residual; timing cases run only "
                        "with --only")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the cases that have GPU rows run (moe_mlp, moa, mod, mone: bf16, paper widths, CUDA "
                        "events); default cuda when a GPU is present, else cpu")
    p.add_argument("--compiled", choices=COMPILED, default=None,
                   help="GPU rows of moe_mlp, moa, mod, mone also under torch.compile: 'twins' (the default on a GPU) "
                        "times each against its compiled dense twin, the fused twin the cost model prices; 'both' "
                        "also compiles the routed one (minutes of compiling); 'none' eager only. On the CPU the mod "
                        "and mone rows take it when given (the others are eager there)")
    plan = p.add_argument_group("capacity plan (squad.bench.plan): a run's step time, memory, images/s, loader rate "
                                "and wall time on N devices like this machine's, from a step measured here")
    plan.add_argument("--plan", type=Path, metavar="CONFIG", help="run config to plan (timing cases run only with "
                      "--only)")
    plan.add_argument("--gpus", type=int, default=1, help="data-parallel devices (default 1)")
    plan.add_argument("--batch-per-gpu", type=int, default=None,
                      help="images per device (default: optim.batch_per_rank)")
    plan.add_argument("--images", type=int, default=None, help="training images (default: counted in data.root, "
                      "else estimated)")
    plan.add_argument("--epochs", type=float, default=None, help="epochs (default: optim.epochs)")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = p.parse_args(argv)
    if args.plan is not None:
        if not args.plan.is_file():
            p.error(f"--plan {args.plan}: no such config file")
        for key in ("gpus", "batch_per_gpu", "images"):
            value = getattr(args, key)
            if value is not None and value < 1:
                p.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
        if args.epochs is not None and args.epochs <= 0:
            p.error(f"--epochs must be > 0, got {args.epochs}")
    unknown = [n for n in args.only or [] if n not in names]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(names)}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.device is None:
        args.device = "cuda" if gpu_present() else "cpu"
    elif args.device == "cuda" and not gpu_present():
        p.error("--device cuda: no CUDA GPU is visible to torch on this machine (use --device cpu)")
    return args


def _bench(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if "--no-tuning" not in argv and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when torch loads it
    args = parse_args(argv)
    import torch

    from squad import runtime
    from squad.bench import cases as bench_cases
    from squad.io.files import atomic_write_text, check_writable

    if args.list:
        for c in bench_cases.CASES:
            print(f"{c.name:<18}{c.ref:<48}{c.help}")
        return 0
    if args.json is not None:
        check_writable(args.json, "--json")  # before minutes of timing
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not args.no_tuning:
        runtime.tune_cpu_allocator()

    report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
                    "device": args.device, "device_name": bench_cases.device_name(args.device),
                    "environment": bench_cases.environment(), "results": []}
    if args.profile:
        print(bench_cases.profile_table())
        report["profile"] = bench_cases.profile_rows()
    if args.plan is not None:
        from squad.bench.plan import capacity_plan, format_plan

        plan = capacity_plan(args.plan, args.gpus, batch_per_gpu=args.batch_per_gpu, images=args.images,
                             epochs=args.epochs, overrides=args.set, quick=args.quick)
        print(format_plan(plan))
        report["plan"] = plan
    rows = []
    if args.fit_traffic:
        from squad.bench.calibrate import fit_report, format_fit

        report["traffic_fit"] = fit_report()
        print(format_fit(report["traffic_fit"]))
    if args.only or not (args.profile or args.plan is not None or args.fit_traffic):
        def progress(case, case_rows):
            print(f"[{case.name}] done ({len(case_rows)} rows)", file=sys.stderr, flush=True)

        rows = bench_cases.run_cases(args.only, quick=args.quick, on_rows=progress, device=args.device,
                                     options={"step_rate": args.step_rate, "compiled": args.compiled})
        env = bench_cases.environment()
        print(f"torch {env['torch']}, {env['threads']} threads, {env['cpus']} CPUs, OMP_WAIT_POLICY "
              f"{env['omp_wait_policy']}, malloc tuned {env['malloc_tuned']}, load average "
              f"{', '.join(f'{v:.2f}' for v in env['load_average'] or [])}" + (", --quick sizes" if args.quick else ""))
        print(bench_cases.format_table(rows, bench_cases.device_name(args.device)))
        if any(r.case.startswith("traffic_") for r in rows):
            from squad.bench.traffic_profile import format_traffic

            print("\ntraffic profile (CUDA path recorded on the CPU, bf16; kernels..GB exact, model ms a MODEL):")
            print(format_traffic(rows))
        report["environment_after"] = env
        report["results"] = [bench_cases.result_dict(r) for r in rows]
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(report, indent=2) + "\n", "the benchmark results")
        print(f"wrote {args.json}")
    return 1 if any(r.unit == "error" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark cases; exit 1 when a case errored, 2 on bad input (`squad.cli.run`)."""
    return run(_bench, argv)


def console() -> int:
    """The ``squad-bench`` console script: `main` with ``OMP_WAIT_POLICY=PASSIVE`` in effect unless --no-tuning."""
    if "--no-tuning" not in sys.argv[1:]:
        rerun_with_passive_omp(__name__)
    return main()


if __name__ == "__main__":
    sys.exit(main())
