"""squad: multi-task vision foundation models with conditional computation.

The public entry points: configs (`load_config`, `model_config`), the model (`build_model`, `SquadViT`),
timm interop (`from_timm`), parameter/MAC counts (`profile`), trained models (`load_model`).
"""

from squad.checkpoint import load_model
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
    "load_model",
    "model_config",
    "profile",
]
