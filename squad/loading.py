"""Opening what the tools are pointed at — a run folder, a ``model.pt``, or an extracted single-task file — with
errors that say what the file is and what was expected (never a bare unpickling or shape traceback).
"""

from __future__ import annotations

from pathlib import Path

import torch

from squad.checkpoint import MODEL_FORMAT
from squad.configbase import ConfigError
from squad.model import SquadViT
from squad.usage import ExpertUsage

EXTRACTED_FORMAT = "squad.extracted/1"


def read_payload(path: str | Path) -> dict:
    """Loads a squad file (``model.pt`` of a run, or an extracted model) with ``weights_only=True``.

    Raises:
        FileNotFoundError: nothing at ``path`` (a run folder without ``model.pt`` names what is missing).
        ValueError: the file is not a squad model (its format is named).
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "model.pt").is_file():
            hint = " (it has checkpoints: training has not finished)" if (path / "checkpoints").is_dir() else ""
            raise FileNotFoundError(f"{path} holds no model.pt{hint}; pass a run folder after training or a model file")
        path = path / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem means: not one of our files
        raise ValueError(f"{path}: not a loadable squad model file ({type(e).__name__}: {str(e)[:200]})") from e
    fmt = payload.get("format") if isinstance(payload, dict) else None
    if fmt not in (MODEL_FORMAT, EXTRACTED_FORMAT):
        found = fmt if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a squad model file (format {found!r}; expected {MODEL_FORMAT!r} from "
                         f"tools/train.py or {EXTRACTED_FORMAT!r} from tools/extract.py)")
    payload["path"] = str(path)
    return payload


def model_from_payload(payload: dict) -> SquadViT:
    """Builds the full model a ``model.pt`` payload describes, with a clear error when the weights do not fit."""
    from squad.config import load_config
    from squad.surgery import build_on_meta, load_assigned

    source = payload.get("path", "model file")
    try:
        cfg = load_config({"model": payload["config"]}).model
    except (ConfigError, KeyError, TypeError) as e:
        raise ValueError(f"{source}: its model config is invalid ({e})") from e
    state = payload.get("state_dict")
    if not isinstance(state, dict):
        raise ValueError(f"{source}: no state_dict in the file")
    model = load_assigned(build_on_meta(cfg), {k: v.clone() for k, v in state.items()}, source)
    return model.eval()


def load_full_model(path: str | Path, with_usage: bool = True) -> tuple[SquadViT, ExpertUsage | None, dict]:
    """A multi-task model from a run folder or ``model.pt`` (not an extracted file).

    Returns:
        (model in eval mode, its saved usage statistics or None, the payload without weights).

    Raises:
        FileNotFoundError, ValueError: as `read_payload`, and for an extracted file or mismatched weights.
    """
    payload = read_payload(path)
    if payload.get("format") == EXTRACTED_FORMAT:
        raise ValueError(f"{payload['path']} is an extracted single-task model ({payload.get('task')}); "
                         f"this needs the full model (the run's model.pt)")
    model = model_from_payload(payload)
    usage = None
    if with_usage and payload.get("usage"):
        usage = ExpertUsage.from_state_dict(payload["usage"])
    meta = {k: v for k, v in payload.items() if k != "state_dict"}
    return model, usage, meta


def load_any(path: str | Path):
    """A full model or an extracted one, whichever the file holds.

    Returns:
        (model, kind) with kind ``"full"`` (a `SquadViT`) or ``"extracted"`` (a `squad.extract.SingleTaskModel`).
    """
    payload = read_payload(path)
    if payload.get("format") == EXTRACTED_FORMAT:
        from squad.extract import extracted_from_payload

        return extracted_from_payload(payload), "extracted"
    return model_from_payload(payload), "full"
