"""One GPU's check of squad: the GPU tests, the routed ops' backends timed (the choice `auto` reads), the GPU bench
rows beside the H100 cost model, train steps, a DeepSpeed run.

    python tools/gpu_check.py                     # results in $OUT/gpu-check when $OUT is set, else reports/gpu_check
    python tools/gpu_check.py --out /tmp/check    # (make gpu-check runs the same)
    python tools/gpu_check.py --only tests,deepspeed   # some stages again, after a fix
    python tools/gpu_check.py --rejoin reports/bench/gpu_check_h200/gpu_check.json --out /tmp/r   # no GPU: the
                                                  # measured rows beside today's cost model of the GPU that ran them

At most 9 minutes on one H100 (each stage has its own limit; `squad.bench.gpucheck`); writes gpu_check.json and
gpu_check.md into the folder, with one log per stage. Exit 0 when every stage ran and passed (a missed performance
target is printed as NO, not failed), 1 when one did not, 2 without a GPU (nothing runs) or with an --out that cannot
be written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from squad.cli import run


def default_out() -> Path:
    """``$OUT/gpu-check`` on a lent GPU machine (its $OUT comes back), else ``reports/gpu_check``."""
    return Path(os.environ["OUT"]) / "gpu-check" if os.environ.get("OUT") else Path("reports/gpu_check")


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/gpu_check.py`` / ``make gpu-check``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for gpu_check.json, gpu_check.md and the stage logs (default: $OUT/gpu-check when "
                        "$OUT is set, else reports/gpu_check)")
    p.add_argument("--rejoin", type=Path, default=None, metavar="GPU_CHECK_JSON",
                   help="no GPU needed: join that report's measured bench rows again with today's cost model of its "
                        "GPU and write gpu_check.json / .md into --out")
    p.add_argument("--only", default=None, metavar="STAGE[,STAGE]",
                   help="run these stages only, in the check's order (tests, kernels, bench, step, deepspeed); "
                        "a rerun after a fix")
    return p


def _gpu_check(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from squad.bench.gpucheck import FILES, STAGES, NoGpu, require_gpu, run_check
    from squad.io.files import check_writable

    if args.rejoin is not None:
        return _rejoin(args.rejoin, args.out)

    stages = STAGES
    if args.only is not None:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in {s.name for s in STAGES}]
        if unknown or not names:
            print(f"error: --only {args.only!r}: unknown stage(s) {', '.join(unknown) or '(none named)'}; the "
                  f"stages are {', '.join(s.name for s in STAGES)}", file=sys.stderr)
            return 2
        stages = [s for s in STAGES if s.name in names]
    out = check_writable(args.out or default_out(), "--out", folder=True)  # before minutes of work
    try:
        gpu = require_gpu()
    except NoGpu as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"gpu-check on {gpu}: results in {out}", flush=True)
    report = run_check(out, stages)
    for name, result in report["stages"].items():
        print(f"  {name}: {result.get('status')} ({result.get('wall_s', 0):.0f} s)")
    print(f"wrote {out / FILES[0]} and {out / FILES[1]} ({report['wall_s']:.0f} s)")
    return 0 if report["ok"] else 1


def _rejoin(report_file: Path, out: Path | None) -> int:
    import json

    from squad.bench.gpucheck import FILES, markdown, rejoin
    from squad.io.files import check_writable

    try:
        report = json.loads(report_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: --rejoin {report_file}: not a readable gpu_check.json ({e})", file=sys.stderr)
        return 2
    try:
        report = rejoin(report)
    except ValueError as e:
        print(f"error: --rejoin {report_file}: {e}", file=sys.stderr)
        return 2
    out = check_writable(out or report_file.parent, "--out", folder=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES[0]).write_text(json.dumps(report, indent=2) + "\n")
    (out / FILES[1]).write_text(markdown(report))
    print(f"joined {report_file}'s GPU rows with the {report['rejoined']['model_gpu']} cost model: wrote "
          f"{out / FILES[0]} and {out / FILES[1]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the GPU check; exit 0 passed, 1 a stage failed, 2 no GPU or bad input (`squad.cli.run`)."""
    return run(_gpu_check, argv)


if __name__ == "__main__":
    sys.exit(main())
