"""Depth (euclidean distance and z-buffer): 16-bit PNGs in units of 1/512 m, 65535 = no geometry.

* decode: metres ``float32 [1, H, W]``; mask ``code != 65535`` (masked pixels hold 0 m).
* target: the authors' log scale, ``t = log(1 + 512·d) / log(65536)`` ∈ [0, 1] (their loader applies
  ``log(1 + code) / log(2^16)``), regressed with a masked L1 loss.
* to_units: ``d = (exp(t · log 65536) − 1) / 512``, with t clamped to the encoding's range [0, 1] first, so a
  prediction lies in [0, 128] m (65535 / 512, the largest depth a file can hold) and never overflows.
* metrics (paper Table 1, after Eigen et al.): RMSE in metres (primary, lower is better, Δt's default metric),
  absolute and squared relative error, and the share of pixels with ``max(d/d*, d*/d) < 1.25, 1.25², 1.25³`` (%).
  Pixels count when the mask is set and the true depth is > 0. The authors report RMSE after an extra remapping
  of depth onto [1, 80]; this project reports plain metres.
"""

from __future__ import annotations

import math

import numpy as np

from squad.lazy import module, no_grad

from .base import Task, as_f64, integer_image, masked_mean, ratio

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch

DEPTH_SCALE = 512.0  # codes per metre
NO_GEOMETRY = 65535
_LOG_RANGE = math.log(2.0**16)
_MIN_DEPTH = 1e-3  # metres; depth floor used inside ratios


class DepthTask(Task):
    """Euclidean or z-buffer depth (see module docstring)."""

    head_kind = "dense"
    channels = 1
    primary_metric = "rmse"
    higher_is_better = frozenset({"delta1", "delta2", "delta3"})
    bits = 16
    geometric = True
    resample = "bilinear"
    raw_fill = NO_GEOMETRY

    def __init__(self, name: str) -> None:
        self.name = name
        self.domain = name

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        return raw[..., 0] if raw.ndim == 3 else raw

    def raw_valid(self, raw: np.ndarray) -> np.ndarray | None:
        return self.compact_raw(raw) != NO_GEOMETRY

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        code = integer_image(self.compact_raw(raw), 16, self.name)
        code_t = torch.from_numpy(np.ascontiguousarray(code)).to(torch.float32)
        mask = code_t != NO_GEOMETRY
        metres = torch.where(mask, code_t / DEPTH_SCALE, torch.zeros(()))
        return metres.unsqueeze(0), mask.unsqueeze(0)

    def decode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = codes != NO_GEOMETRY
        return torch.where(mask, codes / DEPTH_SCALE, torch.zeros((), device=codes.device)), mask

    def target(self, value: torch.Tensor) -> torch.Tensor:
        return torch.log1p(value.float().clamp_min(0) * DEPTH_SCALE) / _LOG_RANGE

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        # clamped to the encoding's [0, 1]: an untrained head's outputs of 8 would otherwise give e^44 m (inf in RMSE)
        return torch.expm1(pred.float().clamp(0.0, 1.0) * _LOG_RANGE) / DEPTH_SCALE

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        return masked_mean((pred.float() - target.float()).abs(), mask)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        d = self.to_units(pred).double()
        gt = self.to_units(target).double()
        valid = mask & (gt > _MIN_DEPTH)
        d = d[valid]
        gt = gt[valid]
        dc = d.clamp_min(_MIN_DEPTH)
        err = d - gt
        thresh = torch.maximum(dc / gt, gt / dc)
        return {
            "sq_err": as_f64(err.square().sum()),
            "abs_rel": as_f64((err.abs() / gt).sum()),
            "sq_rel": as_f64((err.square() / gt).sum()),
            "delta1": as_f64((thresh < 1.25).sum()),
            "delta2": as_f64((thresh < 1.25**2).sum()),
            "delta3": as_f64((thresh < 1.25**3).sum()),
            "count": as_f64(valid.sum()),
        }

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        return {
            "rmse": math.sqrt(ratio(sums, "sq_err", "count")),
            "abs_rel": ratio(sums, "abs_rel", "count"),
            "sq_rel": ratio(sums, "sq_rel", "count"),
            "delta1": 100.0 * ratio(sums, "delta1", "count"),
            "delta2": 100.0 * ratio(sums, "delta2", "count"),
            "delta3": 100.0 * ratio(sums, "delta3", "count"),
        }
