"""Single-task subnetwork extraction (Mod-Squad §3.4): one task's router, embedding and head, and only the experts
that task uses, as a standalone model file that loads without DeepSpeed.

    ext = extract(model, "depth", usage, theta=0.01)   # usage: calibration pass or the run's saved statistics
    save_extracted("depth.pt", ext)
    ext = squad.load_extracted("depth.pt")              # weights_only; model(images) → depth prediction
    depth = ext(images)                                 # [B, 1, H, W]

The task's usage frequencies come from a calibration pass over its data (`collect_usage`, the default in
tools/extract.py) or from the statistics saved in ``model.pt``; `squad.pruning` decides and slices. MoD and MoNE
parts stay as they are. The file holds the single-task config, the kept experts per layer, the routing mode and
the weights; `load_extracted` rebuilds the model from the config, applies the same pruning and loads the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn as nn

from squad.checkpoint import atomic_torch_save
from squad.config import load_config
from squad.configbase import ConfigError, to_dict
from squad.loading import EXTRACTED_FORMAT, read_payload
from squad.model import SquadViT
from squad.pruning import choose_experts, prunable_layers, prune_model, pruned_summary, task_frequencies
from squad.surgery import build_on_meta, load_assigned, select_tasks
from squad.usage import ExpertUsage

log = logging.getLogger(__name__)


class SingleTaskModel(nn.Module):
    """An extracted model: ``model(images)`` → the task's prediction ([B, C, H, W] dense, [B, C] class logits).

    Attributes:
        model: the pruned single-task `SquadViT` (``model.model(images, [task])`` gives the full `SquadOutput`).
        task: the task's canonical name.
        kept: layer name → kept expert indices (numbering of the original model).
        exact: exact routing (the router scores every original expert) or the paper's renormalised softmax.
    """

    def __init__(self, model: SquadViT, task: str, kept: dict[str, list[int]], exact: bool):
        super().__init__()
        self.model = model
        self.task = task
        self.kept = {k: list(v) for k, v in kept.items()}
        self.exact = exact

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, C, H, W] → the task's prediction."""
        return self.model(images, [self.task]).preds[self.task]

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Final normed tokens [B, N, D]."""
        return self.model.forward_features(images, self.task)


# --------------------------------------------------------------------------------------------- usage
def _images(batch) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict) and "rgb" in batch:
        return batch["rgb"]
    raise TypeError(f"calibration batches must be image tensors or data batches with 'rgb', got {type(batch)}")


@torch.no_grad()
def collect_usage(model: SquadViT, task: str, batches: Iterable, max_batches: int = 0,
                  device: torch.device | str | None = None) -> ExpertUsage:
    """Expert usage of ``task`` over calibration batches (the model in eval mode, as at inference).

    Args:
        model: the full model.
        task: the task (name or alias).
        batches: image tensors [B, C, H, W] or batches from `squad.data.collate`.
        max_batches: stop after this many (0 = all).
        device: where to run (default: the model's device).

    Returns:
        `ExpertUsage` over the model's tasks, filled for ``task`` only.
    """
    (t,) = model.task_index([task])
    name = model.task_names[t]
    device = device or next(model.parameters()).device
    usage = ExpertUsage(model.task_names)
    was = model.training
    model.eval()
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            usage.update(model(_images(batch).to(device), [name]).stats)
    finally:
        model.train(was)
    if not usage.counts:
        raise ValueError("collect_usage: no calibration batches (or the model has no routed layers)")
    return usage


# ------------------------------------------------------------------------------------------ extraction
def extract(model: SquadViT, task: str, usage: ExpertUsage, theta: float | None = 0.01, keep_top: float | None = None,
            renormalize: bool = False) -> SingleTaskModel:
    """Extracts ``task``'s subnetwork from a multi-task model (which is left unchanged).

    Args:
        model: the full model.
        task: task name or alias.
        usage: its expert usage (calibration pass or saved statistics).
        theta: remove experts used by at most θ of the task's tokens (θ in [0, 1)); ignored with ``keep_top``.
        keep_top: keep the top H share of experts per layer instead (H in (0, 1]).
        renormalize: the paper's pruned router (softmax over the kept experts) instead of exact routing.

    Returns:
        The extracted `SingleTaskModel` (eval mode).
    """
    (t,) = model.task_index([task])
    name = model.task_names[t]
    freqs = task_frequencies(usage, name, model)
    kept = choose_experts(freqs, None if keep_top is not None else theta, keep_top)
    single = select_tasks(model, [name])
    prune_model(single, kept, exact=not renormalize)
    return SingleTaskModel(single.eval(), name, kept, exact=not renormalize)


def save_extracted(path: str | Path, ext: SingleTaskModel, report: dict | None = None) -> Path:
    """Writes an extracted model (config, kept experts, routing mode, weights, report); weights_only-loadable."""
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
    atomic_torch_save(payload, path)
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


def extracted_from_payload(payload: dict) -> SingleTaskModel:
    """Rebuilds an extracted model from its file contents (see `load_extracted`)."""
    source = payload.get("path", "extracted model")
    for key in ("task", "config", "kept", "exact", "state_dict"):
        if key not in payload:
            raise ValueError(f"{source}: extracted model file lacks {key!r}")
    try:
        cfg = load_config({"model": payload["config"]}).model
    except (ConfigError, TypeError) as e:
        raise ValueError(f"{source}: its model config is invalid ({e})") from e
    if cfg.task_names != [payload["task"]]:
        raise ValueError(f"{source}: config heads {cfg.task_names} do not match the task {payload['task']!r}")
    model = build_on_meta(cfg)
    kept = {str(k): [int(i) for i in v] for k, v in payload["kept"].items()}
    try:
        prune_model(model, kept, exact=bool(payload["exact"]))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e
    load_assigned(model, payload["state_dict"], source)
    model.mone_capacity = float(payload.get("mone_capacity", cfg.mone.capacity))
    return SingleTaskModel(model.eval(), payload["task"], kept, bool(payload["exact"]))


def load_extracted(path: str | Path) -> SingleTaskModel:
    """Loads a file written by `save_extracted` / tools/extract.py (no DeepSpeed, ``weights_only=True``).

    Returns:
        The `SingleTaskModel` in eval mode: ``model(images)`` → the task's prediction.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not an extracted model (e.g. a full ``model.pt``: use `squad.load_model`), or its weights do
            not match its config.
    """
    payload = read_payload(path)
    if payload.get("format") != EXTRACTED_FORMAT:
        raise ValueError(f"{payload['path']} is a full multi-task model file, not an extracted one; load it with "
                         f"squad.load_model, or extract a task with tools/extract.py")
    return extracted_from_payload(payload)


def kept_counts(model: nn.Module) -> dict[str, int]:
    """Layer → experts it holds now (for reports)."""
    return {name: layer.num_experts for name, layer in prunable_layers(model).items()}


def layer_report(ext: SingleTaskModel, full: SquadViT) -> dict[str, dict]:
    """Per MoE layer: kind, kept experts (original numbering), experts before/after, top-k after."""
    return pruned_summary(ext.model, ext.kept, kept_counts(full))
