"""Dense tasks of PASCAL-Context and NYUD-v2: saliency, surface normals, edges, NYUD depth.

Conventions follow the public loaders and evaluators that M3ViT / Mod-Squad's Table 3 use (ASTMT,
Vandenhende's Multi-Task-Learning-PyTorch: ``data/*.py``, ``losses/loss_functions.py``, ``evaluation/eval_*.py``) and
SEISM for edges (`squad.tasks.edges`).

* saliency — raw ``uint8 [H, W]``, the distilled map 0..255 (bool or float in [0, 1] accepted); value {0, 1} =
  raw / 255 > 0.5, every pixel valid; head 1 logit, BCE; metrics ``maxf`` ↑ (primary), ``miou`` ↑, in %.
* normals — raw ``uint8 [H, W, 3]`` codes, n = 2c / 255 − 1, fill (128, 128, 128) = invalid; or ``float [H, W, 3]``
  vectors, zero = invalid; value unit vectors ``[3, H, W]``, valid where the decoded vector is ≥ 0.1 long; head 3,
  L1 between the normalised prediction and the truth; metrics ``angle_mean`` ↓ (primary, degrees),
  ``angle_median`` ↓, ``angle_rmse`` ↓, ``within_11_25`` / ``within_22_5`` / ``within_30`` ↑ (%).
* edge — raw ``uint8`` / ``bool`` / ``float [H, W]``, non-zero (float: ≥ 0.5) = boundary; value {0, 1}, thinned on
  the resized frame, every pixel valid; head 1 logit, BCE with boundary pixels weighted 0.95; metrics ``odsf`` ↑
  (primary), ``ods_precision`` ↑, ``ods_recall`` ↑ (%).
* nyud_depth — raw ``float32 [H, W]`` metres, 0 = no measurement; value metres ``[1, H, W]``, valid where > 0; head
  1 (metres), L1; metrics ``rmse`` ↓ (primary, metres), ``log_rmse`` ↓, ``abs_rel`` ↓, ``delta1`` ↑ (%).

Saliency (ASTMT ``eval_sal.py``, which M3ViT and Mod-Squad report): at each of 15 thresholds ``linspace(0.2, 0.9,
15)`` on the predicted probability (``p > t``), precision, recall and the Jaccard index are computed per image (with
``1e-12`` in the denominators; the Jaccard index is 1 when truth and prediction are both empty) and averaged over
images; F = (1 + β²) P R / (β² P + R) from the averaged P and R. ``maxf`` is the largest F over the thresholds and
``miou`` the largest mean Jaccard — two different numbers: ASTMT / ATRC / TaskPrompter tables give maxF, M3ViT and
Mod-Squad give mIoU. β² = 1 as in that evaluator (``2PR / (P + R)``); the salient-object literature's β² = 0.3 is
``get_task("saliency", beta2=0.3)``. Loss: BCE on the logits (``loss="balanced"``: ASTMT's HED-style balanced BCE
whose positive weight is the batch's share of negative pixels).

Normals (``eval_normals.py``): the angle in degrees between the normalised prediction and the truth on valid pixels;
``angle_mean`` (primary), ``angle_rmse`` = sqrt(mean of squared angles), ``within_*`` the share of pixels below
11.25°, 22.5°, 30°; ``angle_median`` read off a histogram of 0.5° bins (the angle below which half the pixels
lie, linear inside its bin: within a bin of the exact median when pixels are many). A horizontal flip negates x
(channel 0), as ASTMT's ``RandomHorizontalFlip``. The PASCAL reader writes the fill
(128, 128, 128) where the distilled normals are not valid (context classes without an NYU counterpart); the codes are
those of Taskonomy's normals (``c / 127.5 − 1``), so the resize is mask-aware with the same rule.

Edges: the training target is the boundary map at the working resolution — the reader's 1-pixel boundaries are
resized bilinearly (so a line survives downscaling: any covered output pixel is boundary) and thinned again
(`squad.tasks.edges.thin`, as ``bwmorph thin``) on the whole resized frame (`filter_frame`), before the crop.
Loss: ASTMT's ``BalancedCrossEntropyLoss(pos_weight=0.95)``: 0.95 · BCE on boundary pixels + 0.05 · BCE elsewhere,
averaged over valid pixels. Metric: SEISM's odsF (`squad.tasks.edges`), tolerance ``max_dist`` of the image diagonal
(0.0075 PASCAL-Context, the default; NYUD-v2 uses 0.011: ``model.task_options: {edge: {max_dist: 0.011}}``), 99
thresholds 0.01 … 0.99 (``thresholds=K`` for K evenly spaced ones, fewer for speed). The sums keep, per threshold,
the matched and the predicted boundary pixels (and the true ones), summed over batches and ranks: the ODS is over
the whole dataset.

NYUD depth (``eval_depth.py``): pooled over every valid pixel of the dataset, ``rmse = sqrt(mean (d − d*)²)`` and
``log_rmse = sqrt(mean (log d − log d*)²)`` with predictions clamped to ≥ 1e-9 m first (as the evaluator); also
``abs_rel`` = mean |d − d*| / d* and ``delta1`` = % of pixels with max(d/d*, d*/d) < 1.25.

Binary heads (saliency, edge) regress logits; `target` maps the {0, 1} truth to logits ±20 (so ``to_units =
sigmoid`` gives it back within 2·10⁻⁹ and a perfect prediction has zero loss), and the losses read the label as
``target > 0``.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from squad.lazy import module, no_grad

from .base import DecodeError, Task, as_f64, integer_image, masked_mean, ratio
from .edges import edge_counts, ods_f, thin
from .normal import _EPS, _MIN_NORM, UnitVectorTask

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch
F = module("torch.nn.functional")

_LOGIT = 20.0  # the logit a {0, 1} truth maps to (sigmoid(20) = 1 − 2e-9)
SALIENCY_THRESHOLDS: tuple[float, ...] = tuple(float(t) for t in np.linspace(0.2, 0.9, 15))
ANGLE_BIN = 0.5  # degrees per bin of the normals' angle histogram (the median)
_ANGLE_BINS = int(round(180 / ANGLE_BIN))


def _binary_target(value: torch.Tensor) -> torch.Tensor:
    """{0, 1} truth → logits ±`_LOGIT` (head space of the binary tasks)."""
    return (value.float() > 0.5).float().mul(2 * _LOGIT).sub(_LOGIT)


def _plane(raw: np.ndarray, name: str) -> np.ndarray:
    """A single-channel map ``[H, W]`` from ``[H, W]`` or ``[H, W, 1..4]`` (channel 0)."""
    arr = np.asarray(raw)
    if arr.ndim == 3:
        arr = arr[..., 0]
    if arr.ndim != 2:
        raise DecodeError(f"task {name}: expected a map [H, W], got shape {np.shape(raw)}")
    return arr


class SaliencyTask(Task):
    """PASCAL-Context distilled saliency (module docstring)."""

    name = "saliency"
    domain = "saliency"
    head_kind = "dense"
    channels = 1
    primary_metric = "maxf"
    higher_is_better = frozenset({"maxf", "miou"})
    bits = 8
    resample = "bilinear"
    raw_fill = 0

    def __init__(self, beta2: float = 1.0, loss: Literal["bce", "balanced"] = "bce") -> None:
        if isinstance(beta2, bool) or not isinstance(beta2, int | float) or not beta2 > 0:
            raise ValueError(f"beta2: expected a number > 0, got {beta2!r}")
        if loss not in ("bce", "balanced"):
            raise ValueError(f"loss: expected 'bce' or 'balanced', got {loss!r}")
        self.beta2 = float(beta2)
        self.loss_kind = loss

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        return _plane(raw, self.name)

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        arr = self.compact_raw(raw)
        if arr.dtype == np.bool_:
            sal = arr
        elif np.issubdtype(arr.dtype, np.integer):
            sal = integer_image(arr, 8, self.name).astype(np.float32) / 255.0 > 0.5
        elif np.issubdtype(arr.dtype, np.floating):
            sal = arr > 0.5
        else:
            raise DecodeError(f"task {self.name}: expected an 8-bit map, got dtype {arr.dtype}")
        value = torch.from_numpy(np.ascontiguousarray(sal)).to(torch.float32)[None]
        return value, torch.ones_like(value, dtype=torch.bool)

    def target(self, value: torch.Tensor) -> torch.Tensor:
        return _binary_target(value)

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(pred.float())

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        label = (target > 0).float()
        if self.loss_kind == "bce":
            return masked_mean(F.binary_cross_entropy_with_logits(pred.float(), label, reduction="none"), mask)
        valid = mask.float()
        w = ((1 - label) * valid).sum() / valid.sum().clamp_min(1)  # share of negatives (HED)
        return _weighted_bce(pred, label, mask, w)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        prob = self.to_units(pred).double()
        truth = (target > 0) & mask
        scored = mask.flatten(1).any(dim=1)  # images with a scored pixel
        sums: dict[str, torch.Tensor] = {"images": as_f64(scored.sum())}
        for k, t in enumerate(SALIENCY_THRESHOLDS):
            guess = (prob > t) & mask
            tp = (guess & truth).flatten(1).sum(1).double()
            fp = (guess & ~truth).flatten(1).sum(1).double()
            fn = (~guess & truth).flatten(1).sum(1).double()
            prec = tp / (tp + fp + 1e-12)
            rec = tp / (tp + fn + 1e-12)
            union = tp + fp + fn
            jac = torch.where(union > 0, tp / union.clamp_min(1), torch.ones_like(tp))
            sums[f"prec_{k:02d}"] = as_f64(prec[scored].sum())
            sums[f"rec_{k:02d}"] = as_f64(rec[scored].sum())
            sums[f"jac_{k:02d}"] = as_f64(jac[scored].sum())
        return sums

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        n = float(sums["images"])
        if n <= 0:
            return {"maxf": float("nan"), "miou": float("nan")}
        k = len(SALIENCY_THRESHOLDS)
        prec = np.array([float(sums[f"prec_{i:02d}"]) for i in range(k)]) / n
        rec = np.array([float(sums[f"rec_{i:02d}"]) for i in range(k)]) / n
        jac = np.array([float(sums[f"jac_{i:02d}"]) for i in range(k)]) / n
        f = (1 + self.beta2) * prec * rec / (self.beta2 * prec + rec + 1e-12)
        return {"maxf": 100.0 * float(f.max()), "miou": 100.0 * float(jac.max())}


def _weighted_bce(pred: torch.Tensor, label: torch.Tensor, mask: torch.Tensor, w: float | torch.Tensor) -> torch.Tensor:
    """Mean over valid pixels of ``w · BCE`` on positives and ``(1 − w) · BCE`` on negatives (ASTMT's balanced BCE)."""
    x = pred.float()
    per_pixel = w * label * F.softplus(-x) + (1 - w) * (1 - label) * F.softplus(x)
    return masked_mean(per_pixel, mask)


class SurfaceNormalsTask(UnitVectorTask):
    """Surface normals of PASCAL-Context (distilled) and NYUD-v2 (module docstring)."""

    name = "normals"
    domain = "normals"
    head_kind = "dense"
    channels = 3
    primary_metric = "angle_mean"
    higher_is_better = frozenset({"within_11_25", "within_22_5", "within_30"})
    bits = 8
    resample = "bilinear"
    raw_fill = 128

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        if raw.ndim != 3 or raw.shape[2] < 3:
            raise DecodeError(f"task {self.name}: expected normals [H, W, 3], got shape {raw.shape}")
        return raw[..., :3]

    def _vectors(self, raw: np.ndarray) -> np.ndarray:
        code = self.compact_raw(np.asarray(raw))
        if np.issubdtype(code.dtype, np.floating):
            return np.nan_to_num(code.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
        return integer_image(code, 8, self.name).astype(np.float32) / 127.5 - 1.0

    def raw_valid(self, raw: np.ndarray) -> np.ndarray | None:
        vec = self._vectors(raw)
        return np.einsum("hwc,hwc->hw", vec, vec) >= _MIN_NORM**2

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.unit_vectors(torch.from_numpy(np.ascontiguousarray(self._vectors(raw))).permute(2, 0, 1))

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        return masked_mean((self.to_units(pred) - target.float()).abs(), mask)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        p = F.normalize(pred.double(), dim=1, eps=_EPS)
        t = F.normalize(target.double(), dim=1, eps=_EPS)
        # atan2(|p × t|, p · t): exact near 0° where acos of a rounded cosine is not (acos(1 − 1e-8) = 0.008°)
        angle = torch.rad2deg(torch.atan2(torch.linalg.cross(p, t, dim=1).norm(dim=1, keepdim=True),
                                          (p * t).sum(1, keepdim=True)))[mask]
        hist = torch.bincount((angle / ANGLE_BIN).long().clamp_(0, _ANGLE_BINS - 1), minlength=_ANGLE_BINS)
        sums = {
            "angle": as_f64(angle.sum()),
            "angle_sq": as_f64(angle.square().sum()),
            "count": as_f64(angle.numel()),
            "below_11_25": as_f64((angle < 11.25).sum()),
            "below_22_5": as_f64((angle < 22.5).sum()),
            "below_30": as_f64((angle < 30).sum()),
        }
        hist = hist.to(torch.float64)
        for k in range(_ANGLE_BINS):
            sums[f"hist_{k:03d}"] = hist[k]
        return sums

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        n = float(sums["count"])
        return {
            "angle_mean": ratio(sums, "angle", "count"),
            "angle_median": _hist_median([float(sums[f"hist_{k:03d}"]) for k in range(_ANGLE_BINS)], ANGLE_BIN)
            if n > 0 else float("nan"),
            "angle_rmse": math.sqrt(ratio(sums, "angle_sq", "count")) if n > 0 else float("nan"),
            "within_11_25": 100.0 * ratio(sums, "below_11_25", "count"),
            "within_22_5": 100.0 * ratio(sums, "below_22_5", "count"),
            "within_30": 100.0 * ratio(sums, "below_30", "count"),
        }


def _hist_median(counts: list[float], width: float) -> float:
    """The median of values binned in ``[k·width, (k + 1)·width)``, linear inside its bin."""
    c = np.asarray(counts, dtype=np.float64)
    half = c.sum() / 2
    below = np.concatenate([[0.0], np.cumsum(c)])
    k = int(np.searchsorted(below[1:], half, side="left"))
    inside = (half - below[k]) / c[k] if c[k] > 0 else 0.0
    return float((k + inside) * width)  # a Python float: metrics are saved in model.pt (weights_only loading)


class EdgeTask(Task):
    """Boundary detection scored by SEISM's odsF (module docstring; `squad.tasks.edges`).

    Args:
        max_dist: matching tolerance as a fraction of the image diagonal (0.0075 PASCAL-Context, 0.011 NYUD-v2).
        thresholds: the number of evenly spaced thresholds in (0, 1) (SEISM: 99, i.e. 0.01 … 0.99).
        pos_weight: weight of the boundary pixels' BCE (ASTMT: 0.95); the others get 1 − pos_weight.
    """

    name = "edge"
    domain = "edge"
    head_kind = "dense"
    channels = 1
    primary_metric = "odsf"
    higher_is_better = frozenset({"odsf", "ods_precision", "ods_recall"})
    bits = 8
    resample = "bilinear"
    raw_fill = 0
    frame_filter = True

    def __init__(self, max_dist: float = 0.0075, thresholds: int = 99, pos_weight: float = 0.95) -> None:
        if isinstance(max_dist, bool) or not isinstance(max_dist, int | float) or not 0 <= max_dist < 1:
            raise ValueError(f"max_dist: expected a fraction of the diagonal in [0, 1), got {max_dist!r}")
        if isinstance(thresholds, bool) or not isinstance(thresholds, int) or not 1 <= thresholds <= 999:
            raise ValueError(f"thresholds: expected a count in 1..999, got {thresholds!r}")
        if isinstance(pos_weight, bool) or not isinstance(pos_weight, int | float) or not 0 < pos_weight < 1:
            raise ValueError(f"pos_weight: expected a number in (0, 1), got {pos_weight!r}")
        self.max_dist = float(max_dist)
        self.thresholds = tuple(round((k + 1) / (thresholds + 1), 6) for k in range(thresholds))
        self.pos_weight = float(pos_weight)

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        arr = _plane(raw, self.name)
        if np.issubdtype(arr.dtype, np.floating):
            return np.where(arr >= 0.5, np.uint8(255), np.uint8(0))
        if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer):
            return np.where(arr != 0, np.uint8(255), np.uint8(0))
        raise DecodeError(f"task {self.name}: expected a boundary map, got dtype {arr.dtype}")

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        edge = self.compact_raw(raw) != 0
        value = torch.from_numpy(np.ascontiguousarray(edge)).to(torch.float32)[None]
        return value, torch.ones_like(value, dtype=torch.bool)

    def filter_frame(self, value: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Thins the boundary map of the whole resized frame to 1-pixel lines (``bwmorph thin``)."""
        return torch.from_numpy(thin(value[0].numpy() > 0.5)).to(torch.float32)[None]

    def target(self, value: torch.Tensor) -> torch.Tensor:
        return _binary_target(value)

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(pred.float())

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        return _weighted_bce(pred, (target > 0).float(), mask, self.pos_weight)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        prob = self.to_units(pred)[:, 0].cpu().numpy()
        counts = edge_counts(prob, (target[:, 0] > 0).cpu().numpy(), mask[:, 0].cpu().numpy(), self.thresholds,
                             self.max_dist)
        sums = {"gt": as_f64(int(counts["gt"]))}
        for k in range(len(self.thresholds)):
            sums[f"matched_{k:03d}"] = as_f64(int(counts["matched"][k]))
            sums[f"pred_{k:03d}"] = as_f64(int(counts["pred"][k]))
        return sums

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        k = len(self.thresholds)
        matched = np.array([float(sums[f"matched_{i:03d}"]) for i in range(k)])
        pred = np.array([float(sums[f"pred_{i:03d}"]) for i in range(k)])
        if float(sums["gt"]) <= 0 and not pred.any():
            return {"odsf": float("nan"), "ods_precision": float("nan"), "ods_recall": float("nan")}
        best = ods_f(matched, pred, float(sums["gt"]), self.thresholds)
        return {"odsf": 100.0 * best["odsf"], "ods_precision": 100.0 * best["precision"],
                "ods_recall": 100.0 * best["recall"]}


class NyudDepthTask(Task):
    """NYUD-v2 depth in metres (module docstring)."""

    name = "nyud_depth"
    domain = "nyud_depth"
    head_kind = "dense"
    channels = 1
    primary_metric = "rmse"
    higher_is_better = frozenset({"delta1"})
    file_ext = ".npy"
    bits = 0
    resample = "bilinear"
    raw_fill = 0

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        return _plane(raw, self.name)

    def _metres(self, raw: np.ndarray) -> np.ndarray:
        arr = self.compact_raw(raw)
        if not np.issubdtype(arr.dtype, np.floating):
            raise DecodeError(f"task {self.name}: expected float depth in metres, got dtype {arr.dtype}")
        return np.nan_to_num(arr.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)

    def raw_valid(self, raw: np.ndarray) -> np.ndarray | None:
        return self._metres(raw) > 0

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        d = torch.from_numpy(np.ascontiguousarray(self._metres(raw)))[None]
        mask = d > 0
        return torch.where(mask, d, torch.zeros(())), mask

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        return masked_mean((pred.float() - target.float()).abs(), mask)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        gt = target.double()
        valid = mask & (gt > 0)
        d = pred.double()[valid]
        gt = gt[valid]
        dc = d.clamp_min(1e-9)
        ratio_ = torch.maximum(dc / gt, gt / dc)
        return {
            "sq_err": as_f64((d - gt).square().sum()),
            "sq_log_err": as_f64((dc.log() - gt.log()).square().sum()),
            "abs_rel": as_f64(((d - gt).abs() / gt).sum()),
            "delta1": as_f64((ratio_ < 1.25).sum()),
            "count": as_f64(valid.sum()),
        }

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        n = float(sums["count"])
        return {
            "rmse": math.sqrt(ratio(sums, "sq_err", "count")) if n > 0 else float("nan"),
            "log_rmse": math.sqrt(ratio(sums, "sq_log_err", "count")) if n > 0 else float("nan"),
            "abs_rel": ratio(sums, "abs_rel", "count"),
            "delta1": 100.0 * ratio(sums, "delta1", "count"),
        }
