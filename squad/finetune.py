"""Router fine-tuning (Mod-Squad §4.3): learn a new task on a frozen multi-task model from a little data.

The new task gets a head, a task embedding and its rows in every per-task router (MoE attention, MoE MLP, MoD
learned routers, MoNE routers) via `SquadViT.add_task`; those rows are separate parameters, so the rest of the model
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

import copy
import dataclasses
import logging
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

from squad.data import collate
from squad.evaluation import evaluate
from squad.model import SquadViT
from squad.tasks import get_task

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
    spec = get_task(task)
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
def with_new_task(base: SquadViT, task: str, init: str = "mean", seed: int = 0) -> SquadViT:
    """A copy of ``base`` with ``task`` added (fresh head; router rows and embedding per ``init``)."""
    model = copy.deepcopy(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_task(task, init)
    return model


def select_trainable(model: SquadViT, task: str, mode: str) -> dict[str, nn.Parameter]:
    """Freezes everything a ``mode`` does not train and returns name → trainable parameter."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if mode == "full":
        names = {n for n, _ in model.named_parameters()}
    else:
        names = {f"heads.{task}.{n}" for n, _ in model.heads[task].named_parameters()}
        if mode == "router":
            names |= set(model.added_task_parameters())
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
    spec = get_task(task)
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
    spec = get_task(task)
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
                   get_task(task).channels, frozen_unchanged=True)
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
