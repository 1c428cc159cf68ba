#!/usr/bin/env python
"""Turn a trained dense ViT into a Mixture-of-Depths model with no training, and compare the two routings.

    python tools/adapt_pretrained.py --checkpoint runs/dense/model.pt --capacity 0.5 --routing attention \\
        --data data/synthetic --out runs/dense/amod.pt
    python tools/adapt_pretrained.py --checkpoint vit_small.pth --capacity 0.5 --data data/synthetic --out amod.pt

The checkpoint is a squad model (``model.pt`` or a run folder) or a timm VisionTransformer state dict on disk
(.pth/.pt/.safetensors; architecture read from the weight shapes, heads = width / 64 unless --num-heads; a file
with ``fc_norm`` is an average-pooled ViT, its classifier on the mean patch token). Every other block becomes a
MoD block at --capacity. Both routings are evaluated on --data without any training (A-MoD
Table 3): task metrics for squad models, and for any model the agreement with the dense model (top-1 of a class
or token head, cosine of the final features). The model for --routing is written to --out.
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
