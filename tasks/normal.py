"""Surface normals: 8-bit RGB, code c ↦ c / 127.5 − 1 per axis, (128, 128, 128) = no normal.

* decode: unit vectors ``float32 [3, H, W]`` (the 8-bit vectors are renormalised); the mask drops pixels whose
  decoded vector is shorter than 0.1 — that is the (128,128,128) / (127,127,127) fill, never a real normal.
  Masked pixels hold the zero vector.
* target: the unit vectors themselves; to_units: L2-normalise the head output.
* loss (paper): ``1 − cos(pred, target)`` averaged over valid pixels.
* metrics: L1 distance per component between the normalised prediction and the truth (primary, as the paper's
  "L1 dis."), and the mean angle between them in degrees.
* a horizontal flip mirrors the image and negates x (channel 0).
"""

from __future__ import annotations

import numpy as np

from squad.lazy import module, no_grad

from .base import DecodeError, Task, as_f64, integer_image, masked_mean, ratio

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch
F = module("torch.nn.functional")

_MIN_NORM = 0.1
_EPS = 1e-6


class UnitVectorTask(Task):
    """A task whose values are unit vectors ``[3, H, W]`` with x first: the decoded vectors are renormalised (pixels
    shorter than 0.1 masked, holding the zero vector), a horizontal flip negates x, and predictions are compared
    after L2 normalisation. Taskonomy's normals (`NormalTask`) and the benchmarks' (`squad.tasks.dense`) share it."""

    @staticmethod
    def unit_vectors(vec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded vectors [3, H, W] → (unit vectors, bool mask [1, H, W] of the pixels at least 0.1 long)."""
        norm = vec.square().sum(0, keepdim=True).sqrt()  # [1, H, W]
        mask = norm >= _MIN_NORM
        return torch.where(mask, vec / norm.clamp_min(_EPS), torch.zeros(())), mask

    def hflip(self, value: torch.Tensor) -> torch.Tensor:
        flipped = torch.flip(value, dims=(-1,))  # [..., 3, H, W]
        return torch.cat([-flipped[..., :1, :, :], flipped[..., 1:, :, :]], dim=-3)

    def target(self, value: torch.Tensor) -> torch.Tensor:
        return value.float()

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        return F.normalize(pred.float(), dim=-3, eps=_EPS)


class NormalTask(UnitVectorTask):
    """Surface normals in camera coordinates (see module docstring)."""

    name = "normal"
    domain = "normal"
    head_kind = "dense"
    channels = 3
    primary_metric = "l1"
    bits = 8
    geometric = True
    resample = "bilinear"
    raw_fill = 128

    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        if raw.ndim != 3 or raw.shape[2] < 3:
            raise DecodeError(f"task normal: expected an RGB image [H, W, 3], got shape {raw.shape}")
        return raw[..., :3]

    def raw_valid(self, raw: np.ndarray) -> np.ndarray | None:
        # the decode rule |c / 127.5 - 1| >= 0.1 in integers: sum((2c - 255)^2) >= (0.1 * 255)^2. A pixel with
        # a channel outside 115..140 passes (|2c - 255| >= 26 > 25.5); only the others need the sum.
        code = self.compact_raw(raw)
        near = ((code.astype(np.uint8, copy=False) - np.uint8(115)) <= 25).all(axis=-1)
        valid = ~near
        if near.any():
            d = 2 * code[near].astype(np.int32) - 255
            valid[near] = np.einsum("nc,nc->n", d, d) >= (_MIN_NORM * 255) ** 2
        return valid

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        code = integer_image(self.compact_raw(raw), 8, self.name)
        vec = torch.from_numpy(np.ascontiguousarray(code)).to(torch.float32).permute(2, 0, 1)  # [3, H, W]
        return self.unit_vectors(vec / 127.5 - 1.0)

    def decode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vec = codes / 127.5 - 1.0  # [B, 3, H, W]
        norm = vec.square().sum(1, keepdim=True).sqrt()
        mask = norm >= _MIN_NORM
        return torch.where(mask, vec / norm.clamp_min(_EPS), torch.zeros((), device=codes.device)), mask

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = self.check_batch(pred, target, mask)
        cos = F.cosine_similarity(pred.float(), target.float(), dim=1, eps=_EPS).unsqueeze(1)  # [B, 1, H, W]
        return masked_mean(1.0 - cos, mask)

    @no_grad
    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        mask = self.check_batch(pred, target, mask)
        p = self.to_units(pred).double()
        t = self.to_units(target).double()
        m = mask.expand_as(p)
        cos = (p * t).sum(1, keepdim=True).clamp(-1.0, 1.0)
        angle = torch.rad2deg(torch.acos(cos))
        return {
            "abs_err": as_f64((p - t).abs()[m].sum()),
            "angle": as_f64(angle[mask].sum()),
            "count": as_f64(mask.sum()),
            "count_elems": as_f64(m.sum()),
        }

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        return {"l1": ratio(sums, "abs_err", "count_elems"), "angle_mean": ratio(sums, "angle", "count")}
