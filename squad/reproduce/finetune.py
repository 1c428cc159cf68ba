"""router-finetune's fine-tunes (Mod-Squad Fig. 4), every mode on equal terms, run by the shipped tool's code.

A new task is learned onto a model pretrained without it from a share of its training split, in the four modes of
`squad.posttrain.finetune` (router, head, full, linear-probe), each by `squad.posttrain.finetune.finetune_once` —
what tools/finetune_router.py runs — with the same budget and rule (`FairFinetune`): AdamW at a constant lr for
``steps`` steps of ``batch`` images; the images of a fraction are split into the images it learns from and a
held-out share (``holdout``) that picks the lr from ``lrs`` and the stopping point — the held-out metric is measured
``evals`` times along each fine-tune and the best evaluation's weights are kept (the tool's held-out selection,
``--holdout --lrs --evals``). Only the chosen model of each mode and fraction is scored on the validation split.
Fractions are nested (`squad.posttrain.subsets.subset_indices`).

`finetune_task` is one held-out task of one pretrained run, every fraction and mode; it writes its result with the
settings it was made with (``key``), and `load_cached` reuses a result only when they match.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from squad.config.tools import FinetuneConfig
from squad.data import eval_loader
from squad.eval.evaluate import evaluate, model_dataset
from squad.io import load_model
from squad.models.surgery import with_new_task
from squad.posttrain.finetune import MODES, base_without, finetune_once
from squad.posttrain.subsets import class_labels, subset_indices


@dataclasses.dataclass(frozen=True)
class FairFinetune:
    """The budget and the rule every mode shares."""

    fractions: tuple[float, ...]
    steps: int
    batch: int
    lrs: tuple[float, ...]
    holdout: float  # share of a fraction's images held out to pick the lr and the stopping step
    evals: int  # held-out evaluations along each fine-tune
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.evals < 1 or not self.lrs or not self.fractions:
            raise ValueError(f"router-finetune needs steps, batch, evals >= 1 and some lrs and fractions: {self}")
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"router-finetune: holdout must be in (0, 1), got {self.holdout}")

    def finetune_config(self, device: str = "cpu") -> FinetuneConfig:
        """The shipped tool's settings for these: held-out selection of the lr and the stopping step."""
        return FinetuneConfig(steps=self.steps, batch_size=self.batch, lr=self.lrs[0], lrs=tuple(self.lrs),
                              holdout=self.holdout, evals=self.evals, seed=self.seed)

    def key(self) -> dict:
        """Everything the result depends on (with the run's settings and the data, which the caller adds): these
        settings and the tool's config they make."""
        settings = dataclasses.asdict(self)
        settings["tool"] = {k: v for k, v in dataclasses.asdict(self.finetune_config()).items() if k != "device"}
        return json.loads(json.dumps(settings))


def chance_level(data: str | Path, base, task: str) -> float:
    """The primary metric (top-1 accuracy, %) of always answering the training split's most frequent class, on the
    validation split: what a model that learned nothing about the images scores."""
    train_set = model_dataset(base, data, [task], "train")
    val_set = model_dataset(base, data, [task], "val")
    labels = class_labels(train_set, task)
    labels = labels[labels >= 0]
    if labels.numel() == 0:
        raise ValueError(f"{task}: no valid label in the training split")
    top = int(torch.bincount(labels).argmax())
    val = class_labels(val_set, task)
    val = val[val >= 0]
    return 100.0 * float((val == top).float().mean()) if val.numel() else math.nan


def finetune_task(run_dir: str | Path, task: str, data: str | Path, cfg: FairFinetune, out: str | Path,
                  key: dict, device: str = "cpu") -> dict:
    """Learns ``task`` onto the run's model at every fraction in every mode (`finetune_once` with held-out
    selection) and scores the chosen models on the validation split; writes the result to ``out``.

    Returns:
        ``{"key", "task", "metric", "lower_is_better", "untrained", "chance", "rows": [...], "table":
        {mode: {fraction: metric}}, "images": {fraction: {"fit", "held", "total"}}}``.
    """
    full = load_model(run_dir)
    trained = (getattr(full, "meta", {}) or {}).get("extra", {}).get("trained_tasks")
    base, _ = base_without(full, task, trained, False)
    base.to(device).eval()
    tool = dataclasses.replace(cfg.finetune_config(), device=device)
    train_set = model_dataset(base, data, [task], "train")
    val_loader = eval_loader(model_dataset(base, data, [task], "val"), cfg.batch)
    first = with_new_task(base, task, tool.init, cfg.seed).to(device)  # the new task's head and routing, untrained
    spec = first.get_task(task)
    untrained = evaluate(first, val_loader, [task], device)[task]
    result = {"key": key, "task": spec.name, "metric": spec.primary_metric, "lower_is_better": spec.lower_is_better,
              "untrained": untrained, "chance": chance_level(data, base, task) if spec.head_kind == "class" else None,
              "train_images_total": len(train_set), "rows": [], "table": {}, "images": {}}
    for fraction in cfg.fractions:
        label = f"{fraction:g}"
        idx = subset_indices(len(train_set), fraction=fraction, seed=cfg.seed)
        for mode in MODES:
            row, _ = finetune_once(base, task, mode, train_set, idx, val_loader, tool)
            primary = row["metrics"].get(spec.primary_metric)
            result["images"][label] = {"total": row["train_images"], "fit": row["fit_images"],
                                       "held": row["held_images"]}
            result["rows"].append({"mode": mode, "fraction": fraction, "size": label, "lr": row["lr"],
                                   "best_step": row["best_step"], "metrics": row["metrics"], "primary": primary,
                                   "held": row["held"], "curve": row["curve"]})
            result["table"].setdefault(mode, {})[label] = primary
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def load_cached(out: str | Path, key: dict) -> dict | None:
    """The result in ``out`` if it was made with exactly ``key``'s settings, else None."""
    path = Path(out)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return None
    return data if data.get("key") == json.loads(json.dumps(key)) else None
