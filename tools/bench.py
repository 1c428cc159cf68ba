#!/usr/bin/env python
"""squad's performance table: every case of `squad.bench.cases.CASES`, ratios timed side by side in one run.

    python tools/bench.py                       # all cases, table on stdout, bench.json in the current folder
    python tools/bench.py --quick --only moe_mlp mod --json out.json
    python tools/bench.py --profile             # params / MACs of every paper config (no timing)
    python tools/bench.py --list

A case whose module is missing or which fails is printed as an ERROR row (and the exit status is 1); a missed
target is printed as ``NO`` but is not an error.

Timing hygiene on a shared CPU machine (both recorded in the JSON; ``--no-tuning`` turns them off):
- OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless the variable is already set): with libgomp's
  default spinning, a core taken by another process stalls every parallel region and the ratios swing by 2-10x.
- glibc malloc keeps freed blocks (`squad.train.runtime.tune_cpu_allocator`), so activation-sized tensors are not
  faulted in afresh on every allocation (what jemalloc/tcmalloc do).
"""

import os
import sys

if __name__ == "__main__" and "--no-tuning" not in sys.argv[1:]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp
try:
    from squad.cli.bench import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
