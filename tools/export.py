#!/usr/bin/env python
"""Export a squad model as a torch.export program, an ONNX file or a Hugging Face-style folder.

The tool lives in `squad.cli.export` (also installed as `squad-export`); usage and examples:
``python tools/export.py --help``.
"""

import sys

try:
    from squad.cli.export import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
