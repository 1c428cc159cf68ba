"""Model files: ``model.pt``, extracted single-task models and checkpoint tags as models; `load` opens any of them.

``squad.load(path)`` takes a run folder, a ``model.pt``, an extracted single-task file or a DeepSpeed checkpoint and
returns the model, in eval mode, without DeepSpeed. Every file is read with ``torch.load(weights_only=True)``: a file
that needs arbitrary unpickling is refused with a `ValueError`, never executed. Weights are checked against the
model config before they are loaded; a mismatch names the tensor and both shapes.

Files squad writes (each written atomically, to a temporary file that then replaces the target, so a killed process
never leaves a half-written file):

``<run>/model.pt`` — format ``"squad.model/1"``
    Written at the end of training (`export_model`), and by tools/finetune_router.py and
    tools/adapt_pretrained.py. A dict of plain data: ``format``, ``config`` (the model config as a dict), ``tasks``,
    ``state_dict``, ``usage`` (`ExpertUsage.state_dict`, or None) and ``extra`` (step, final metrics,
    ``trained_tasks``, ...). Loads with `load` or `load_model` → `SquadViT`; also with plain
    ``torch.load(path, weights_only=True)``.
extracted single-task model (``<task>_theta<θ>.pt``) — format ``"squad.extracted/1"``
    Written by tools/extract.py (`save_extracted`): ``task``, ``config``, ``kept`` (layer → kept expert indices),
    ``exact``, ``mone_capacity``, ``state_dict``, ``report``; the report also sits beside it as ``<name>.json``. Loads
    with `load` or `load_extracted` → `SingleTaskModel`.
``<run>/checkpoints/<tag>/`` — DeepSpeed checkpoints
    DeepSpeed's own files plus squad's ``COMPLETE`` marker, and ``checkpoints/latest`` naming the newest tag (the
    layout is `squad.io.checkpoints`', which this module asks which tag a path names). tools/train.py resumes
    from them. `load` reads a complete tag's
    ``mp_rank_00_model_states.pt`` (its ``module`` weights, the expert usage and the loop counters) and takes the
    model config from the run's ``config.yaml``; ``checkpoints/`` itself means its latest complete tag.
Other files of a run folder
    ``config.yaml`` (the resolved run config: ``load_config(path, cls=RunConfig)``), ``ds_config.json`` (the DeepSpeed
    config derived from it), ``metrics.jsonl`` (one JSON object per evaluation), ``train.log``, ``tensorboard/``.

The format strings are part of the file format: files written by earlier versions load unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from squad.config.base import ConfigError, to_dict
from squad.config.loading import load_config
from squad.config.run import RunConfig
from squad.io import hf_folder
from squad.io.checkpoints import (
    COMPLETE,
    MODEL_STATES,
    TAG_CONFIG,
    checkpoint_tag,
    load_checkpoint_file,
    marked_step,
    model_states_file,
    refusal_reason,
)
from squad.io.expert_files import whole_experts
from squad.io.files import atomic_torch_save
from squad.io.zero3 import fp32_state_dict, is_zero3_tag
from squad.models.single_task import SingleTaskModel
from squad.models.surgery import build_on_meta, keep_experts, load_assigned
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT

MODEL_FORMAT = "squad.model/1"
EXTRACTED_FORMAT = "squad.extracted/1"
CHECKPOINT_FORMAT = "deepspeed-checkpoint"  # ``meta["format"]`` of a model loaded from a checkpoint tag


# ----------------------------------------------------------------------------------------------------- loading
def load(path: str | Path) -> SquadViT | SingleTaskModel:
    """Loads whatever squad wrote at ``path``, without DeepSpeed and with ``weights_only=True``.

    ``path`` may be:

    * a run folder (``runs/x``): its ``model.pt``;
    * a ``model.pt`` (format ``squad.model/1``) → a `SquadViT`;
    * an extracted file from tools/extract.py (format ``squad.extracted/1``) → a `SingleTaskModel`;
    * a Hugging Face-style folder (``squad.save_pretrained``, tools/export.py --format hf: ``config.json`` +
      ``model.safetensors``; `squad.io.hf_folder`) → a `SquadViT`, or a `SingleTaskModel` when it holds an
      extracted model; or a hub id ``hf-hub:org/name[@revision]`` naming one (resolved through huggingface_hub's
      cache, ``HF_HUB_OFFLINE`` honoured);
    * a DeepSpeed checkpoint tag folder (``runs/x/checkpoints/step00000060``, or its
      ``mp_rank_00_model_states.pt``) → a `SquadViT` built from the run's ``config.yaml``; the run's
      ``checkpoints/`` folder means its latest complete tag. Tags without the ``COMPLETE`` marker (a save that was
      interrupted) are refused. Under bf16/fp16 training DeepSpeed saves the module's half-precision weights; they
      are cast to the model's fp32 (the fp32 master copy lives in optimizer shards, which are not read). A ZeRO-3
      tag's weights are partitioned over its ranks' optimizer files and are put back together in fp32
      (`squad.io.zero3`). The tag of
      an expert-parallel run holds its experts in shard files (`squad.io.expert_files`): they are put back
      together, so the model is the whole single-process one whatever expert-parallel size wrote it.

    Returns:
        The model in eval mode, with two attributes beside its weights:

        * ``model.usage`` — the expert-usage statistics saved with it (`ExpertUsage`: training's statistics summed
          over ranks, from ``model.pt`` or the checkpoint), or None (none saved; always None for extracted files).
        * ``model.meta`` — the file's metadata without the weights: a dict with ``format`` (``"squad.model/1"``,
          ``"squad.extracted/1"``, ``"squad.hf/1"`` or ``"deepspeed-checkpoint"``), ``path`` (the file or tag folder
          read) and
          ``config`` (the model config as a dict), plus for full models ``tasks`` and ``extra`` (``step``,
          ``trained_tasks``, final ``metrics`` ...; for a checkpoint ``step``, ``tag``, ``trained_tasks`` and the
          loop counters ``loop``), and for extracted models ``task``, ``kept``, ``exact``, ``mone_capacity`` and the
          extraction ``report``.

    Raises:
        FileNotFoundError: nothing at ``path``, a run folder without ``model.pt`` (training not finished), a
            ``checkpoints/`` folder without a complete tag, or a checkpoint whose run has no ``config.yaml``.
        ValueError: not a squad file (its format is named), a file weights_only loading refuses, an incomplete
            checkpoint tag, or weights that do not fit the config (naming the tensor and both shapes).
    """
    path = hf_folder.resolve(path)
    if hf_folder.is_folder(path):
        return _load_folder(path).eval()
    tag = _checkpoint_tag(path)
    if tag is not None:
        return _load_checkpoint(tag).eval()
    payload = read_payload(path)
    if payload["format"] == EXTRACTED_FORMAT:
        return _extracted_from_payload(payload).eval()
    return _full_from_payload(payload).eval()


def load_model(path: str | Path) -> SquadViT:
    """`load` for a full multi-task model: a run folder, ``model.pt`` or checkpoint tag (not an extracted file).

    Returns:
        The `SquadViT` in eval mode, with ``.usage`` and ``.meta`` as described in `load`.

    Raises:
        FileNotFoundError, ValueError: as `load`, and for an extracted single-task file.
    """
    model = load(path)
    if isinstance(model, SingleTaskModel):
        raise ValueError(f"{path} is an extracted single-task model ({model.task}); "
                         f"this needs the full model (the run's model.pt)")
    return model


def load_extracted(path: str | Path) -> SingleTaskModel:
    """`load` for an extracted single-task file (tools/extract.py, `save_extracted`).

    Returns:
        The `SingleTaskModel` in eval mode (``model(images)`` → the task's prediction), with ``.usage`` (None) and
        ``.meta`` as described in `load`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an extracted model (e.g. a full ``model.pt``: use `squad.load`), or its weights do not match
            its config.
    """
    payload = read_payload(path)
    if payload["format"] != EXTRACTED_FORMAT:
        raise ValueError(f"{payload['path']} is a full multi-task model file, not an extracted one; load it with "
                         f"squad.load, or extract a task with tools/extract.py")
    return _extracted_from_payload(payload).eval()


def read_payload(path: str | Path) -> dict:
    """The contents of a squad file (``model.pt`` of a run, or an extracted model), loaded with ``weights_only=True``.

    Args:
        path: the file, or a run folder holding ``model.pt``.

    Returns:
        The file's dict, with ``"path"`` (the file read) added.

    Raises:
        FileNotFoundError: nothing at ``path`` (a run folder without ``model.pt`` names what is missing).
        ValueError: the file is not a squad model (its format is named), or weights_only loading refuses it.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / "model.pt").is_file():
            hint = (f" (it has checkpoints: training has not finished; pass {path / 'checkpoints'} to load the latest "
                    f"complete one)" if (path / "checkpoints").is_dir() else "")
            raise FileNotFoundError(f"{path} holds no model.pt{hint}; pass a run folder after training or a model file")
        path = path / "model.pt"
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    if _is_export(path):
        raise ValueError(f"{path} is a torch.export program (tools/export.py), not a squad model file: load it with "
                         f"torch.export.load(path).module(), which needs no squad (docs/tools.md: Export a model); "
                         f"squad.load opens model.pt, extracted models and checkpoints")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling problem means: not one of our files
        raise ValueError(f"{path}: not a loadable squad model file ({_why(e)})") from e
    fmt = payload.get("format") if isinstance(payload, dict) else None
    if fmt not in (MODEL_FORMAT, EXTRACTED_FORMAT):
        found = fmt if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a squad model file (format {found!r}; expected {MODEL_FORMAT!r} from "
                         f"tools/train.py or {EXTRACTED_FORMAT!r} from tools/extract.py)")
    payload["path"] = str(path)
    return payload


def _is_export(path: Path) -> bool:
    """Whether ``path`` is a ``torch.export.save`` archive (a zip whose ``archive_format`` entry says ``pt2``)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as z:
            marks = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == "archive_format"]
            return any(z.read(n).strip() == b"pt2" for n in marks)
    except (OSError, zipfile.BadZipFile):
        return False


def _model_config(payload: dict, source: str):
    try:
        return load_config({"model": payload["config"]}).model
    except (ConfigError, KeyError, TypeError) as e:
        raise ValueError(f"{source}: its model config is invalid ({e})") from e


def _meta(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if k not in ("state_dict", "usage")}


def _full_from_payload(payload: dict) -> SquadViT:
    """The full model a ``model.pt`` payload describes (meta-device build, shape-checked load)."""
    source = payload.get("path", "model file")
    cfg = _model_config(payload, source)
    state = payload.get("state_dict")
    if not isinstance(state, dict):
        raise ValueError(f"{source}: no state_dict in the file")
    # fp32 whatever the run's precision: a bf16/fp16 run exports half-precision module weights
    state = {k: v.to(torch.float32, copy=True) if v.is_floating_point() else v.clone() for k, v in state.items()}
    model = load_assigned(build_on_meta(cfg), state, source).eval()
    model.usage = ExpertUsage.from_state_dict(payload["usage"]) if payload.get("usage") else None
    model.meta = _meta(payload)
    return model


def _extracted_from_payload(payload: dict) -> SingleTaskModel:
    """The `SingleTaskModel` an extracted file describes: its config, pruned as recorded, then its weights."""
    source = payload.get("path", "extracted model")
    for key in ("task", "config", "kept", "exact", "state_dict"):
        if key not in payload:
            raise ValueError(f"{source}: extracted model file lacks {key!r}")
    cfg = _model_config(payload, source)
    if cfg.task_names != [payload["task"]]:
        raise ValueError(f"{source}: config heads {cfg.task_names} do not match the task {payload['task']!r}")
    model = build_on_meta(cfg)
    kept = {str(k): [int(i) for i in v] for k, v in payload["kept"].items()}
    try:
        keep_experts(model, kept, exact=bool(payload["exact"]))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    load_assigned(model, payload["state_dict"], source)
    model.mone_capacity = float(payload.get("mone_capacity", cfg.mone.capacity))
    return SingleTaskModel(model.eval(), payload["task"], kept, bool(payload["exact"]), usage=None,
                           meta=_meta(payload))


# ------------------------------------------------------------------------------------------ Hugging Face folders
def _load_folder(folder: Path) -> SquadViT | SingleTaskModel:
    """The model of a folder `squad.io.hf_folder.write_folder` wrote (safetensors weights; no pickle)."""
    from squad.models.inference import set_inference

    config = hf_folder.read_config(folder)
    source = str(folder)
    state = hf_folder.read_weights(folder)
    usage = hf_folder.read_usage(folder, config)
    extracted = config.get("extracted")
    payload = {"path": source, "config": config.get("model"), "tasks": config.get("tasks")}
    meta = {k: v for k, v in config.items() if k not in ("usage", "model")}
    meta.update(format=config["format"], path=source, config=config.get("model"))
    if extracted:
        payload.update(format=EXTRACTED_FORMAT, state_dict=state, **extracted)
        model = _extracted_from_payload(payload)
        model.meta = {**meta, **extracted}
    else:
        payload.update(format=MODEL_FORMAT, state_dict=state, usage=usage, extra=config.get("extra") or {})
        model = _full_from_payload(payload)
        model.meta = {**meta, "extra": config.get("extra") or {}}
    inference = {k: v for k, v in (config.get("inference") or {}).items() if k in ("mone_capacity", "mod_inference")}
    if inference:
        set_inference(model, **inference)
    return model


# ------------------------------------------------------------------------------------------ DeepSpeed checkpoints
def _checkpoint_tag(path: Path) -> Path | None:
    """The checkpoint tag folder ``path`` names (a tag, its model-states file, or a ``checkpoints/`` folder), else
    None (a run folder or a squad file)."""
    if path.is_dir() and (path / "model.pt").is_file():
        return None
    return checkpoint_tag(path)


def _load_checkpoint(tag: Path) -> SquadViT:
    """The `SquadViT` of a complete DeepSpeed checkpoint tag, configured by the ``config.yaml`` in the tag (written
    since issue 37), else by its run's."""
    if marked_step(tag) is None:
        raise ValueError(f"{tag}: incomplete checkpoint (no {COMPLETE} marker: the save was interrupted); load an "
                         f"earlier tag, or {tag.parent} for the latest complete one")
    file = model_states_file(tag)
    if not file.is_file():
        raise FileNotFoundError(f"{tag}: no {MODEL_STATES} in this checkpoint")
    cfg_file = tag / TAG_CONFIG  # the config it was trained with (tags of earlier versions: the run's only)
    if not cfg_file.is_file():
        cfg_file = tag.parent.parent / "config.yaml"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{tag}: the run's {cfg_file} is missing (the checkpoint holds no {TAG_CONFIG} of "
                                f"its own)")
    try:
        run_cfg = load_config(cfg_file, cls=RunConfig)
    except ConfigError as e:
        raise ValueError(f"{cfg_file}: {e}") from e
    states = _load_model_states(file)
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict):
        raise ValueError(f"{file}: no module weights in this DeepSpeed checkpoint")
    if is_zero3_tag(tag):  # the weights are partitioned over the ranks' optimizer files: put them back together
        module = fp32_state_dict(tag)
    model = build_on_meta(run_cfg.model)
    own = model.state_dict()
    state = {}
    for key, value in module.items():  # the engine wraps the model in the training objective: "model.<name>"
        if key.startswith("model."):
            key = key[len("model."):]
            if key in own and value.is_floating_point() and own[key].is_floating_point():
                value = value.to(own[key].dtype)  # bf16/fp16 training saves half-precision module weights
            state[key] = value
    state.update(whole_experts(tag))  # an expert-parallel run's experts, from its shard files
    load_assigned(model, state, str(file)).eval()
    loop = states.get("loop") or {}
    log_vars = module.get("weighting.log_vars")  # the objective's learned task weights (uncertainty weighting)
    model.usage = ExpertUsage.from_state_dict(states["usage"]) if states.get("usage") else None
    model.meta = {"format": CHECKPOINT_FORMAT, "path": str(tag), "config": to_dict(run_cfg.model),
                  "tasks": list(model.task_names),
                  "extra": {"step": loop.get("step", states.get("global_steps")), "tag": tag.name,
                            "trained_tasks": run_cfg.train_tasks(), "loop": dict(loop),
                            "task_log_vars": log_vars.detach().float().cpu() if log_vars is not None else None}}
    return model


def _load_model_states(file: Path) -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed model-states file, with exactly DeepSpeed's plain records
    allowed beside the weights (`squad.io.checkpoints.load_checkpoint_file`, which training's resume uses too)."""
    return load_checkpoint_file(file)


def _why(error: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its own message is a page long)."""
    return refusal_reason(error)


# ------------------------------------------------------------------------------------------------------ saving
def export_model(path: str | Path, model: SquadViT, usage: ExpertUsage | None, extra: dict | None = None,
                 state: dict | None = None) -> Path:
    """Writes a ``model.pt`` (format ``squad.model/1``): config, tasks, weights, expert usage, ``extra``.

    Args:
        path: the file to write (its folder is created).
        model: the model to save (its weights are copied to the CPU).
        usage: expert-usage statistics to save with it, or None.
        extra: plain data (numbers, strings, lists, dicts, tensors) stored under ``extra``.
        state: the weights to write (default ``model.state_dict()``; an expert-parallel run passes its experts
            gathered, `squad.layers.parallel.full_state_dict`).

    Returns:
        ``path``; the file loads with `load` (or ``torch.load(weights_only=True)``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in (model.state_dict() if state is None else state).items()}
    payload = {
        "format": MODEL_FORMAT,
        "config": to_dict(model.cfg),
        "tasks": list(model.task_names),
        "state_dict": state,
        "usage": usage.state_dict() if usage is not None else None,
        "extra": extra or {},
    }
    atomic_torch_save(payload, path, "the model file")
    return path


def save_extracted(path: str | Path, ext: SingleTaskModel, report: dict | None = None) -> Path:
    """Writes an extracted model (format ``squad.extracted/1``): config, kept experts, routing mode, weights, report.

    Args:
        path: the file to write (its folder is created).
        ext: the extracted model.
        report: the extraction report (stored as plain data).

    Returns:
        ``path``; the file loads with `load` / `load_extracted` (``weights_only=True``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": EXTRACTED_FORMAT,
        "task": ext.task,
        "config": to_dict(ext.model.cfg),
        "kept": {k: list(v) for k, v in ext.kept.items()},
        "exact": bool(ext.exact),
        "mone_capacity": float(ext.model.mone_capacity),
        "state_dict": {k: v.detach().cpu().contiguous() for k, v in ext.model.state_dict().items()},
        "report": _plain(report or {}),
    }
    atomic_torch_save(payload, path, "the extracted model")
    return path


def _plain(obj):
    """JSON-like data only (what weights_only loading accepts)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)

