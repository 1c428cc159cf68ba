#!/usr/bin/env python
"""Draw a trained model's routing: expert-usage heatmaps, task-relation matrices, token maps over the image.

The tool lives in `squad.cli.visualize` (also installed as `squad-visualize`); usage and examples:
``python tools/visualize.py --help``.
"""

import sys

try:
    from squad.cli.visualize import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
