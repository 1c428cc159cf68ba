"""squad: multi-task vision foundation models with conditional computation.

The public API (everything below is importable from ``squad``):

- Models, timm style: `list_models` (the paper configs' names), `create_model` (a named config or YAML file with
  fields changed: ``create_model("modsquad_vit_s", depth=4, img_size=64)``), `build_model` (from a `ModelConfig`,
  a `SquadConfig`/`RunConfig`, a YAML path or a name), `SquadViT`, `SquadOutput`.
- Configs: `load_config` (a model config → `SquadConfig`, a run config → `RunConfig`), `model_config` (just the
  `ModelConfig`; overrides with or without the ``model.`` prefix), `ModelConfig`, `SquadConfig`, `RunConfig`.
- timm interop: `from_timm` (a timm VisionTransformer's weights in a SquadViT).
- Sparse upcycling: `upcycle` (a dense ViT — timm state dict or dense squad model — as the init of a Mod-Squad or
  any other config: experts and heads from the dense MLP and attention, routers fresh).
- Parameter and MAC counts: `profile`.
- Trained models: `load` (whatever squad wrote: a model.pt, an extracted model, a run folder or checkpoint),
  `load_model` (a full model), `load_extracted` (an extracted single-task model, `SingleTaskModel`).
"""

from squad.analysis.flops import profile
from squad.config.loading import load_config, model_config
from squad.config.model import ModelConfig, SquadConfig
from squad.config.run import RunConfig
from squad.io import load, load_extracted, load_model
from squad.models.registry import create_model, list_models
from squad.models.single_task import SingleTaskModel
from squad.models.timm import from_timm
from squad.models.vit import SquadOutput, SquadViT, build_model
from squad.posttrain.upcycle import upcycle

__all__ = [
    "ModelConfig",
    "RunConfig",
    "SquadConfig",
    "SquadOutput",
    "SingleTaskModel",
    "SquadViT",
    "build_model",
    "create_model",
    "from_timm",
    "list_models",
    "load",
    "load_config",
    "load_extracted",
    "load_model",
    "model_config",
    "profile",
    "upcycle",
]
