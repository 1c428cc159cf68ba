"""Reading the weight files other models start from: a timm ViT state dict (``.pth``/``.pt`` through
``torch.load(weights_only=True)``, or ``.safetensors``) or a squad model, for sparse upcycling (`squad.upcycle`,
tools/upcycle.py), training's ``train.init`` and tools/adapt_pretrained.py. What is done with the weights is
`squad.models.transfer`'s and `squad.models.timm`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from squad.config.model import ModelConfig
from squad.io.checkpoints import MODEL_STATES
from squad.io.hf_folder import resolve
from squad.io.model_files import EXTRACTED_FORMAT, MODEL_FORMAT, load
from squad.models.single_task import SingleTaskModel
from squad.models.transfer import check_dense, dense_from_timm_state
from squad.models.vit import SquadViT


def read_weights(path: str | Path) -> Mapping:
    """A weights file's contents (``torch.load(weights_only=True)`` or safetensors), read once.

    Raises:
        ValueError: the file is unreadable or holds something else than a mapping.
    """
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zip and safetensors readers each raise their own kinds
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{path}: not a readable model file: neither a squad model nor a timm ViT state dict "
                         f"({type(e).__name__}: {first[:200]})") from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: holds a {type(state).__name__}, neither a squad model nor a timm ViT state dict")
    return state


def unwrap_state(state: Mapping) -> Mapping:
    """The weights of a training checkpoint saved around them (``{"model": ...}`` or ``{"state_dict": ...}``)."""
    for key in ("model", "state_dict"):
        if isinstance(state.get(key), Mapping):
            state = state[key]
    return state


def read_timm_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A timm ViT state dict saved on disk (``.pth``/``.pt`` via ``torch.load(weights_only=True)`` or safetensors;
    a checkpoint's ``model`` / ``state_dict`` entry is taken).

    Raises:
        FileNotFoundError: no such file.
        ValueError: an unreadable file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"timm weights file not found: {path}")
    return dict(unwrap_state(read_weights(path)))


def is_squad_source(path: str | Path) -> bool:
    """Whether ``path`` is something `squad.io.load` opens (run folder, checkpoint, squad model file)."""
    path = Path(path)
    if path.is_dir() or path.name == MODEL_STATES:
        return True
    if path.suffix == ".safetensors":
        return False
    return read_weights(path).get("format") in (MODEL_FORMAT, EXTRACTED_FORMAT)


def read_init_source(path: str | Path) -> SquadViT | SingleTaskModel | Mapping:
    """What ``path`` holds for `squad.models.transfer.initialize_from`: a loaded squad model, or a timm state dict.

    Raises:
        FileNotFoundError: nothing at ``path``.
        ValueError: an unreadable file.
    """
    path = resolve(path)  # a hub id: its folder in huggingface_hub's cache
    if not path.exists():
        raise FileNotFoundError(f"{path} not found (an init file from tools/upcycle.py, a squad model, or a timm ViT "
                                f"state dict)")
    if is_squad_source(path):
        return load(path)
    return unwrap_state(read_weights(path))


def read_dense_source(path: str | Path, cfg: ModelConfig) -> tuple[SquadViT, bool]:
    """The dense model a file holds, and whether its heads may be copied (a squad model's: yes; timm's: no).

    Args:
        path: a timm ViT state dict (``.pth``/``.pt``/``.safetensors``) or a dense squad model (``model.pt``, run
            folder or checkpoint tag).
        cfg: the target's config (what timm weights cannot tell, the number of heads, comes from it).

    Raises:
        FileNotFoundError: no such file or folder.
        ValueError: a file that is neither a squad model nor a timm ViT state dict, an extracted single-task model,
            or a model that is not dense.
    """
    path = resolve(path)  # a hub id: its folder in huggingface_hub's cache
    if not path.exists():
        raise FileNotFoundError(f"dense model not found: {path} (a timm ViT state dict .pth/.pt/.safetensors, or a "
                                f"squad model.pt / run folder)")
    state = None if path.is_dir() or path.name == MODEL_STATES else read_weights(path)
    if state is None or state.get("format") in (MODEL_FORMAT, EXTRACTED_FORMAT):
        model = load(path)
        if not isinstance(model, SquadViT):
            raise ValueError(f"{path}: an extracted single-task model; upcycling needs a full dense model (a "
                             f"model.pt or run folder)")
        check_dense(model, str(path))
        return model, True
    return dense_from_timm_state(unwrap_state(state), cfg, str(path)), False
