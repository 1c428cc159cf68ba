#!/usr/bin/env python
"""Make data for squad: render a synthetic Taskonomy, or pack a Taskonomy tree into HDF5 shards.

    python tools/make_data.py synthetic --out data/synthetic --n 2000 --image-size 64 --seed 0
    python tools/make_data.py pack --src ROOT --split tiny --out SHARDS --image-size 256

`synthetic` writes Taskonomy's own layout and encodings (all 13 domains + rgb, a split CSV), which the real reader
loads. `pack` stores every domain of each sample, resized to --image-size, in HDF5 shards that
`squad.data.build_dataset` reads with the same sample format, several times faster.
"""

import sys

try:
    from squad.cli.make_data import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
