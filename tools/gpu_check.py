#!/usr/bin/env python
"""One GPU's check of squad: the GPU tests, the routed ops' backends timed (the choice `auto` reads), the GPU bench
rows beside the H100 cost model, train steps, a DeepSpeed run.

The tool lives in `squad.cli.gpu_check` (also installed as `squad-gpu-check`; `make gpu-check` runs it); usage:
``python tools/gpu_check.py --help``.
"""

import sys

try:
    from squad.cli.gpu_check import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
