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
| edge_occlusion | 16-bit | code / 65535, blurred (below) | – (variant: [0, 0.00625]) | 2u / 0.00625 − 1 | L1 / l1 |
| keypoints2d | 16-bit | code / 65535 | [0, 0.005] | 2u / 0.005 − 1 | L1 / l1 |
| keypoints3d | 16-bit | code / 65535 | – | 2u − 1 | L1 / l1 |
| segment_unsup2d/25d | 8-bit ids, ch 0 | the id | – | 2·id / 255 − 1 | L1 / l1 |

The curvature standardisation uses the authors' per-channel means (123.572, 120.1) and stds (31.922, 21.658).
Occlusion edges follow the original convention by default (``decode="blur"``): the Taskonomy loader
(StanfordVL/taskonomy ``load_ops.resize_rescale_image_gaussian_blur``, config ``edge3d``: ``current_scale
[0, 0.00625]``, ``no_clip=True``) resizes to the 256 px target, rescales to [−1, 1] from [0, 0.00625] without
clipping, then applies ``scipy.ndimage.gaussian_filter(sigma=4)`` (reflecting borders, kernel truncated at 4 σ)
to the whole 256 px image; Mod-Squad's ``rescale_image_gaussian_blur`` does the same after its crop and flip. Here
the blur runs on the decoded units of the whole resized frame, before the crop and flip (`Task.filter_frame`,
called by `squad.data.transforms.SamplePipeline`), with σ = 4 px per 256 px of that frame (σ = 1 at 64 px), and
only over pixels with geometry when the depth_zbuffer mask is at hand (a normalised convolution, so the fill of
holes never enters valid pixels). The rescale commutes with the blur, so the target is the same affine map of the
blurred units, unclipped. ``get_task("edge_occlusion", decode="clip")`` (config key
``model.task_options.edge_occlusion.decode: clip``) is squad's earlier variant: no blur, units clipped to
[0, 0.00625] (target on [−1, 1]). The two give different truths, so metrics (and Δt) compare only runs with the
same variant. Mod-Squad divides codes by 0.00625 · 2¹⁶ where the original and squad use 65535 (1.5·10⁻⁵ relative).

Deviations, on purpose: the authors keep 3 reshading channels (the file's three are the same shading) — here one.
Segment ids are regressed as one scalar channel with L1 as the authors (and the paper's "L1 for the rest") do;
ids are resized with nearest neighbour.
Metrics are the paper's "L1 dis." / "L2 dis." (mean absolute / squared error per element) in units, i.e. after
`to_units`; where a clip range exists the truth is clipped to it as well (``to_units(target(v))``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import numpy as np

from squad.lazy import module, no_grad

from .base import DecodeError, Task, as_f64, integer_image, masked_mean, ratio

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch


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
        blur_sigma: Gaussian blur of the decoded units, in pixels per 256 px of the resized frame (0: none).
        span: the units range the target maps onto [−1, 1] (the clip range, also where nothing is clipped);
            pictures grey over it.
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
    blur_sigma: float = 0.0
    span: tuple[float, float] | None = None


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
    ScalarSpec("edge_texture", 16, 1, 1 / 65535, 0.0, (0.0, 0.08), *_unit_range(0.08), span=(0.0, 0.08)),
    ScalarSpec("edge_occlusion", 16, 1, 1 / 65535, 0.0, None, *_unit_range(0.00625), geometric=True,
               blur_sigma=4.0, span=(0.0, 0.00625)),
    ScalarSpec("keypoints2d", 16, 1, 1 / 65535, 0.0, (0.0, 0.005), *_unit_range(0.005), span=(0.0, 0.005)),
    ScalarSpec("keypoints3d", 16, 1, 1 / 65535, 0.0, None, *_unit_range(1.0), geometric=True),
    ScalarSpec("segment_unsup2d", 8, 1, 1.0, 0.0, None, *_unit_range(255.0), resample="nearest"),
    ScalarSpec("segment_unsup25d", 8, 1, 1.0, 0.0, None, *_unit_range(255.0), geometric=True, resample="nearest"),
)

EDGE_OCCLUSION_DECODES = ("blur", "clip")
BLUR_REFERENCE = 256  # blur_sigma is in pixels of a frame of this size (the original's 256 px target)


def edge_occlusion_spec(decode: str = "blur", blur_sigma: float = 4.0) -> ScalarSpec:
    """The `ScalarSpec` of edge_occlusion for one decoding convention (module docstring).

    Args:
        decode: ``"blur"`` (the original Taskonomy's and Mod-Squad's: Gaussian blur, no clip) or ``"clip"``
            (no blur, units clipped to [0, 0.00625]).
        blur_sigma: σ in pixels per 256 px of the resized frame (``"blur"`` only).

    Raises:
        ValueError: an unknown `decode` or a `blur_sigma` that is not a positive number (the message starts with
            the option's name).
    """
    if decode not in EDGE_OCCLUSION_DECODES:
        raise ValueError(f"decode: expected one of {', '.join(EDGE_OCCLUSION_DECODES)}, got {decode!r}")
    if isinstance(blur_sigma, bool) or not isinstance(blur_sigma, int | float) or not 0 < blur_sigma < 1e3:
        raise ValueError(f"blur_sigma: expected a number of pixels > 0, got {blur_sigma!r}")
    base = next(s for s in SCALAR_SPECS if s.name == "edge_occlusion")
    if decode == "clip":
        return dataclasses.replace(base, clip=(0.0, 0.00625), blur_sigma=0.0)
    return dataclasses.replace(base, clip=None, blur_sigma=float(blur_sigma))


def gaussian_kernel(sigma: float, truncate: float = 4.0) -> torch.Tensor:
    """The normalised 1-D Gaussian of ``scipy.ndimage.gaussian_filter1d``: radius ``int(truncate·σ + 0.5)``."""
    radius = int(truncate * sigma + 0.5)
    k = np.arange(-radius, radius + 1)
    w = np.exp(-0.5 * (k / sigma) ** 2)
    return torch.from_numpy((w / w.sum()).astype(np.float32))


def reflect_index(n: int, radius: int) -> torch.Tensor:
    """Indices that pad a length-n axis by `radius` on both sides, reflected about the edge (scipy's
    ``mode="reflect"``: d c b a | a b c d | d c b a), for any radius."""
    j = torch.arange(-radius, n + radius) % (2 * n)  # the half-sample symmetric extension has period 2n
    return torch.where(j >= n, 2 * n - 1 - j, j)


@functools.lru_cache(maxsize=16)
def gaussian_matrix(n: int, sigma: float) -> torch.Tensor:
    """``[n, n]`` matrix B with ``B @ x`` = `gaussian_kernel` convolved along a length-n axis with `reflect_index`
    borders (scipy's ``gaussian_filter1d(x, sigma, mode="reflect")``). Cached: do not modify it. Never an
    inference tensor (the cache outlives `torch.inference_mode`), so autograd may save it."""
    with torch.inference_mode(False):
        return _gaussian_matrix(n, sigma)


def _gaussian_matrix(n: int, sigma: float) -> torch.Tensor:
    kernel = gaussian_kernel(sigma)
    taps = len(kernel)
    band = torch.zeros(n, n + taps - 1)
    for t in range(taps):  # band[i, i + t] = kernel[t]
        band.diagonal(t).copy_(kernel[t].expand(n))
    out = torch.zeros(n, n)
    return out.index_add_(1, reflect_index(n, (taps - 1) // 2), band)


def gaussian_blur(value: torch.Tensor, sigma: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Blurs ``value [C, H, W]`` with a Gaussian of σ `sigma` pixels: ``scipy.ndimage.gaussian_filter`` on each
    channel (separable, borders reflected about the edge, kernel truncated at 4 σ), as two products with cached
    `gaussian_matrix` es (cheaper than a convolution on a CPU at these sizes).

    With `valid` (``bool [1, H, W]``) the blur is a normalised convolution over valid pixels only — ``G∗(v·m) /
    G∗m`` — so invalid pixels' values never reach valid ones; invalid pixels come out 0.
    """
    c, h, w = value.shape
    bh, bw = gaussian_matrix(h, float(sigma)), gaussian_matrix(w, float(sigma))
    v = value.float()
    if valid is None or bool(valid.all()):
        return bh @ v @ bw.T
    m = valid.to(v.dtype)
    x = bh @ torch.cat([v * m, m]) @ bw.T  # the numerator channels and the mask's own blur in one pass
    num, den = x[:c], x[c:]
    return torch.where(valid, num / den.clamp_min(1e-12), torch.zeros((), dtype=x.dtype))


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
        self.frame_filter = spec.blur_sigma > 0

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

    def decode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value = codes * self.spec.code_scale + self.spec.code_offset
        return value, torch.ones((value.shape[0], 1, *value.shape[-2:]), dtype=torch.bool, device=codes.device)

    def filter_frame(self, value: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The spec's Gaussian blur (σ = blur_sigma · frame / 256 px) over the whole resized frame; mask-aware when
        `valid` is given. The identity for specs without a blur."""
        if self.spec.blur_sigma <= 0:
            return value
        sigma = self.spec.blur_sigma * max(value.shape[-2:]) / BLUR_REFERENCE
        return gaussian_blur(value, sigma, valid)

    def filter_frames(self, value: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`filter_frame` of a batch on its device: the blur of `gaussian_blur` as batched matrix products (a
        sample whose pixels are all valid takes the plain blur, as `gaussian_blur` gives it)."""
        if self.spec.blur_sigma <= 0:
            return value
        sigma = self.spec.blur_sigma * max(value.shape[-2:]) / BLUR_REFERENCE
        bh = gaussian_matrix(value.shape[-2], float(sigma)).to(value.device)
        bw = gaussian_matrix(value.shape[-1], float(sigma)).to(value.device)
        c = value.shape[1]
        v = value.float()
        m = valid.to(v.dtype)
        x = bh @ torch.cat([v * m, m, v], dim=1) @ bw.T  # masked numerator, the mask's blur, the plain blur
        num, den, plain = x[:, :c], x[:, c:c + 1], x[:, c + 1:]
        masked = torch.where(valid, num / den.clamp_min(1e-12), torch.zeros((), dtype=x.dtype, device=x.device))
        return torch.where(valid.flatten(1).all(1).view(-1, 1, 1, 1), plain, masked)

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

    @no_grad
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
