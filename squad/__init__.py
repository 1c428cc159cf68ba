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
- Trained models: `load` (whatever squad wrote: a model.pt, an extracted model, a run folder or checkpoint, a
  Hugging Face-style folder or a hub id ``hf-hub:org/name``; always in eval mode), `load_model` (a full model),
  `load_extracted` (an extracted single-task model, `SingleTaskModel`).
- Sharing: `save_pretrained` (a model as a Hugging Face-style folder: ``model.safetensors``, ``config.json`` and a
  generated model card, ``README.md``; `squad.load` opens it).
- ``__version__``: the installed distribution's version.

``import squad`` is light: each name is imported on first use (PEP 562), so a tool can parse its arguments and check
its config and paths before torch, DeepSpeed or timm are loaded (``python -X importtime -c "import squad"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from squad.lazy import exports

# name → the module that defines it
_EXPORTS = {
    "profile": "squad.analysis.flops",
    "load_config": "squad.config.loading",
    "model_config": "squad.config.loading",
    "ModelConfig": "squad.config.model",
    "SquadConfig": "squad.config.model",
    "RunConfig": "squad.config.run",
    "load": "squad.io.model_files",
    "load_extracted": "squad.io.model_files",
    "load_model": "squad.io.model_files",
    "create_model": "squad.models.registry",
    "list_models": "squad.models.registry",
    "SingleTaskModel": "squad.models.single_task",
    "from_timm": "squad.models.timm",
    "SquadOutput": "squad.models.vit",
    "SquadViT": "squad.models.vit",
    "build_model": "squad.models.vit",
    "upcycle": "squad.posttrain.upcycle",
    "save_pretrained": "squad.deploy.hf",
}

__all__ = [
    "ModelConfig", "RunConfig", "SingleTaskModel", "SquadConfig", "SquadOutput", "SquadViT", "__version__",
    "build_model", "create_model", "from_timm", "list_models", "load", "load_config", "load_extracted", "load_model",
    "model_config", "profile", "save_pretrained", "upcycle",
]

if TYPE_CHECKING:  # what static tools see; at run time `__getattr__` imports each name on first use
    from squad.analysis.flops import profile
    from squad.config.loading import load_config, model_config
    from squad.config.model import ModelConfig, SquadConfig
    from squad.config.run import RunConfig
    from squad.deploy.hf import save_pretrained
    from squad.io.model_files import load, load_extracted, load_model
    from squad.models.registry import create_model, list_models
    from squad.models.single_task import SingleTaskModel
    from squad.models.timm import from_timm
    from squad.models.vit import SquadOutput, SquadViT, build_model
    from squad.posttrain.upcycle import upcycle


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("squad")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


_getattr, __dir__ = exports(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = _version()
        return globals()[name]
    return _getattr(name)
