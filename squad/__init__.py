"""squad: multi-task vision foundation models with conditional computation.

The public entry points: configs (`load_config`, `model_config`), the model (`build_model`, `SquadViT`),
timm interop (`from_timm`), parameter/MAC counts (`profile`), trained models (`load_model`), extracted single-task
models (`load_extracted`).
"""

from squad.analysis.flops import profile
from squad.config.model import ModelConfig, SquadConfig, load_config, model_config
from squad.io import load_extracted, load_model
from squad.models.single_task import SingleTaskModel
from squad.models.timm import from_timm
from squad.models.vit import SquadOutput, SquadViT, build_model

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
