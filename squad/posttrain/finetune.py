"""Router fine-tuning (Mod-Squad §4.3): learn a new task on a frozen multi-task model from a little data.

The new task gets a head, a task embedding and its rows in every per-task router (MoE attention, MoE MLP, MoD
learned routers, MoNE routers) via `squad.models.surgery.add_task`; those rows are separate parameters, so the rest
of the model is frozen for real — ``requires_grad=False``, absent from the optimizer, and checked bitwise unchanged
afterwards (the authors' script set ``requires_grad`` on modules, which does nothing, so their experts trained too).

Modes, for the paper's comparison:

* ``router``: the new task's router rows, task embedding and head;
* ``head``: the head only (routing stays at its initialisation);
* ``full``: every parameter of the model;
* ``linear-probe``: a linear layer on the frozen model's mean-pooled features (the new task's routing at its
  initialisation), standardised by the statistics of the images it learns from (`LinearProbe`, put in the head's
  place; the backbone runs in eval mode).

Every mode trains in the same loop (`fit`): AdamW over exactly the trainable parameters for ``steps`` steps.
Held-out selection is an option of `squad.config.tools.FinetuneConfig`: with ``holdout`` > 0 a seeded share of each
subset's images is set aside (`squad.posttrain.subsets.holdout_split`), every lr of ``lrs`` is tried, the held-out
metric is measured ``evals`` times along each run, and the best evaluation's lr and weights are kept; only the chosen
model is scored on the evaluation split. tools/finetune_router.py and the reproduction's router-finetune claim
(`squad.reproduce.finetune`) both run `finetune_once`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Subset

from squad.config.tools import FinetuneConfig
from squad.data import collate, eval_loader
from squad.eval.evaluate import evaluate, model_dataset
from squad.io import export_model
from squad.io.files import atomic_write_text
from squad.models.surgery import added_task_parameters, merge_added_tasks, replace_head, select_tasks, with_new_task
from squad.models.vit import SquadViT
from squad.posttrain.subsets import class_labels, holdout_split, subset_indices
from squad.tasks import TASK_NAMES, get_task

log = logging.getLogger(__name__)
MODES = ("router", "head", "full", "linear-probe")
FEW_IMAGES = 10  # fine-tuning on fewer images warns


# ------------------------------------------------------------------------------------------------ linear probe
class LinearProbe(nn.Module):
    """linear-probe's head: a linear layer on the mean-pooled patch tokens, standardised per feature.

    Args:
        mean: [D] feature means of the images the probe learns from.
        std: [D] their standard deviations (clamped away from 0).
        channels: the task's outputs C.
        prefix: tokens before the patch tokens (1 with a class token).
    """

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, channels: int, prefix: int):
        super().__init__()
        self.register_buffer("mean", mean.detach().clone())
        self.register_buffer("std", std.detach().clone())
        self.prefix = prefix
        self.fc = nn.Linear(mean.numel(), channels)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normed tokens [B, N, D] → logits [B, C]."""
        pooled = tokens[:, self.prefix:].mean(1).float()  # [B, D]
        return self.fc((pooled - self.mean) / self.std)


@torch.no_grad()
def probe_statistics(model: SquadViT, task: str, loader: DataLoader, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[D] mean and standard deviation of the mean-pooled patch tokens over ``loader``'s images (the model in eval
    mode, routing ``task``)."""
    was = model.training
    model.eval()
    prefix = int(model.cfg.class_token)
    feats = torch.cat([model.forward_features(b["rgb"].to(device), task)[:, prefix:].mean(1).float()
                       for b in loader])  # [N, D]
    model.train(was)
    return feats.mean(0), feats.std(0, unbiased=False).clamp_min(1e-6)


# ----------------------------------------------------------------------------------------------- the loop
def select_trainable(model: SquadViT, task: str, mode: str) -> dict[str, nn.Parameter]:
    """Freezes everything a ``mode`` does not train and returns name → trainable parameter (linear-probe: the probe
    in the head's place)."""
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


def make_optimizer(trainable: dict[str, nn.Parameter], cfg: FinetuneConfig, lr: float | None = None
                   ) -> torch.optim.Optimizer:
    """AdamW over exactly the trainable parameters (frozen ones are not even registered with it), at ``lr``
    (default ``cfg.lr``)."""
    return torch.optim.AdamW(list(trainable.values()), lr=cfg.lr if lr is None else lr,
                             weight_decay=cfg.weight_decay)


def _cycle(loader: DataLoader) -> Iterator[dict]:
    while True:
        yield from loader


def fit(model: SquadViT, task: str, mode: str, loader: DataLoader, trainable: dict[str, nn.Parameter],
        cfg: FinetuneConfig, lr: float, held: DataLoader | None = None) -> dict:
    """The fine-tuning loop of every mode: ``cfg.steps`` AdamW steps on the task's loss, and with ``held`` the
    held-out metric every ``steps / evals`` steps, the best evaluation's weights restored at the end.

    Args:
        model: the model with the new task (linear-probe: with the probe as its head; the backbone then runs in
            eval mode, so the features it learns from are the frozen model's).
        task: the task's canonical name.
        mode: one of `MODES`.
        loader: the images it learns from.
        trainable: the parameters it trains (`select_trainable`).
        cfg: the settings (steps, evals, weight decay, device, eval_batches).
        lr: the learning rate of this run.
        held: held-out images that pick the stopping step (None: the last step's weights).

    Returns:
        ``{"lr", "losses" (per step), "best_step", "held" (the chosen evaluation's primary metric, or None),
        "curve" ([(step, held-out metric)])}``; the model is left in eval mode.
    """
    spec = model.get_task(task)
    sign = -1.0 if spec.lower_is_better else 1.0
    opt = make_optimizer(trainable, cfg, lr)
    every = max(1, cfg.steps // cfg.evals)
    batches = _cycle(loader)
    best, best_step, best_state, curve, losses = -math.inf, cfg.steps, None, [], []
    for step in range(1, cfg.steps + 1):
        model.train(mode != "linear-probe")
        batch = next(batches)
        pred = model(batch["rgb"].to(cfg.device), [task]).preds[task]
        loss = spec.loss(pred.float(), spec.target(batch["targets"][task].to(cfg.device)),
                         batch["masks"][task].to(cfg.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if held is not None and (step % every == 0 or step == cfg.steps):
            value = evaluate(model, held, [task], cfg.device)[task].get(spec.primary_metric, math.nan)
            curve.append((step, value))
            if math.isfinite(value) and sign * value > best:
                best, best_step = sign * value, step
                best_state = {n: p.detach().clone() for n, p in trainable.items()}
    if best_state is not None:
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(best_state[n])
    model.eval()
    return {"lr": lr, "losses": losses, "best_step": best_step, "curve": curve,
            "held": sign * best if best_state is not None else None}


# ----------------------------------------------------------------------------------------------- one run
def _subset_loader(train_set, indices: Sequence[int], cfg: FinetuneConfig, shuffle: bool) -> DataLoader:
    return DataLoader(Subset(train_set, list(indices)), batch_size=min(cfg.batch_size, len(indices)),
                      shuffle=shuffle, collate_fn=collate, num_workers=cfg.workers,
                      generator=torch.Generator().manual_seed(cfg.seed))


def _learner(base: SquadViT, task: str, mode: str, train_set, fit_idx: list[int], cfg: FinetuneConfig
             ) -> tuple[SquadViT, dict[str, nn.Parameter]]:
    """A copy of ``base`` with the new task, set up for ``mode``, and its trainable parameters."""
    model = with_new_task(base, task, cfg.init, cfg.seed).to(cfg.device)
    if mode == "linear-probe":
        spec = model.get_task(task)
        if spec.head_kind != "class":
            raise ValueError(f"linear-probe is a linear classifier on pooled features and needs a class task; "
                             f"{task} is {spec.head_kind} (for dense tasks, mode 'head' trains the linear head on "
                             f"frozen features)")
        mean, std = probe_statistics(model, task, _subset_loader(train_set, fit_idx, cfg, False), cfg.device)
        replace_head(model, task, LinearProbe(mean, std, spec.channels, int(model.cfg.class_token)))
    return model, select_trainable(model, task, mode)


def finetune_once(base: SquadViT, task: str, mode: str, train_set, indices: Sequence[int], scored: DataLoader,
                  cfg: FinetuneConfig) -> tuple[dict, SquadViT | None]:
    """One (mode, subset) run from ``base`` — with held-out selection (``cfg.holdout``), one run per lr and the best
    kept — scored on ``scored`` (the evaluation split's loader).

    Returns:
        (its result row, the fine-tuned model; None for linear-probe, whose head is no head of the config). The row
        holds ``mode, train_images, fit_images, held_images, lr, best_step, held ({lr: held-out metric} when
        selecting), curve, metrics, final_loss, trainable_params, frozen_unchanged``.

    Raises:
        RuntimeError: a frozen parameter changed (``cfg.verify_frozen``).
    """
    indices = list(indices)
    fit_idx, held_idx = holdout_split(indices, cfg.holdout, cfg.seed) if cfg.selects else (indices, [])
    held = eval_loader(Subset(train_set, held_idx), cfg.batch_size, cfg.workers) if held_idx else None
    chosen, tries = None, {}
    for lr in cfg.lr_grid():
        model, trainable = _learner(base, task, mode, train_set, fit_idx, cfg)
        frozen = ({n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}
                  if cfg.verify_frozen else {})
        torch.manual_seed(cfg.seed)
        run = fit(model, task, mode, _subset_loader(train_set, fit_idx, cfg, True), trainable, cfg, lr, held)
        if not all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen):
            raise RuntimeError(f"mode {mode}: a frozen parameter changed during training")
        tries[f"{lr:g}"] = run["held"]
        sign = -1.0 if model.get_task(task).lower_is_better else 1.0
        score = -math.inf if run["held"] is None else sign * run["held"]
        if chosen is None or score > chosen[0]:  # the first lr wins a tie
            chosen = (score, run, model, trainable)
    _, run, model, trainable = chosen
    metrics = evaluate(model, scored, [task], cfg.device, cfg.eval_batches)[task]
    row = {"mode": mode, "train_images": len(indices), "fit_images": len(fit_idx), "held_images": len(held_idx),
           "lr": run["lr"], "best_step": run["best_step"], "held": tries if held is not None else None,
           "curve": run["curve"], "metrics": metrics, "final_loss": run["losses"][-1],
           "trainable_params": sum(p.numel() for p in trainable.values()),
           "frozen_unchanged": True if cfg.verify_frozen else None}
    for p in model.parameters():
        p.requires_grad_(True)
    return row, None if mode == "linear-probe" else model


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
        cfg: the settings (`squad.config.tools.FinetuneConfig`; with ``holdout`` > 0 every run picks its lr and
            stopping step on held-out images of its subset).
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
    scored: dict = {}  # the images actually scored: --eval-batches N scores N batches, not the whole split
    untrained = evaluate(with_new_task(base, name, cfg.init, cfg.seed).to(cfg.device), loader, [name], cfg.device,
                         cfg.eval_batches, counts=scored)[name]
    result = {"task": name, "checkpoint": meta["path"], "base_tasks": base.task_names, "note": note,
              "metric": spec.primary_metric, "lower_is_better": spec.lower_is_better, "train_split": train_split,
              "train_images_total": len(train_set), "eval_split": eval_split, "eval_images": scored["images"],
              "config": dataclasses.asdict(cfg), "untrained": untrained, "runs": [], "table": {}}
    for kind, value in sizes:
        idx = subset_indices(len(train_set), **{kind: value}, labels=labels, seed=cfg.seed)
        label = f"{value:g}" if kind == "fraction" else f"{value}-shot"
        if len(idx) < FEW_IMAGES:
            log.warning("fine-tuning %s on %d image%s (%s %s): metrics from so few are noisy and the fit may not "
                        "generalise; use a larger --fraction or --shots for a result to rely on", name, len(idx),
                        "s" if len(idx) != 1 else "", kind, value)
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
