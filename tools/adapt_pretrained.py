#!/usr/bin/env python
"""Turn a trained dense ViT into a Mixture-of-Depths model with no training, and compare the two routings.

The tool lives in `squad.cli.adapt_pretrained` (also installed as `squad-adapt-pretrained`); usage and examples:
``python tools/adapt_pretrained.py --help``.
"""

import sys

try:
    from squad.cli.adapt_pretrained import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
