"""Models: the network, building it, and changing its weights (as timm keeps its builder and pruning beside its
models).

- vit.py: `SquadViT` (the multi-task ViT with dense and conditional blocks), `SquadOutput`, `build_model`.
- registry.py: named models, timm style: `list_models`, `create_model` over the paper configs (configs/model/).
- single_task.py: `SingleTaskModel`, one task's path through a model (what extraction produces).
- usage.py: `ExpertUsage`, expert-selection statistics per task and layer (saved with a model; pruning reads them).
- inference.py: how a loaded model runs at inference (MoNE's e_c, MoD's top-k or threshold: `set_inference`).
- precision.py: the dtype inference runs in (``--precision bf16|fp32``; bf16 by default on CUDA): `cast_model`.
- compile.py: torch.compile of a model in place (`compile_model`: train.compile, --compile) and the graph breaks
  that remain (`graph_breaks`).
- surgery.py: every structural edit of a built model: adding a task and folding it in (`add_task`,
  `merge_added_tasks`, `with_new_task`), keeping a subset of tasks (`select_tasks`) or of experts (`keep_experts`);
  building on the meta device with shape-checked weight assignment (`build_on_meta`, `load_assigned`).
- pruning.py: choosing the experts to keep from usage frequencies (θ or keep-top).
- timm.py: timm interop: `from_timm` (a timm ViT's weights into a SquadViT), `load_timm_weights`.
- transfer.py: weight transfer from a dense ViT (sparse upcycling's maps, `transfer`; training's ``train.init``,
  `initialize_from`).
"""

from squad.models.registry import create_model, list_models
from squad.models.single_task import SingleTaskModel
from squad.models.timm import from_timm
from squad.models.vit import SquadOutput, SquadViT, build_model

__all__ = ["SingleTaskModel", "SquadOutput", "SquadViT", "build_model", "create_model", "from_timm", "list_models"]
