"""router-finetune's fine-tunes (Mod-Squad Fig. 4), every mode on equal terms.

A new task is learned onto a model pretrained without it (`squad.posttrain.finetune.with_new_task`: a fresh head,
its task embedding and router rows initialised as the mean of the other tasks') from a share of its training split,
in four modes:

* ``router``: the new task's router rows, task embedding and head (`squad.posttrain.finetune.select_trainable`);
* ``head``: the head only (routing stays at its initialisation);
* ``full``: every parameter;
* ``linear-probe``: a linear layer on the frozen model's mean-pooled features (the new task's routing),
  standardised by the statistics of the images it learns from.

Every mode gets the same budget and the same rule (`FairFinetune`): AdamW at a constant lr for ``steps`` steps of
``batch`` images; the images of a fraction are split into the images it learns from and a held-out share
(``holdout``) that picks the lr from ``lrs`` and the stopping point — the held-out metric is measured ``evals`` times
along each fine-tune and the best evaluation's weights are kept. Only the chosen model of each mode and fraction is
scored on the validation split. Fractions are nested (a seeded permutation of the training split, the first
ceil(fraction · N) images: `squad.posttrain.finetune.subset_indices`).

`finetune_task` is one held-out task of one pretrained run, every fraction and mode; it writes its result with the
settings it was made with (``key``), and `load_cached` reuses a result only when they match.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

from squad.data import collate, eval_loader
from squad.eval.evaluate import model_dataset
from squad.eval.metrics import MetricAccumulator
from squad.io import load_model
from squad.models.surgery import with_new_task
from squad.posttrain.finetune import base_without, class_labels, select_trainable, subset_indices

MODES = ("router", "head", "full", "linear-probe")


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

    def key(self) -> dict:
        """Everything the result depends on (with the run's settings and the data, which the caller adds)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def holdout_split(indices: list[int], share: float, seed: int) -> tuple[list[int], list[int]]:
    """(images learned from, held-out images) of a training subset: a seeded shuffle, the first ``share`` held out
    (at least one image on each side).

    Raises:
        ValueError: fewer than 2 images.
    """
    n = len(indices)
    if n < 2:
        raise ValueError(f"a fraction of {n} image(s) cannot be split into learning and held-out images")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    k = min(n - 1, max(1, round(share * n)))
    held = [indices[i] for i in order[:k]]
    fit = [indices[i] for i in order[k:]]
    return fit, held


@torch.no_grad()
def _pooled(model, task: str, images: torch.Tensor) -> torch.Tensor:
    prefix = int(model.cfg.class_token)
    return model.forward_features(images, task)[:, prefix:].mean(1).float()


@torch.no_grad()
def _metrics(predict: Callable[[torch.Tensor], torch.Tensor], spec, loader, device: str) -> dict[str, float]:
    acc = MetricAccumulator([spec])
    for batch in loader:
        pred = predict(batch["rgb"].to(device))
        target = spec.target(batch["targets"][spec.name].to(device))
        acc.update(spec.name, spec.metric_sums(pred.float(), target, batch["masks"][spec.name].to(device)))
    return acc.compute(reduce=False).get(spec.name, {})


def _cycle(loader: DataLoader):
    while True:
        yield from loader


def fit_mode(base, task: str, mode: str, train_set, fit: list[int], held_loader, lr: float, cfg: FairFinetune,
             device: str, probe_stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """One mode at one lr: ``cfg.steps`` AdamW steps on ``fit``, the held-out metric every ``steps / evals`` steps,
    the best evaluation's weights kept. Returns ``{"lr", "best_step", "held" (oriented: higher is better), "curve",
    "predict" (the chosen model's prediction function), "model"}``."""
    model = with_new_task(base, task, "mean", cfg.seed).to(device)
    spec = model.get_task(task)
    sign = -1.0 if spec.lower_is_better else 1.0
    if mode == "linear-probe":
        if spec.head_kind != "class":
            raise ValueError(f"linear-probe needs a class task; {task} is {spec.head_kind}")
        for p in model.parameters():
            p.requires_grad_(False)
        mean, std = probe_stats
        fc = nn.Linear(mean.numel(), spec.channels).to(device)
        nn.init.zeros_(fc.weight)
        nn.init.zeros_(fc.bias)
        trainable = dict(fc.named_parameters())

        def predict(images: torch.Tensor) -> torch.Tensor:
            return fc((_pooled(model, task, images) - mean) / std)

        def set_mode(training: bool) -> None:
            model.eval()
            fc.train(training)
    else:
        trainable = select_trainable(model, task, mode)

        def predict(images: torch.Tensor) -> torch.Tensor:
            return model(images, [task]).preds[task]

        def set_mode(training: bool) -> None:
            model.train(training)
    opt = torch.optim.AdamW(list(trainable.values()), lr=lr, weight_decay=0.0)
    loader = DataLoader(Subset(train_set, fit), batch_size=min(cfg.batch, len(fit)), shuffle=True,
                        collate_fn=collate, generator=torch.Generator().manual_seed(cfg.seed))
    batches = _cycle(loader)
    every = max(1, cfg.steps // cfg.evals)
    torch.manual_seed(cfg.seed)
    best = {"held": -math.inf, "best_step": 0, "state": None}
    curve = []
    for step in range(1, cfg.steps + 1):
        set_mode(True)
        batch = next(batches)
        pred = predict(batch["rgb"].to(device))
        loss = spec.loss(pred.float(), spec.target(batch["targets"][spec.name].to(device)),
                         batch["masks"][spec.name].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == cfg.steps:
            set_mode(False)
            held = _metrics(predict, spec, held_loader, device).get(spec.primary_metric, math.nan)
            score = sign * held if math.isfinite(held) else -math.inf
            curve.append((step, held))
            if score > best["held"]:
                best = {"held": score, "best_step": step,
                        "state": {n: p.detach().clone() for n, p in trainable.items()}}
    if best["state"] is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(best["state"][n])
    set_mode(False)
    for p in model.parameters():
        p.requires_grad_(False)
    return {"lr": lr, "best_step": best["best_step"], "held": best["held"], "curve": curve, "predict": predict,
            "model": model}


@torch.no_grad()
def probe_statistics(base, task: str, train_set, fit: list[int], batch: int, device: str):
    """Mean and standard deviation of the pooled features of the images a probe learns from (the new task's routing
    at its initialisation, as `fit_mode` uses it)."""
    model = with_new_task(base, task, "mean", 0).to(device).eval()
    feats = torch.cat([_pooled(model, task, b["rgb"].to(device))
                       for b in DataLoader(Subset(train_set, fit), batch_size=batch, collate_fn=collate)])
    return feats.mean(0), feats.std(0, unbiased=False).clamp_min(1e-6)


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
    """Learns ``task`` onto the run's model at every fraction in every mode (`fit_mode` at each lr, the best on the
    held-out images kept) and scores the chosen models on the validation split; writes the result to ``out``.

    Returns:
        ``{"key", "task", "metric", "lower_is_better", "untrained", "chance", "rows": [...], "table":
        {mode: {fraction: metric}}, "images": {fraction: {"fit", "held", "total"}}}``.
    """
    full = load_model(run_dir)
    trained = (getattr(full, "meta", {}) or {}).get("extra", {}).get("trained_tasks")
    base, _ = base_without(full, task, trained, False)
    base.to(device).eval()
    train_set = model_dataset(base, data, [task], "train")
    val_loader = eval_loader(model_dataset(base, data, [task], "val"), cfg.batch)
    first = with_new_task(base, task, "mean", cfg.seed).to(device)  # the new task's head and routing, untrained
    spec = first.get_task(task)
    untrained = _metrics(lambda x: first(x, [task]).preds[task], spec, val_loader, device)
    result = {"key": key, "task": spec.name, "metric": spec.primary_metric, "lower_is_better": spec.lower_is_better,
              "untrained": untrained, "chance": chance_level(data, base, task) if spec.head_kind == "class" else None,
              "train_images_total": len(train_set), "rows": [], "table": {}, "images": {}}
    for fraction in cfg.fractions:
        label = f"{fraction:g}"
        idx = subset_indices(len(train_set), fraction=fraction, seed=cfg.seed)
        fit, held = holdout_split(idx, cfg.holdout, cfg.seed)
        held_loader = eval_loader(Subset(train_set, held), cfg.batch)
        result["images"][label] = {"total": len(idx), "fit": len(fit), "held": len(held)}
        stats = probe_statistics(base, task, train_set, fit, cfg.batch, device)
        for mode in MODES:
            tries = [fit_mode(base, task, mode, train_set, fit, held_loader, lr, cfg, device, stats)
                     for lr in cfg.lrs]
            chosen = max(tries, key=lambda r: r["held"])  # the first lr wins a tie
            metrics = _metrics(chosen["predict"], spec, val_loader, device)
            primary = metrics.get(spec.primary_metric)
            result["rows"].append({"mode": mode, "fraction": fraction, "size": label, "lr": chosen["lr"],
                                   "best_step": chosen["best_step"], "metrics": metrics, "primary": primary,
                                   "held": {f"{r['lr']:g}": (-1 if spec.lower_is_better else 1) * r["held"]
                                            for r in tries},
                                   "curve": chosen["curve"]})
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
