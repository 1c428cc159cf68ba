#!/usr/bin/env python
"""Extract one task's subnetwork from a trained multi-task model into a standalone file.

    python tools/extract.py --checkpoint runs/demo --task depth --theta 0.01 --data data/synthetic
    python tools/extract.py --checkpoint runs/demo/model.pt --task normal --keep-top 0.4 --out normal.pt
    python tools/extract.py --checkpoint runs/demo --task depth --theta 0.01 --saved-usage   # no data needed

Expert usage comes from a calibration pass over the task's data (--data, --calib-split, --calib-batches) or, with
--saved-usage or without --data, from the statistics saved in model.pt. Experts used by at most θ of the task's
tokens (or all but the top H share with --keep-top) are removed from every MoE attention and MoE MLP layer;
routing stays exact unless --renormalize. Prints a summary and writes the model and a JSON report; load the model
with ``squad.load_extracted(path)``.

A model without MoE attention / MoE MLP layers (dense MTL, MoD, A-MoD, MoNE) has no experts to prune: the extracted
model keeps the backbone and only the task's head, router rows and task embedding, and the report says so (no
calibration data needed). --mone-capacity and --mod-inference set MoNE's e_c and MoD's inference mode for the
calibration, the metrics and the extracted model. A task the run never trained is refused.
"""

import sys

try:
    from squad.cli.extract import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
