"""Dense tasks whose target is an affine map of the file's codes: curvature, reshading, edges, keypoints, segments.

Each is described by a `ScalarSpec`: the bit depth, which channels are used, the code → units map, an optional
clip range in units, and the units → target map. The choices follow the authors' Taskonomy loader
(UMass-Foundation-Model/Mod-Squad, ``util/dataset_taskonomy.py``), which rescales every target to [−1, 1] from a
per-domain clip range, and their losses (``engine_mt.get_loss``: L2 for curvature, L1 for the rest):

| task | file | units | clip (units) | target | loss / metric |
| --- | --- | --- | --- | --- | --- |
| principal_curvature | 8-bit, ch 0–1 | (code − 127) / 127 | – | (code − mean) / std (below) | L2 / l2 (MSE) |
| reshading | 8-bit, ch 0 | code / 255 | – | 2u − 1 | L1 / l1 |
| edge_texture | 16-bit | code / 65535 | [0, 0.08] | 2u / 0.08 − 1 | L1 / l1 |
| edge_occlusion | 16-bit | code / 65535 | [0, 0.00625] | 2u / 0.00625 − 1 | L1 / l1 |
| keypoints2d | 16-bit | code / 65535 | [0, 0.005] | 2u / 0.005 − 1 | L1 / l1 |
| keypoints3d | 16-bit | code / 65535 | – | 2u − 1 | L1 / l1 |
| segment_unsup2d/25d | 8-bit ids, ch 0 | the id | – | 2·id / 255 − 1 | L1 / l1 |

The curvature standardisation uses the authors' per-channel means (123.572, 120.1) and stds (31.922, 21.658).
Deviations, on purpose: the authors keep 3 reshading channels (the file's three are the same shading) — here one;
they blur the occlusion edges (Gaussian, σ = 4) and do not clip them — here the usual clip at 0.00625 and no
blur, so the target stays invertible and on [−1, 1]. Segment ids are regressed as one scalar channel with L1
as the authors (and the paper's "L1 for the rest") do; ids are resized with nearest neighbour.
Metrics are the paper's "L1 dis." / "L2 dis." (mean absolute / squared error per element) in units, i.e. after
`to_units`; where a clip range exists the truth is clipped to it as well (``to_units(target(v))``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from .base import DecodeError, Task, as_f64, integer_image, masked_mean, ratio


@dataclasses.dataclass(frozen=True)
class ScalarSpec:
    """How one scalar-valued dense domain is read and learned.

    Attributes:
        name: canonical task (and domain) name.
        bits: 8 or 16.
        channels: channels used, the first `channels` of the file.
        code_scale, code_offset: units = code · code_scale + code_offset.
        clip: (low, high) in units applied before the target map, or None.
        t_scale, t_offset: target = clip(units) · t_scale + t_offset, one entry per channel (or one for all).
        loss: ``"l1"`` or ``"l2"``; the metric of the same name is the primary metric.
        geometric: masked where depth_zbuffer has no geometry.
        resample: ``"bilinear"`` or ``"nearest"``.
    """

    name: str
    bits: int
    channels: int
    code_scale: float
    code_offset: float
    clip: tuple[float, float] | None
    t_scale: Sequence[float]
    t_offset: Sequence[float]
    loss: Literal["l1", "l2"] = "l1"
    geometric: bool = False
    resample: Literal["bilinear", "nearest"] = "bilinear"


_CURV_MEAN = (123.572, 120.1)
_CURV_STD = (31.922, 21.658)


def _unit_range(high: float) -> tuple[tuple[float], tuple[float]]:
    """(scale, offset) that maps [0, high] onto [−1, 1]."""
    return (2.0 / high,), (-1.0,)


SCALAR_SPECS: tuple[ScalarSpec, ...] = (
    ScalarSpec("principal_curvature", 8, 2, 1 / 127, -1.0, None,
               tuple(127.0 / s for s in _CURV_STD),
               tuple((127.0 - m) / s for m, s in zip(_CURV_MEAN, _CURV_STD, strict=True)),
               loss="l2", geometric=True),
    ScalarSpec("reshading", 8, 1, 1 / 255, 0.0, None, *_unit_range(1.0), geometric=True),
    ScalarSpec("edge_texture", 16, 1, 1 / 65535, 0.0, (0.0, 0.08), *_unit_range(0.08)),
    ScalarSpec("edge_occlusion", 16, 1, 1 / 65535, 0.0, (0.0, 0.00625), *_unit_range(0.00625), geometric=True),
    ScalarSpec("keypoints2d", 16, 1, 1 / 65535, 0.0, (0.0, 0.005), *_unit_range(0.005)),
    ScalarSpec("keypoints3d", 16, 1, 1 / 65535, 0.0, None, *_unit_range(1.0), geometric=True),
    ScalarSpec("segment_unsup2d", 8, 1, 1.0, 0.0, None, *_unit_range(255.0), resample="nearest"),
    ScalarSpec("segment_unsup25d", 8, 1, 1.0, 0.0, None, *_unit_range(255.0), geometric=True, resample="nearest"),
)


class ScalarTask(Task):
    """A dense task defined by a `ScalarSpec` (see module docstring for the table)."""

    head_kind = "dense"

    def __init__(self, spec: ScalarSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.domain = spec.name
        self.channels = spec.channels
        self.bits = spec.bits
        self.primary_metric = spec.loss
        self.geometric = spec.geometric
        self.resample = spec.resample
        self.raw_fill = 0

    def _per_channel(self, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        v = torch.tensor(list(values), dtype=like.dtype, device=like.device)
        v = v.expand(self.channels) if v.numel() == 1 else v
        return v.view(self.channels, 1, 1)  # broadcasts over [..., C, H, W]

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        if raw.ndim == 3:
            if raw.shape[2] < self.channels:
                raise DecodeError(f"task {self.name}: expected at least {self.channels} channels, "
                                  f"got shape {raw.shape}")
            return raw[..., 0] if self.channels == 1 else raw[..., : self.channels]
        if self.channels != 1:
            raise DecodeError(f"task {self.name}: expected an image with {self.channels} channels, "
                              f"got shape {raw.shape}")
        return raw

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        code = integer_image(self.compact_raw(raw), self.bits, self.name)
        t = torch.from_numpy(np.ascontiguousarray(code)).to(torch.float32)
        t = t.unsqueeze(0) if t.dim() == 2 else t.permute(2, 0, 1)  # [C, H, W]
        value = t * self.spec.code_scale + self.spec.code_offset
        mask = torch.ones((1, *value.shape[-2:]), dtype=torch.bool)
        return value, mask

    def target(self, value: torch.Tensor) -> torch.Tensor:
        v = value.float()
        if self.spec.clip is not None:
            v = v.clamp(*self.spec.clip)
        return v * self._per_channel(self.spec.t_scale, v) + self._per_channel(self.spec.t_offset, v)

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        p = pred.float()
        return (p - self._per_channel(self.spec.t_offset, p)) / self._per_channel(self.spec.t_scale, p)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        diff = pred.float() - target.float()
        err = diff.square() if self.spec.loss == "l2" else diff.abs()
        return masked_mean(err, mask)

    @torch.no_grad()
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        diff = (self.to_units(pred).double() - self.to_units(target).double())
        m = mask.expand_as(diff)
        return {
            "abs_err": as_f64(diff.abs()[m].sum()),
            "sq_err": as_f64(diff.square()[m].sum()),
            "count": as_f64(m.sum()),
        }

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        return {"l1": ratio(sums, "abs_err", "count"), "l2": ratio(sums, "sq_err", "count")}
