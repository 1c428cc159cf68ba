"""Image classification tasks: class_object (1000 ImageNet classes) and class_scene (365 Places classes).

Taskonomy ships each label as a ``.npy`` vector: a class distribution distilled from a network.

* decode: probabilities ``float32 [C]``. The file is cast to float32 first; if it has a negative entry it holds
  logits and is soft-maxed, otherwise it is divided by its sum (so a distribution that was stored truncated or
  un-normalised still sums to 1). Mask ``bool [1]``: False for non-finite vectors or an all-zero vector.
* head: pooled tokens → LayerNorm → Linear(C) logits.
* loss (paper): soft-target cross-entropy. It is computed as KL(p ‖ softmax(logits)) — the cross-entropy minus the
  target's entropy, which has the same gradients and is 0 on a perfect prediction. The authors' released code uses
  MSE between the raw head output and the distribution instead: ``ClassTask(name, loss="mse")``.
* target / to_units: with the default loss the head regresses log-probabilities, ``target(p) = log(max(p, 1e-12))``
  and ``to_units = softmax``; with ``loss="mse"`` both are the identity (the head regresses the probabilities).
* metrics: top-1 accuracy in % (primary, as the authors: argmax of the prediction equals the argmax of the target
  distribution) and top-5 accuracy in %.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from squad.lazy import module, no_grad

from .base import DecodeError, Task, as_f64, ratio

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch

NUM_CLASSES = {"class_object": 1000, "class_scene": 365}
_MIN_PROB = 1e-12


class ClassTask(Task):
    """Soft-label image classification (see module docstring)."""

    head_kind = "class"
    primary_metric = "accuracy"
    higher_is_better = frozenset({"accuracy", "top5"})
    file_ext = ".npy"
    bits = 0
    geometric = False
    resample = "none"

    def __init__(self, name: str, num_classes: int | None = None, loss: Literal["soft_ce", "mse"] = "soft_ce") -> None:
        if loss not in ("soft_ce", "mse"):
            raise ValueError(f"task {name}: loss must be 'soft_ce' or 'mse', got {loss!r}")
        if num_classes is None:
            if name not in NUM_CLASSES:
                raise ValueError(f"task {name}: num_classes is required for a class task not in {sorted(NUM_CLASSES)}")
            num_classes = NUM_CLASSES[name]
        self.name = name
        self.domain = name
        self.channels = num_classes
        self.loss_kind = loss

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        arr = np.asarray(raw)
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise DecodeError(f"task {self.name}: expected a numeric vector, got dtype {arr.dtype}")
        arr = arr.astype(np.float32).reshape(-1)
        if arr.shape[0] != self.channels:
            raise DecodeError(f"task {self.name}: expected {self.channels} values, got shape {np.shape(raw)}")
        v = torch.from_numpy(arr)
        finite = bool(torch.isfinite(v).all())
        if not finite:
            return torch.zeros_like(v), torch.zeros(1, dtype=torch.bool)
        if bool((v < 0).any()):
            return torch.softmax(v, dim=0), torch.ones(1, dtype=torch.bool)
        total = float(v.sum())
        if total <= 0:
            return torch.zeros_like(v), torch.zeros(1, dtype=torch.bool)
        return v / total, torch.ones(1, dtype=torch.bool)

    def decode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of a batch of vectors ``float32 [B, C]`` on any device → ``(value [B, C], mask [B, 1])``."""
        finite = torch.isfinite(codes).all(1, keepdim=True)
        v = torch.where(finite, codes, torch.zeros((), device=codes.device))
        negative = (v < 0).any(1, keepdim=True)
        total = v.sum(1, keepdim=True)
        soft = torch.softmax(v, dim=1)
        share = v / torch.where(total > 0, total, torch.ones((), device=codes.device))
        ok = finite & (negative | (total > 0))
        value = torch.where(negative, soft, share)
        return torch.where(ok, value, torch.zeros((), device=codes.device)), ok

    def target(self, value: torch.Tensor) -> torch.Tensor:
        if self.loss_kind == "mse":
            return value.float()
        return torch.log(value.float().clamp_min(_MIN_PROB))

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        if self.loss_kind == "mse":
            return pred.float()
        return torch.softmax(pred.float(), dim=-1)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)  # [B]
        pred = pred.float()
        target = target.float()
        if self.loss_kind == "mse":
            per_sample = (pred - target).square().mean(dim=1)
        else:
            log_p = torch.log_softmax(target, dim=1)  # renormalised target log-probabilities
            per_sample = (log_p.exp() * (log_p - torch.log_softmax(pred, dim=1))).sum(dim=1)
        zero = torch.zeros((), dtype=per_sample.dtype, device=per_sample.device)
        return torch.where(mask, per_sample, zero).sum() / mask.sum().clamp_min(1).to(per_sample.dtype)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        truth = target.argmax(dim=1)  # argmax is the same in head space and in units
        top5 = pred.topk(min(5, self.channels), dim=1).indices
        hit5 = (top5 == truth[:, None]).any(dim=1)
        hit1 = pred.argmax(dim=1) == truth
        return {
            "correct": as_f64((hit1 & mask).sum()),
            "correct5": as_f64((hit5 & mask).sum()),
            "count": as_f64(mask.sum()),
        }

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        return {"accuracy": 100.0 * ratio(sums, "correct", "count"),
                "top5": 100.0 * ratio(sums, "correct5", "count")}

