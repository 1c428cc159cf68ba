"""After training: turning a trained multi-task model into other models (each function takes a loaded model;
tools/ turn paths into models).

- extract.py: single-task extraction (`extract`, `collect_usage`) and the tools/extract.py pipeline (`extract_to_file`).
- finetune.py: learning a new task by training only its routers (or head / everything / a linear probe) in one loop
  (`fit`, `finetune_once`), with held-out selection of the lr and stopping step as an option, and the
  tools/finetune_router.py table (`finetune_table`); the reproduction's router-finetune claim runs the same code.
- subsets.py: the images a fine-tune learns from (nested fractions, shots per class) and its held-out share.
- adapt.py: a dense ViT turned into MoD / A-MoD with no training (`to_mod`, `fidelity`).
- upcycle.py: sparse upcycling, a dense ViT (timm or squad) as the init of a Mod-Squad (`upcycle`, `drift`).

The structural edits they make (adding, merging and selecting tasks, keeping experts) live beside the models in
`squad.models.surgery` (with `squad.models.pruning` choosing experts and `squad.models.transfer` mapping weights), so
loading a file never reaches up here. Their options are configs (`squad.config.tools`: `ExtractConfig`,
`FinetuneConfig`).
"""
