"""Router fine-tuning (Mod-Squad §4.3): learn a new task on a frozen multi-task model from a little data.

The new task gets a head, a task embedding and its rows in every per-task router (MoE attention, MoE MLP, MoD
learned routers, MoNE routers) via `squad.models.surgery.add_task`; those rows are separate parameters, so the rest of
the model
is frozen for real — ``requires_grad=False``, absent from the optimizer, and checked bitwise unchanged afterwards
(the authors' script set ``requires_grad`` on modules, which does nothing, so their experts trained too).

Modes, for the paper's comparison:

* ``router``: the new task's router rows, task embedding and head;
* ``head``: the head only (routing stays at its initialisation);
* ``full``: every parameter of the model;
* ``linear-probe``: logistic regression on frozen pooled features (class tasks).

Training subsets are deterministic: a seeded permutation of the task's training split, of which the first
``ceil(fraction · N)`` images are used (so smaller fractions are subsets of larger ones), or ``shots`` images per
class (class = argmax of the label distribution).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

from squad.data import collate, eval_loader
from squad.eval.evaluate import evaluate, model_dataset
from squad.io import export_model
from squad.io.files import atomic_write_text
from squad.models.surgery import added_task_parameters, merge_added_tasks, select_tasks, with_new_task
from squad.models.vit import SquadViT
from squad.tasks import TASK_NAMES, get_task

log = logging.getLogger(__name__)
MODES = ("router", "head", "full", "linear-probe")


@dataclasses.dataclass
class FinetuneConfig:
    """Optimisation settings shared by every (mode, subset) run."""

    steps: int = 200  # optimiser steps (linear-probe: L-BFGS iterations)
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    init: str = "mean"  # new router rows / embedding: mean of the existing tasks', zero, or random
    probe_l2: float = 1e-4  # L2 penalty of the linear probe
    seed: int = 0
    eval_batches: int = 0  # 0 = the whole evaluation split
    device: str = "cpu"
    workers: int = 0
    verify_frozen: bool = True  # compare every frozen parameter bitwise after training

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.init not in ("mean", "zero", "random"):
            raise ValueError(f"init must be mean, zero or random, got {self.init!r}")


# ------------------------------------------------------------------------------------------------ subsets
def class_labels(dataset, task: str) -> torch.Tensor:
    """[N] class of every sample (argmax of its label distribution; -1 where the label is invalid).

    Reads only the label files (not the images).
    """
    spec = get_task(task, getattr(dataset, "task_options", None))
    if spec.head_kind != "class":
        raise ValueError(f"shots per class need a class task; {spec.name} is {spec.head_kind}")
    labels = []
    for i in range(len(dataset)):
        value, mask = spec.decode(dataset._read(i, spec.domain))
        labels.append(int(value.argmax()) if bool(mask.all()) else -1)
    return torch.tensor(labels, dtype=torch.long)


def subset_indices(n: int, fraction: float | None = None, shots: int | None = None,
                   labels: torch.Tensor | None = None, seed: int = 0) -> list[int]:
    """Deterministic training subset of a dataset of ``n`` samples.

    Args:
        n: dataset size.
        fraction: share of the samples in (0, 1]: the first ceil(fraction · n) of a seeded permutation.
        shots: instead, this many samples per class (``labels`` needed), in permutation order.
        labels: [n] class per sample (-1 = unusable).
        seed: permutation seed.

    Raises:
        ValueError: neither or both of fraction and shots, or values out of range.
    """
    if (fraction is None) == (shots is None):
        raise ValueError("give exactly one of fraction or shots")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        return order[: max(1, math.ceil(fraction * n - 1e-9))]
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    if labels is None or labels.numel() != n:
        raise ValueError("shots per class need one label per sample")
    taken: dict[int, int] = {}
    out = []
    for i in order:
        c = int(labels[i])
        if c >= 0 and taken.get(c, 0) < shots:
            taken[c] = taken.get(c, 0) + 1
            out.append(i)
    if not out:
        raise ValueError("no sample has a valid class label")
    return out


# --------------------------------------------------------------------------------------------- the model
def select_trainable(model: SquadViT, task: str, mode: str) -> dict[str, nn.Parameter]:
    """Freezes everything a ``mode`` does not train and returns name → trainable parameter."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if mode == "full":
        names = {n for n, _ in model.named_parameters()}
    else:
        names = {f"heads.{task}.{n}" for n, _ in model.heads[task].named_parameters()}
        if mode == "router":
            names |= set(added_task_parameters(model))
    trainable = {}
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
        if n in names:
            trainable[n] = p
    return trainable


def _cycle(loader: DataLoader):
    while True:
        yield from loader


def make_optimizer(trainable: dict[str, nn.Parameter], cfg: FinetuneConfig) -> torch.optim.Optimizer:
    """AdamW over exactly the trainable parameters (frozen ones are not even registered with it)."""
    return torch.optim.AdamW(list(trainable.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)


def train_new_task(model: SquadViT, task: str, loader: DataLoader, trainable: dict[str, nn.Parameter],
                   cfg: FinetuneConfig) -> list[float]:
    """Trains ``trainable`` on the task's loss for ``cfg.steps`` steps (model in train mode); returns the losses."""
    spec = model.get_task(task)
    opt = make_optimizer(trainable, cfg)
    losses = []
    model.train()
    batches = _cycle(loader)
    for _ in range(cfg.steps):
        batch = next(batches)
        images = batch["rgb"].to(cfg.device)
        pred = model(images, [task]).preds[task]
        loss = spec.loss(pred.float(), spec.target(batch["targets"][task].to(cfg.device)),
                         batch["masks"][task].to(cfg.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


# ------------------------------------------------------------------------------------------- linear probe
@torch.no_grad()
def pooled_features(model: SquadViT, task: str, loader: DataLoader, device: str, max_batches: int = 0):
    """Mean-pooled patch tokens [N, D] of the frozen model (the task's routing), with targets and masks."""
    model.eval()
    prefix = int(model.cfg.class_token)
    feats, targets, masks = [], [], []
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        tokens = model.forward_features(batch["rgb"].to(device), task)  # [B, N, D]
        feats.append(tokens[:, prefix:].mean(1).float().cpu())
        targets.append(batch["targets"][task])
        masks.append(batch["masks"][task])
    return torch.cat(feats), torch.cat(targets), torch.cat(masks)


def linear_probe(model: SquadViT, task: str, train_loader: DataLoader, eval_loader: DataLoader,
                 cfg: FinetuneConfig) -> tuple[dict[str, float], float]:
    """Logistic regression (soft-target cross-entropy, L2) on frozen pooled features; returns (metrics, loss)."""
    spec = model.get_task(task)
    if spec.head_kind != "class":
        raise ValueError(f"linear-probe is logistic regression on pooled features and needs a class task; {task} is "
                         f"{spec.head_kind} (for dense tasks, mode 'head' trains the linear head on frozen features)")
    x, y, m = pooled_features(model, task, train_loader, cfg.device)
    mean, std = x.mean(0), x.std(0, unbiased=False).clamp_min(1e-6)
    x = (x - mean) / std
    target = spec.target(y)
    probe = nn.Linear(x.shape[1], spec.channels)
    nn.init.zeros_(probe.weight)
    nn.init.zeros_(probe.bias)
    opt = torch.optim.LBFGS(probe.parameters(), lr=1.0, max_iter=cfg.steps, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = spec.loss(probe(x), target, m) + cfg.probe_l2 * probe.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        final = float(spec.loss(probe(x), target, m))
    xe, ye, me = pooled_features(model, task, eval_loader, cfg.device, cfg.eval_batches)
    with torch.no_grad():
        sums = spec.metric_sums(probe((xe - mean) / std), spec.target(ye), me)
    return spec.metrics(sums), final


# ----------------------------------------------------------------------------------------------- one run
def finetune_once(base: SquadViT, task: str, mode: str, train_set, indices: Sequence[int], eval_loader: DataLoader,
                  cfg: FinetuneConfig) -> tuple[dict, SquadViT | None]:
    """One (mode, subset) run from ``base``; returns its result row and the fine-tuned model (None for probes)."""
    model = with_new_task(base, task, cfg.init, cfg.seed).to(cfg.device)
    loader = DataLoader(Subset(train_set, list(indices)), batch_size=min(cfg.batch_size, len(indices)),
                        shuffle=True, collate_fn=collate, num_workers=cfg.workers,
                        generator=torch.Generator().manual_seed(cfg.seed))
    row = {"mode": mode, "train_images": len(indices)}
    if mode == "linear-probe":
        for p in model.parameters():
            p.requires_grad_(False)
        metrics, loss = linear_probe(model, task, loader, eval_loader, cfg)
        row.update(metrics=metrics, final_loss=loss, trainable_params=(model.cfg.embed_dim + 1) *
                   model.get_task(task).channels, frozen_unchanged=True)
        return row, None
    trainable = select_trainable(model, task, mode)
    frozen = ({n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}
              if cfg.verify_frozen else {})
    torch.manual_seed(cfg.seed)
    losses = train_new_task(model, task, loader, trainable, cfg)
    unchanged = all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    if cfg.verify_frozen and not unchanged:
        raise RuntimeError(f"mode {mode}: a frozen parameter changed during training")
    metrics = evaluate(model, eval_loader, [task], cfg.device, cfg.eval_batches)[task]
    row.update(metrics=metrics, final_loss=losses[-1], trainable_params=sum(p.numel() for p in trainable.values()),
               frozen_unchanged=unchanged if cfg.verify_frozen else None)
    for p in model.parameters():
        p.requires_grad_(True)
    return row, model




def base_without(model: SquadViT, task: str, trained: Sequence[str] | None, replace: bool) -> tuple[SquadViT, str]:
    """The model to add ``task`` to, and a note on what was done.

    A model that has a head for ``task`` is only accepted if that head was never trained (the run's
    ``trained_tasks`` lack it) or ``replace`` is set; the task's head and router rows are then removed first.
    """
    if task not in model.task_names:
        return model, "new task"
    untrained = trained is not None and task not in trained
    if not (untrained or replace):
        raise ValueError(f"the model was trained with {task}; router fine-tuning learns a task the model has not "
                         f"seen (train without it, e.g. --set data.tasks=[...]) or pass replace=True (--replace) to "
                         f"drop its head and router rows and learn them again")
    others = [t for t in model.task_names if t != task]
    if not others:
        raise ValueError(f"{task} is the model's only task; nothing would remain to fine-tune from")
    note = "untrained head of the checkpoint replaced" if untrained else "trained head and routers dropped (--replace)"
    return select_tasks(model, others), note


def train_without_hint(checkpoint: str | Path, task: str, config: str = "configs/demo.yaml") -> str:
    """How to make the model router fine-tuning starts from: a run trained on every task but ``task``."""
    path = Path(checkpoint)
    run = path.parent if path.suffix == ".pt" else path
    others = ",".join(t for t in TASK_NAMES if t != get_task(task).name)
    return (f"router fine-tuning starts from a model trained without {task}: train one first, e.g. with the demo "
            f"config on every task but {task}: python tools/train.py --config {config} --out {run} "
            f"--set 'data.tasks=[{others}]'")


def check_request(task: str, modes: Sequence[str], fractions: Sequence[float] | None, shots: Sequence[int] | None,
                  cfg: FinetuneConfig) -> list[tuple[str, float | int]]:
    """Checks a `finetune_table` request before any work; returns its subset sizes (``("fraction", f)`` or
    ``("shots", n)``).

    Raises:
        ValueError: an unknown task (listing the valid ones) or mode, neither or both of fractions and shots, a
            value out of range, or linear-probe for a task that is not a class task.
    """
    cfg.check()
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode {bad[0] if bad else None!r}; modes: {', '.join(MODES)}")
    if (fractions is None) == (shots is None):
        raise ValueError("give fractions or shots (not both)")
    spec = get_task(task)  # unknown names fail here, listing the valid ones
    sizes = [("fraction", float(f)) for f in fractions] if fractions is not None else [("shots", int(s)) for s in shots]
    for kind, v in sizes:
        if (kind == "fraction" and not 0.0 < v <= 1.0) or (kind == "shots" and v < 1):
            raise ValueError(f"{kind} must be {'in (0, 1]' if kind == 'fraction' else '>= 1'}, got {v}")
    if "linear-probe" in modes and spec.head_kind != "class":
        raise ValueError(f"mode linear-probe needs a class task; {spec.name} is {spec.head_kind}")
    return sizes


def finetune_table(full: SquadViT, task: str, data: str | Path, modes: Sequence[str] = ("router",),
                   fractions: Sequence[float] | None = None, shots: Sequence[int] | None = None,
                   cfg: FinetuneConfig | None = None, train_split: str = "train", eval_split: str = "val",
                   replace: bool = False, save_dir: str | Path | None = None, out: str | Path | None = None) -> dict:
    """Fine-tunes ``task`` onto a trained model in every mode and subset size, and scores each run.

    Args:
        full: the trained model, as `squad.load_model` returns it (its ``meta`` tells which tasks the run trained:
            a head that never trained may be replaced); it is not changed.
        task: the new task (name or alias from `squad.tasks`).
        data: dataset root holding the task's data.
        modes: any of router, head, full, linear-probe.
        fractions: training-set shares in (0, 1] (deterministic nested subsets).
        shots: instead, images per class (class tasks).
        cfg: optimisation settings.
        train_split: split the subsets are drawn from.
        eval_split: split the metric is measured on.
        replace: allow a task the model was trained with (its head and router rows are dropped first).
        save_dir: also save each fine-tuned model there (``{task}_{mode}_{size}.pt``, an ordinary model.pt).
        out: write the result JSON there.

    Returns:
        ``{"task", "metric", "untrained", "runs": [...], "table": {mode: {size: metric}}, ...}``.
    """
    cfg = cfg or FinetuneConfig()
    sizes = check_request(task, modes, fractions, shots, cfg)
    spec = get_task(task, full.cfg.task_options)
    name = spec.name
    meta = getattr(full, "meta", None) or {"path": f"the {full.cfg.name} model in memory"}
    trained = (meta.get("extra") or {}).get("trained_tasks")
    base, note = base_without(full, name, trained, replace)
    base.to(cfg.device).eval()
    train_set = model_dataset(base, data, [name], train_split)
    eval_set = model_dataset(base, data, [name], eval_split)
    loader = eval_loader(eval_set, cfg.batch_size, cfg.workers)
    labels = class_labels(train_set, name) if shots is not None else None
    untrained = evaluate(with_new_task(base, name, cfg.init, cfg.seed).to(cfg.device), loader, [name], cfg.device,
                         cfg.eval_batches)[name]
    result = {"task": name, "checkpoint": meta["path"], "base_tasks": base.task_names, "note": note,
              "metric": spec.primary_metric, "lower_is_better": spec.lower_is_better, "train_split": train_split,
              "train_images_total": len(train_set), "eval_split": eval_split, "eval_images": len(eval_set),
              "config": vars(cfg).copy(), "untrained": untrained, "runs": [], "table": {}}
    for kind, value in sizes:
        idx = subset_indices(len(train_set), **{kind: value}, labels=labels, seed=cfg.seed)
        label = f"{value:g}" if kind == "fraction" else f"{value}-shot"
        for mode in modes:
            log.info("fine-tuning %s: mode %s, %s %s (%d images)", name, mode, kind, value, len(idx))
            row, model = finetune_once(base, name, mode, train_set, idx, loader, cfg)
            row.update({kind: value, "size": label, "primary": row["metrics"].get(spec.primary_metric)})
            result["runs"].append(row)
            result["table"].setdefault(mode, {})[label] = row["primary"]
            if save_dir is not None and model is not None:
                merge_added_tasks(model)
                path = Path(save_dir) / f"{name}_{mode}_{label}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                export_model(path, model, None, {"finetuned_task": name, "mode": mode, kind: value,
                                                 "trained_tasks": [*base.task_names, name]})
                row["saved"] = str(path)
    if out is not None:
        atomic_write_text(out, json.dumps(result, indent=2) + "\n", "the fine-tuning results")
    return result


def format_table(result: dict) -> str:
    """Modes × sizes → the primary metric, with the untrained head for reference."""
    sizes = list(dict.fromkeys(r["size"] for r in result["runs"]))
    arrow = "lower is better" if result["lower_is_better"] else "higher is better"
    lines = [f"{result['task']}: {result['metric']} on {result['eval_split']} ({result['eval_images']} images; "
             f"{arrow}); untrained head {result['untrained'].get(result['metric'], float('nan')):.4f}",
             f"{'mode':<14}" + "".join(f"{s:>12}" for s in sizes)]
    for mode, row in result["table"].items():
        lines.append(f"{mode:<14}" + "".join(f"{row.get(s, float('nan')):>12.4f}" for s in sizes))
    counts = {r["size"]: r["train_images"] for r in result["runs"]}
    lines.append(f"{'images':<14}" + "".join(f"{counts[s]:>12}" for s in sizes))
    return "\n".join(lines)
