"""After training: turning a trained multi-task model into other models (each function takes a loaded model;
tools/ turn paths into models).

- extract.py: single-task extraction (`extract`, `collect_usage`) and the tools/extract.py pipeline (`extract_to_file`).
- finetune.py: learning a new task by training only its routers (or head / everything / a linear probe), and the
  tools/finetune_router.py table (`finetune_table`).
- adapt.py: a dense ViT turned into MoD / A-MoD with no training (`to_mod`, `fidelity`).
- upcycle.py: sparse upcycling, a dense ViT (timm or squad) as the init of a Mod-Squad (`upcycle`, `drift`).

The weight surgery they use (task selection, expert pruning, weight transfer) lives beside the models
(`squad.models.surgery`, `squad.models.pruning`, `squad.models.transfer`), so loading a file never reaches up here.
"""
