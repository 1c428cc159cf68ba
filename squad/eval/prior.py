"""Image-independent predictors: what a model scores that never looks at the image.

A model that learned something about the images must beat the best prediction made without them. For every task
this module fits such predictions on the training split, in the task's head space (`squad.tasks.base`), and scores
them with the task's own metrics on an evaluation split, exactly as `squad.eval.evaluate` scores a model:

* dense tasks: the per-pixel mean map and the per-pixel median map of the valid training targets (a pixel that is
  never valid takes the global value), and the global mean and the global median (one value per channel);
* per-pixel classification (segmentation: label ids against per-class logits): the per-pixel and the global class
  frequencies of the valid training pixels, as logits;
* class tasks: the mean training distribution (as logits) and the most frequent training label (one-hot logits).

`image_independent` returns every predictor's metrics and the best one by the task's primary metric
(`best_predictor`). The medians are taken over at most `MEDIAN_IMAGES` training images (evenly spaced), the means
over all of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from squad.data import eval_loader
from squad.eval.metrics import MetricAccumulator
from squad.tasks import Task, get_task

MEDIAN_IMAGES = 1000


def _batches(dataset, batch: int) -> Iterable[dict]:
    yield from eval_loader(dataset, batch)


def _masked_median(values: torch.Tensor, valid: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The median along ``dim`` of the valid entries (NaN where none is valid)."""
    v = values.masked_fill(~valid, float("nan"))
    return torch.nanmedian(v, dim=dim).values


def fit_dense(task: Task, batches: Iterable[dict], median_every: int = 1) -> dict[str, torch.Tensor]:
    """Mean and median maps (``[C, H, W]``) and global mean and median (``[C, 1, 1]``) of a dense task's valid
    training targets in head space; the medians from every ``median_every``-th image."""
    total = count = None
    kept, kept_masks = [], []
    seen = 0
    for b in batches:
        t = task.target(b["targets"][task.name]).double()  # [B, C, H, W]
        m = b["masks"][task.name].expand_as(t)  # [B, C, H, W]
        if total is None:
            total, count = torch.zeros_like(t[0]), torch.zeros_like(t[0])
        total += (t * m).sum(0)
        count += m.sum(0)
        for i in range(t.shape[0]):
            if (seen + i) % median_every == 0:
                kept.append(t[i].float())
                kept_masks.append(m[i])
        seen += t.shape[0]
    if total is None:
        raise ValueError(f"{task.name}: no training image to fit an image-independent predictor on")
    flat_total, flat_count = total.flatten(1).sum(1), count.flatten(1).sum(1)  # [C]
    global_mean = (flat_total / flat_count.clamp_min(1)).float()[:, None, None]  # [C, 1, 1]
    mean_map = torch.where(count > 0, total / count.clamp_min(1), global_mean.double()).float()
    stack, valid = torch.stack(kept), torch.stack(kept_masks)  # [N, C, H, W]
    median_map = _masked_median(stack, valid)
    channels = stack.shape[1]
    per_channel = stack.transpose(0, 1).reshape(channels, -1)  # [C, N·H·W]
    global_median = _masked_median(per_channel, valid.transpose(0, 1).reshape(channels, -1), dim=1)
    global_median = global_median[:, None, None]
    median_map = torch.where(torch.isnan(median_map), global_median.expand_as(median_map), median_map)
    return {"mean map": mean_map, "median map": median_map, "global mean": global_mean,
            "global median": global_median.float()}


def fit_labels(task: Task, batches: Iterable[dict]) -> dict[str, torch.Tensor]:
    """Logits of the per-pixel (``[C, H, W]``) and the global (``[C, 1, 1]``) class frequencies of a per-pixel
    classification task's valid training pixels."""
    counts = None
    for b in batches:
        ids = task.target(b["targets"][task.name]).long()  # [B, 1, H, W]
        valid = b["masks"][task.name].bool() & (ids >= 0) & (ids < task.channels)  # [B, 1, H, W]
        onehot = torch.zeros(ids.shape[0], task.channels, *ids.shape[2:], dtype=torch.float64)
        onehot.scatter_(1, ids.clamp(0, task.channels - 1), valid.double())  # [B, C, H, W]
        counts = onehot.sum(0) if counts is None else counts + onehot.sum(0)
    if counts is None or counts.sum() == 0:
        raise ValueError(f"{task.name}: no valid training pixel to fit an image-independent predictor on")
    total = counts.sum((1, 2), keepdim=True)  # [C, 1, 1]
    glob = total / total.sum()
    per_pixel = torch.where(counts.sum(0, keepdim=True) > 0, counts / counts.sum(0, keepdim=True).clamp_min(1), glob)
    return {"per-pixel class frequencies": per_pixel.clamp_min(1e-8).log().float(),
            "global class frequencies": glob.clamp_min(1e-8).log().float()}


def fit_class(task: Task, batches: Iterable[dict]) -> dict[str, torch.Tensor]:
    """Logits ``[C]`` of the mean training distribution and of the most frequent training label (one-hot)."""
    total, labels = None, []
    for b in batches:
        value = b["targets"][task.name].double()  # [B, C] probabilities
        valid = b["masks"][task.name].reshape(-1).bool()  # [B]
        value = value[valid]
        total = value.sum(0) if total is None else total + value.sum(0)
        labels.append(value.argmax(1))
    if total is None or not labels or sum(x.numel() for x in labels) == 0:
        raise ValueError(f"{task.name}: no valid training label to fit an image-independent predictor on")
    mean = (total / total.sum().clamp_min(1e-12)).float()
    top = int(torch.bincount(torch.cat(labels), minlength=task.channels).argmax())
    onehot = torch.full((task.channels,), -10.0)
    onehot[top] = 10.0
    return {"mean distribution": mean.clamp_min(1e-8).log(), "most frequent label": onehot}


def score(task: Task, prediction: torch.Tensor, batches: Iterable[dict]) -> dict[str, float]:
    """The task's metrics of one constant prediction (head space, without the batch dimension) on ``batches``."""
    acc = MetricAccumulator([task])
    for b in batches:
        target = task.target(b["targets"][task.name])
        pred = prediction.to(torch.float32).unsqueeze(0)  # [1, C, h, w] (dense) or [1, C] (class)
        if task.head_kind == "dense":
            pred = pred.expand(target.shape[0], pred.shape[1], *target.shape[2:])  # [B, C, H, W]
        else:
            pred = pred.expand(target.shape[0], -1)
        acc.update(task.name, task.metric_sums(pred.contiguous(), target, b["masks"][task.name]))
    return acc.compute(reduce=False).get(task.name, {})


def _labels(task: Task, dataset) -> bool:
    """Whether a dense task is a per-pixel classification: one target channel of ids against ``channels`` logits."""
    if task.channels < 2:
        return False
    first = dataset[0]["targets"][task.name].unsqueeze(0)  # [1, C, H, W]
    return task.target(first).shape[1] == 1


def best_predictor(task: Task, predictors: dict[str, dict[str, float]]) -> str:
    """The name of the predictor with the best primary metric (the first one on a tie)."""
    sign = -1.0 if task.lower_is_better else 1.0

    def key(name: str) -> float:
        v = predictors[name].get(task.primary_metric, math.nan)
        return sign * v if math.isfinite(v) else -math.inf

    return max(predictors, key=key)


def image_independent(train_set, eval_set, tasks: Sequence[str | Task], batch: int = 64) -> dict[str, dict]:
    """Every image-independent predictor of each task, fitted on ``train_set`` and scored on ``eval_set``.

    Args:
        train_set, eval_set: datasets holding the tasks (`squad.data.build_dataset`, no augmentation).
        tasks: task names or configured `Task` objects.
        batch: images per batch while fitting and scoring.

    Returns:
        ``{task: {"predictors": {name: metrics}, "best": name, "metrics": the best one's metrics, "primary": its
        primary metric's name, "train_images", "eval_images"}}``.
    """
    out = {}
    n_train = len(train_set)
    for t in tasks:
        task = t if isinstance(t, Task) else get_task(t)
        if task.head_kind == "dense" and _labels(task, train_set):
            fitted = fit_labels(task, _batches(train_set, batch))
        elif task.head_kind == "dense":
            fitted = fit_dense(task, _batches(train_set, batch), max(1, math.ceil(n_train / MEDIAN_IMAGES)))
        else:
            fitted = fit_class(task, _batches(train_set, batch))
        predictors = {name: score(task, pred, _batches(eval_set, batch)) for name, pred in fitted.items()}
        best = best_predictor(task, predictors)
        out[task.name] = {"predictors": predictors, "best": best, "metrics": predictors[best],
                          "primary": task.primary_metric, "train_images": n_train, "eval_images": len(eval_set)}
    return out


__all__ = ["MEDIAN_IMAGES", "best_predictor", "fit_class", "fit_dense", "fit_labels", "image_independent", "score"]
