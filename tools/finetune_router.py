#!/usr/bin/env python
"""Learn a new task on a trained multi-task model by training only its routers, task embedding and head.

    # first a model trained without the new task (here: the demo on every task but class_scene)
    python tools/train.py --config configs/demo.yaml --out runs/no_scene --set 'data.tasks=[class_object,
        depth_euclidean, depth_zbuffer, normal, principal_curvature, reshading, edge_texture, edge_occlusion,
        keypoints2d, keypoints3d, segment_unsup2d, segment_unsup25d]'
    python tools/finetune_router.py --checkpoint runs/no_scene --task scene --data data/synthetic \
        --fractions 0.005,0.01,0.02,0.05 --mode router,head,full,linear-probe
    python tools/finetune_router.py --checkpoint runs/no_scene --task class_scene --data data/synthetic --shots 5

The model may have a head for the task that its run never trained (data.tasks left it out, as above): that head
and its router rows are learned anew. A task the run did train needs --replace.

Modes: router (router rows + task embedding + head), head (head only), full (everything), linear-probe (logistic
regression on frozen pooled features, class tasks). Every parameter a mode does not train is frozen for real and
checked bitwise unchanged. Subsets are deterministic (seeded, nested). Prints a table mode × size → metric and writes
JSON (--out). Under the deepspeed launcher or torchrun, rank 0 does all the work and the other ranks exit at once.
"""

import sys

try:
    from squad.cli.finetune_router import main  # the tool (arguments, error handling) lives in the package
except ModuleNotFoundError as e:
    print(f"error: cannot import squad with {sys.executable} ({e}); install it first: `make test` builds "
          ".venv with it, or run `pip install -e .` in the checkout", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
