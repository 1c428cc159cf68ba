"""squad: multi-task vision foundation models with conditional computation.

The public entry points: configs (`load_config`, `model_config`), the model (`build_model`, `SquadViT`),
timm interop (`from_timm`), parameter/MAC counts (`profile`), trained models (`load_model`), extracted single-task
models (`load_extracted`).
"""

from squad.checkpoint import load_model
from squad.config import ModelConfig, SquadConfig, load_config, model_config
from squad.extract import SingleTaskModel, load_extracted
from squad.model import SquadOutput, SquadViT, build_model
from squad.profile import profile
from squad.timm_compat import from_timm

__all__ = [
    "ModelConfig",
    "SquadConfig",
    "SquadOutput",
    "SingleTaskModel",
    "SquadViT",
    "build_model",
    "from_timm",
    "load_config",
    "load_extracted",
    "load_model",
    "model_config",
    "profile",
]
