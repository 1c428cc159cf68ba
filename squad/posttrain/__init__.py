"""After training: turning a trained multi-task model into other models.

- surgery.py: building on the meta device, shape-checked weight assignment, keeping a subset of tasks.
- pruning.py: choosing experts from usage frequencies (θ or keep-top) and slicing MoE layers.
- extract.py: single-task extraction (`extract`, `collect_usage`) and the tools/extract.py pipeline (`extract_to_file`).
- finetune.py: learning a new task by training only its routers (or head / everything / a linear probe), and the
  tools/finetune_router.py table (`finetune_table`).
- adapt.py: a dense ViT turned into MoD / A-MoD with no training (`to_mod`, `fidelity`).
- upcycle.py: sparse upcycling, a dense ViT (timm or squad) as the init of a Mod-Squad (`upcycle`, `drift`, and
  `initialize_from` behind training's ``train.init``).
"""
