"""Configuration: typed dataclasses loaded from YAML, checked key by key.

- base.py: YAML → dataclasses (`load_dataclass`), `ConfigError`, ``key=value`` overrides, ``base:`` inheritance,
  and where squad's own configs live (`config_root`, `model_names`, `find_config`).
- model.py: the model and its losses — `ModelConfig`, `SquadConfig`, `HeadConfig`, `RouterConfig`, the MoE/MoA/MoD/
  MoNE settings, `LossConfig`.
- run.py: a training run on top of them — `RunConfig`, `DataConfig`, `OptimConfig`, `TrainConfig`, and the
  DeepSpeed JSON derived from a run (`deepspeed_config`).
- loading.py: `load_config` (a model config → `SquadConfig`, a run config → `RunConfig`) and `model_config`.
- tools.py: the tools' options (`ExtractConfig`, `FinetuneConfig`, `EvaluateConfig`, `PredictConfig`,
  `VisualizeConfig`, `InferenceOptions`), built from a tool's arguments (`from_namespace`); no torch needed.
"""

from squad.config.base import ConfigError
from squad.config.loading import load_config, model_config
from squad.config.model import ModelConfig, SquadConfig
from squad.config.run import RunConfig

__all__ = ["ConfigError", "ModelConfig", "RunConfig", "SquadConfig", "load_config", "model_config"]
