"""squad: multi-task vision foundation models with conditional computation.

The public entry points: configs (`load_config`, `model_config`), the model (`build_model`, `SquadViT`),
timm interop (`from_timm`), parameter/MAC counts (`profile`).
"""

from squad.config import ModelConfig, SquadConfig, load_config, model_config
from squad.model import SquadOutput, SquadViT, build_model
from squad.profile import profile
from squad.timm_compat import from_timm

__all__ = [
    "ModelConfig",
    "SquadConfig",
    "SquadOutput",
    "SquadViT",
    "build_model",
    "from_timm",
    "load_config",
    "model_config",
    "profile",
]
