"""Models.

- vit.py: `SquadViT` (the multi-task ViT with dense and conditional blocks), `SquadOutput`, `build_model`.
- registry.py: named models, timm style: `list_models`, `create_model` over the paper configs (configs/model/).
- timm.py: timm interop: `from_timm` (a timm ViT's weights into a SquadViT), reading timm weight files.
- single_task.py: `SingleTaskModel`, one task's path through a model (what extraction produces).
"""

from squad.models.registry import create_model, list_models
from squad.models.single_task import SingleTaskModel
from squad.models.timm import from_timm
from squad.models.vit import SquadOutput, SquadViT, build_model

__all__ = ["SingleTaskModel", "SquadOutput", "SquadViT", "build_model", "create_model", "from_timm", "list_models"]
