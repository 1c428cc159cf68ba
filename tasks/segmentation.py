"""Per-pixel classification with an ignore label: PASCAL-Context semseg and human parts, NYUD-v2 semseg.

Scored as ASTMT / Multi-Task-Learning-PyTorch score them (``evaluation/eval_semseg.py``, ``eval_human_parts.py``):
per class c, true positives, false positives and false negatives are counted over every valid pixel (truth ≠ 255) of
the whole dataset, IoU_c = TP_c / (TP_c + FP_c + FN_c), and mIoU is their mean.

| task | classes | raw (what the reader hands `decode`) | ids |
| --- | --- | --- | --- |
| semseg | 21: background + the 20 VOC classes | ``uint8 [H, W]`` the PNG's labels as stored | 0..20, 255 ignore |
| human_parts | 7: background + 6 parts (`HUMAN_PARTS`) | ``uint8 [H, W]`` | 0..6, 255 ignore |
| nyud_semseg | 40 NYU-40 classes | ``uint8 [H, W]`` the MTI-Net PNG as stored: 0 unlabelled, 1..40 | k − 1, 0 → 255 |

* decode: ids ``float32 [1, H, W]`` (ignored pixels hold 255) and the mask ``id != 255``. Human parts: an image (or
  crop) without any part pixel has no target — its mask is all False. That is the public rule: the evaluator skips
  a truth whose only value is 0 or 255 (the maps hold no 255 otherwise), and ``AddIgnoreRegions`` turns an all-zero
  parts map into ignore for training. Ids outside the classes raise `DecodeError` (a colour PNG, say).
* head: ``[B, C, H, W]`` logits (the dense head at the image size); target: the ids themselves ``[B, 1, H, W]``;
  to_units: argmax ids ``[B, 1, H, W]`` (the identity on ids), so ``to_units(target(v)) == v``.
* loss: cross-entropy averaged over valid pixels (ASTMT's ``NLLLoss(ignore_index=255)``).
* metrics (all in %, higher is better): ``miou`` (primary) — the mean IoU over the classes that occur in the truth or
  the prediction of the scored pixels; ``miou_all`` — the public evaluators' formula, the mean over *all* C classes,
  a class seen nowhere counting 0; ``pixel_acc``. On the real validation sets every class occurs, so the two mIoUs
  are equal; on a few synthetic batches ``miou`` does not punish classes that simply were not there.
  ``iou_<c>`` per class is not reported (the sums ``tp_<c>``, ``fp_<c>``, ``fn_<c>`` hold it).
* resample ``"nearest"`` (ids); raw_fill 255 (semseg, human_parts) or 0 (nyud_semseg's unlabelled).
"""

from __future__ import annotations

import numpy as np

from squad.lazy import module, no_grad

from .base import DecodeError, Task, as_f64, masked_mean

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch
F = module("torch.nn.functional")

IGNORE = 255

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")
HUMAN_PARTS = ("background", "head", "torso", "upper_arm", "lower_arm", "upper_leg", "lower_leg")
NYU40_CLASSES = ("wall", "floor", "cabinet", "bed", "chair", "sofa", "table", "door", "window", "bookshelf", "picture",
                 "counter", "blinds", "desk", "shelves", "curtain", "dresser", "pillow", "mirror", "floor_mat",
                 "clothes", "ceiling", "books", "refrigerator", "television", "paper", "towel", "shower_curtain", "box",
                 "whiteboard", "person", "night_stand", "toilet", "sink", "lamp", "bathtub", "bag", "otherstructure",
                 "otherfurniture", "otherprop")


class SegmentationTask(Task):
    """Semantic segmentation with ignore label 255 (see the module docstring).

    Args:
        name: the task's name.
        class_names: one name per class; their number is the head's channels.
        label_offset: the file stores id + offset, and the code 0 means unlabelled when the offset is 1 (NYUD-v2).
        needs_foreground: an image without any pixel of id > 0 has no target (human parts).
    """

    head_kind = "dense"
    primary_metric = "miou"
    higher_is_better = frozenset({"miou", "miou_all", "pixel_acc"})
    bits = 8
    resample = "nearest"

    def __init__(self, name: str, class_names: tuple[str, ...], label_offset: int = 0,
                 needs_foreground: bool = False) -> None:
        if label_offset not in (0, 1):
            raise ValueError(f"task {name}: label_offset must be 0 or 1, got {label_offset}")
        if not 1 < len(class_names) < IGNORE:
            raise ValueError(f"task {name}: expected 2..254 classes, got {len(class_names)}")
        self.name = name
        self.domain = name
        self.class_names = tuple(class_names)
        self.channels = len(class_names)
        self.label_offset = label_offset
        self.needs_foreground = needs_foreground
        self.raw_fill = 0 if label_offset else IGNORE

    # ----------------------------------------------------------------------------------------------- files
    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        if raw.ndim == 3 and raw.shape[2] == 1:
            return raw[..., 0]
        return raw

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        arr = self.compact_raw(np.asarray(raw))
        if arr.ndim != 2:
            raise DecodeError(f"task {self.name}: expected a label map [H, W], got shape {np.shape(raw)}")
        if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
            raise DecodeError(f"task {self.name}: expected integer labels, got dtype {arr.dtype}")
        ids = arr.astype(np.int64)
        if self.label_offset:
            ids = np.where(ids == 0, IGNORE, ids - self.label_offset)
        bad = (ids != IGNORE) & ((ids < 0) | (ids >= self.channels))
        if bad.any():
            found = sorted({int(v) for v in np.unique(arr[bad])})[:8]
            raise DecodeError(f"task {self.name}: labels {found} outside 0..{self.channels - 1 + self.label_offset} "
                              f"and {IGNORE} (ignore)")
        value = torch.from_numpy(ids.astype(np.float32))[None]  # [1, H, W]
        mask = value != IGNORE
        if self.needs_foreground and not bool((mask & (value > 0)).any()):
            mask = torch.zeros_like(mask)
        return value, mask

    # ------------------------------------------------------------------------------------------ learning
    def target(self, value: torch.Tensor) -> torch.Tensor:
        return value.float()

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        if pred.shape[-3] == self.channels:
            return pred.argmax(dim=-3, keepdim=True).to(torch.float32)
        if pred.shape[-3] == 1:
            return pred.float()
        raise ValueError(f"task {self.name}: expected logits [..., {self.channels}, H, W] or ids [..., 1, H, W], "
                         f"got {tuple(pred.shape)}")

    def check_batch(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Checks ``pred [B, C, H, W]`` logits against ``target [B, 1, H, W]`` ids; returns ``bool [B, 1, H, W]``."""
        if pred.dim() != 4 or pred.shape[1] != self.channels or target.dim() != 4 or target.shape[1] != 1 \
                or target.shape[0] != pred.shape[0] or target.shape[2:] != pred.shape[2:]:
            raise ValueError(f"task {self.name}: expected pred [B, {self.channels}, H, W] and target ids [B, 1, H, W], "
                             f"got pred {tuple(pred.shape)}, target {tuple(target.shape)}")
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        b, _, h, w = pred.shape
        if mask.shape != (b, 1, h, w):
            raise ValueError(f"task {self.name}: expected mask [B, 1, H, W] = {(b, 1, h, w)}, got {tuple(mask.shape)}")
        return mask.bool() & (target != IGNORE)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        ids = torch.where(mask, target, torch.zeros((), dtype=target.dtype, device=target.device)).long()[:, 0]
        ce = F.cross_entropy(pred.float(), ids, reduction="none").unsqueeze(1)  # [B, 1, H, W]
        return masked_mean(ce, mask)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        c = self.channels
        guess = pred.argmax(dim=1, keepdim=True)[mask]
        truth = target[mask].long()
        confusion = torch.bincount(truth * c + guess, minlength=c * c).reshape(c, c).to(torch.float64)  # [truth, pred]
        tp = confusion.diagonal()
        fp = confusion.sum(0) - tp
        fn = confusion.sum(1) - tp
        sums = {"pixels": as_f64(truth.numel())}
        for k in range(c):
            sums[f"tp_{k:02d}"] = as_f64(tp[k])
            sums[f"fp_{k:02d}"] = as_f64(fp[k])
            sums[f"fn_{k:02d}"] = as_f64(fn[k])
        return sums

    def class_iou(self, sums: dict[str, torch.Tensor | float]) -> list[float]:
        """IoU of each class in [0, 1] from summed statistics; NaN for a class in neither truth nor prediction."""
        out = []
        for k in range(self.channels):
            tp, fp, fn = (float(sums[f"{s}_{k:02d}"]) for s in ("tp", "fp", "fn"))
            union = tp + fp + fn
            out.append(tp / union if union > 0 else float("nan"))
        return out

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        pixels = float(sums["pixels"])
        if pixels <= 0:
            return {"miou": float("nan"), "miou_all": float("nan"), "pixel_acc": float("nan")}
        iou = np.array(self.class_iou(sums))
        seen = ~np.isnan(iou)
        correct = sum(float(sums[f"tp_{k:02d}"]) for k in range(self.channels))
        return {"miou": 100.0 * float(iou[seen].mean()),
                "miou_all": 100.0 * float(np.where(seen, iou, 0.0).mean()),
                "pixel_acc": 100.0 * correct / pixels}


def semseg_task() -> SegmentationTask:
    """PASCAL-Context semantic segmentation: 21 VOC classes (0 = background), 255 ignore."""
    return SegmentationTask("semseg", VOC_CLASSES)


def human_parts_task() -> SegmentationTask:
    """PASCAL-Context human parts: background + 6 parts; an image without a part pixel has no target."""
    return SegmentationTask("human_parts", HUMAN_PARTS, needs_foreground=True)


def nyud_semseg_task() -> SegmentationTask:
    """NYUD-v2 semantic segmentation: 40 classes, the file's 0 (unlabelled) ignored, k → k − 1."""
    return SegmentationTask("nyud_semseg", NYU40_CLASSES, label_offset=1)
