"""Streaming accumulators: integer code histograms (exact quantiles, means and shares) and per-channel moments of
target values, and one accumulator per domain kind (depth, normals, scalar domains, segments, class vectors, the
geometry mask), so memory does not grow with the number of pixels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from squad.data.offline.stats.references import VALID
from squad.tasks import DecodeError, get_task


# ------------------------------------------------------------------------------------------ accumulators
class Moments:
    """Streaming per-channel count, mean and variance (Chan et al.'s merge of batch moments, float64).

    Args:
        channels: number of channels; `update` takes ``[N, channels]`` (or ``[N]`` for one channel).
    """

    def __init__(self, channels: int = 1) -> None:
        self.channels = channels
        self.count = 0
        self._mean = np.zeros(channels)
        self._m2 = np.zeros(channels)

    def update(self, x: np.ndarray) -> None:
        """Adds samples ``[N, C]`` or ``[N]``."""
        x = np.asarray(x, dtype=np.float64).reshape(-1, self.channels)
        n = x.shape[0]
        if n == 0:
            return
        mean = x.mean(axis=0)
        m2 = np.square(x - mean).sum(axis=0)
        total = self.count + n
        delta = mean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + m2 + np.square(delta) * (self.count * n / total)
        self.count = total

    @property
    def mean(self) -> np.ndarray:
        """Per-channel mean (NaN before any sample)."""
        return self._mean.copy() if self.count else np.full(self.channels, np.nan)

    @property
    def std(self) -> np.ndarray:
        """Per-channel population standard deviation (NaN before any sample)."""
        return np.sqrt(self._m2 / self.count) if self.count else np.full(self.channels, np.nan)


class CodeHistogram:
    """Streaming histogram of non-negative integer codes: exact mean, std, quantiles and shares.

    Args:
        size: number of codes (256 for 8-bit files, 65536 for 16-bit ones).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.bins = np.zeros(size, dtype=np.int64)

    def update(self, codes: np.ndarray) -> None:
        """Adds integer codes in ``[0, size)`` (any shape).

        Raises:
            ValueError: a code outside the range.
        """
        codes = np.asarray(codes).reshape(-1)
        if codes.size == 0:
            return
        if codes.min() < 0 or codes.max() >= self.size:
            raise ValueError(f"codes must lie in [0, {self.size}), got [{codes.min()}, {codes.max()}]")
        self.bins += np.bincount(codes.astype(np.int64), minlength=self.size)

    @property
    def count(self) -> int:
        """Number of codes added."""
        return int(self.bins.sum())

    def _values(self) -> np.ndarray:
        return np.arange(self.size, dtype=np.float64)

    @property
    def mean(self) -> float:
        """Mean code (NaN when empty)."""
        n = self.count
        return float(self.bins @ self._values() / n) if n else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation of the codes (NaN when empty)."""
        n = self.count
        if not n:
            return math.nan
        v = self._values()
        mean = self.bins @ v / n
        return float(math.sqrt(max(self.bins @ np.square(v - mean) / n, 0.0)))

    def quantile(self, q: float) -> float:
        """The smallest code whose cumulative share reaches `q` (numpy's ``method="inverted_cdf"``; NaN if empty)."""
        n = self.count
        if not n:
            return math.nan
        cdf = np.cumsum(self.bins)
        return float(np.searchsorted(cdf, q * n, side="left"))

    def share(self, lo: int = 0, hi: int | None = None) -> float:
        """Share (0–1) of codes in ``[lo, hi]`` (inclusive; `hi` None: to the top; NaN when empty)."""
        n = self.count
        if not n:
            return math.nan
        hi = self.size - 1 if hi is None else hi
        lo = max(int(lo), 0)
        return float(self.bins[lo: int(hi) + 1].sum() / n) if hi >= lo else 0.0

    @property
    def min(self) -> float:
        """Smallest code added (NaN when empty)."""
        nz = np.flatnonzero(self.bins)
        return float(nz[0]) if nz.size else math.nan

    @property
    def max(self) -> float:
        """Largest code added (NaN when empty)."""
        nz = np.flatnonzero(self.bins)
        return float(nz[-1]) if nz.size else math.nan


def _pct(share: float) -> float:
    return 100.0 * share


def _median(values: Sequence[float]) -> float:
    return float(np.median(values)) if len(values) else math.nan


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


# -------------------------------------------------------------------------------------- per-domain stats
def as_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


class DomainAccumulator:
    """Accumulates one domain's statistics over views; `add` takes the raw file and the geometry mask."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.task = get_task(domain)

    def pixels(self, raw: np.ndarray, geometry: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes ``[H, W, C]`` as compacted, target ``[C, H, W]``, valid ``bool [H, W]``) of one file.

        Raises:
            DecodeError: the file does not decode, or its size differs from the geometry mask's.
        """
        code = self.task.compact_raw(raw)
        code = code[..., None] if code.ndim == 2 else code
        value, mask = self.task.decode(raw)
        target = as_numpy(self.task.target(value)).astype(np.float64)
        valid = as_numpy(mask)[0].astype(bool)
        if self.task.geometric and geometry is not None:
            if geometry.shape != valid.shape:
                raise DecodeError(f"{self.domain}: size {valid.shape} differs from depth_zbuffer's {geometry.shape}")
            valid = valid & geometry
        return code, target, valid

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        raise NotImplementedError


class GeometryAccumulator(DomainAccumulator):
    """The geometry mask itself: masked share per view."""

    def __init__(self) -> None:
        self.domain = VALID
        self.masked_pct: list[float] = []

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        assert geometry is not None
        self.masked_pct.append(_pct(1.0 - float(geometry.mean())))

    def summary(self) -> dict[str, float]:
        m = self.masked_pct
        return {"masked_pct_mean": _mean(m), "masked_pct_median": _median(m),
                "masked_pct_max": float(max(m)) if m else math.nan,
                "views_fully_valid_pct": _pct(_mean([v == 0 for v in m]))}


class DepthAccumulator(DomainAccumulator):
    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        self.hist = CodeHistogram(65536)
        self.target = Moments(1)

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        code, target, valid = self.pixels(raw, geometry)
        self.hist.update(code[..., 0][valid])
        self.target.update(target[0][valid])

    def summary(self) -> dict[str, float]:
        h, s = self.hist, 512.0
        return {"mean_m": h.mean / s, "std_m": h.std / s, "median_m": h.quantile(0.5) / s,
                "p99_m": h.quantile(0.99) / s, "max_m": h.max / s,
                "target_mean": float(self.target.mean[0]), "target_std": float(self.target.std[0])}


class NormalAccumulator(DomainAccumulator):
    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        self.blue = CodeHistogram(256)
        self.target = Moments(3)
        self.masked = 0
        self.masked_fill = 0

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        code, target, valid = self.pixels(raw, geometry)
        self.blue.update(code[..., 2][valid])
        self.target.update(target[:, valid].T)
        if geometry is not None:
            masked = code[~geometry]
            self.masked += masked.shape[0]
            self.masked_fill += int((masked == 128).all(axis=-1).sum())

    def summary(self) -> dict[str, float]:
        m, s = self.target.mean, self.target.std
        out = {"target_mean_x": m[0], "target_mean_y": m[1], "target_mean_z": m[2],
               "target_std_x": s[0], "target_std_y": s[1], "target_std_z": s[2],
               "blue_over_128_pct": _pct(self.blue.share(129))}
        out["masked_fill_pct"] = _pct(self.masked_fill / self.masked) if self.masked else math.nan
        return {k: float(v) for k, v in out.items()}


# the real fills of invalid pixels, per channel (FACTS §5): curvature (0, 0, 0); reshading 8-13 (a median is shown)
_REAL_FILL = {"principal_curvature": 0}


class ScalarAccumulator(DomainAccumulator):
    """Curvature, reshading, edges, keypoints: code histograms per used channel, target moments."""

    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        spec = self.task.spec
        size = 1 << spec.bits
        self.channels = spec.channels
        self.hists = [CodeHistogram(size) for _ in range(self.channels)]
        self.masked_hists = [CodeHistogram(size) for _ in range(self.channels)]
        self.target = Moments(self.channels)
        self.view_max: list[float] = []
        self.masked_fill = 0
        self._at_127 = 0  # curvature: valid pixels at 127 on both channels (zero curvature)
        # first code at or over the clip's upper end (units = code · scale + offset)
        self.clip_code = (math.ceil((spec.clip[1] - spec.code_offset) / spec.code_scale - 1e-9)
                          if spec.clip is not None else None)

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        code, target, valid = self.pixels(raw, geometry)
        for c in range(self.channels):
            self.hists[c].update(code[..., c][valid])
        self.target.update(target[:, valid].T)
        if valid.any():
            self.view_max.append(float(code[..., 0][valid].max()))
        if geometry is not None and self.task.geometric:
            masked = code[~geometry]
            for c in range(self.channels):
                self.masked_hists[c].update(masked[:, c])
            if self.domain in _REAL_FILL:
                self.masked_fill += int((masked == _REAL_FILL[self.domain]).all(axis=-1).sum())

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        multi = self.channels > 1
        for c, h in enumerate(self.hists):
            sfx = f"_ch{c}" if multi else ""
            out[f"code_mean{sfx}"] = h.mean
            out[f"code_std{sfx}"] = h.std
            out[f"code_median{sfx}"] = h.quantile(0.5)
            out[f"code_p99{sfx}"] = h.quantile(0.99)
            out[f"code_min{sfx}"] = h.min
            out[f"code_max{sfx}"] = h.max
            out[f"zeros_pct{sfx}"] = _pct(h.share(0, 0))
            if self.clip_code is not None:
                out[f"over_clip_pct{sfx}"] = _pct(h.share(self.clip_code))
            out[f"target_mean{sfx}"] = float(self.target.mean[c])
            out[f"target_std{sfx}"] = float(self.target.std[c])
            if self.task.geometric:
                out[f"masked_median{sfx}"] = self.masked_hists[c].quantile(0.5)
        if self.domain == "principal_curvature":
            both = self.hists[0].count
            out["at_127_pct"] = math.nan if not both else _pct(self._at_127 / both)
        if self.domain in _REAL_FILL:
            n = self.masked_hists[0].count
            out["masked_fill_pct"] = _pct(self.masked_fill / n) if n else math.nan
        out["view_max_median"] = _median(self.view_max)
        return out

    def pixels(self, raw: np.ndarray, geometry: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        code, target, valid = super().pixels(raw, geometry)
        if self.domain == "principal_curvature":
            self._at_127 += int((code[valid] == 127).all(axis=-1).sum())
        return code, target, valid


class SegmentAccumulator(DomainAccumulator):
    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        self.hist = CodeHistogram(256)
        self.target = Moments(1)
        self.ids: list[int] = []
        self.has0: list[bool] = []
        self.has255: list[bool] = []

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        code, target, valid = self.pixels(raw, geometry)
        ids = np.unique(code[..., 0])  # ids of the whole file
        self.ids.append(int(ids.size))
        self.has0.append(bool(ids[0] == 0))
        self.has255.append(bool(ids[-1] == 255))
        self.hist.update(code[..., 0][valid])
        self.target.update(target[0][valid])

    def summary(self) -> dict[str, float]:
        return {"ids_per_image_mean": _mean(self.ids),
                "ids_per_image_min": float(min(self.ids)) if self.ids else math.nan,
                "ids_per_image_max": float(max(self.ids)) if self.ids else math.nan,
                "views_with_0_pct": _pct(_mean(self.has0)), "views_with_255_pct": _pct(_mean(self.has255)),
                "code_mean": self.hist.mean,
                "target_mean": float(self.target.mean[0]), "target_std": float(self.target.std[0])}


class ClassAccumulator(DomainAccumulator):
    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        self.top1: list[float] = []
        self.n90: list[int] = []
        self.nonzero: list[int] = []
        self.sum1: list[bool] = []
        self.logits: list[bool] = []

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        value, mask = self.task.decode(raw)
        if not bool(as_numpy(mask).all()):
            raise DecodeError(f"{self.domain}: not a distribution (non-finite or all zero)")
        arr = np.asarray(raw, dtype=np.float64).reshape(-1)
        p = np.sort(as_numpy(value).astype(np.float64))[::-1]
        self.top1.append(float(p[0]))
        self.n90.append(int(np.searchsorted(np.cumsum(p), 0.9 - 1e-9) + 1))
        self.nonzero.append(int((p > 0).sum()))
        self.logits.append(bool((arr < 0).any()))
        self.sum1.append(not self.logits[-1] and abs(float(arr.sum()) - 1.0) < 1e-3)

    def summary(self) -> dict[str, float]:
        return {"top1_mass_mean": _mean(self.top1), "classes_90_mean": _mean(self.n90),
                "nonzero_classes_mean": _mean(self.nonzero), "sums_to_1_pct": _pct(_mean(self.sum1)),
                "logits_pct": _pct(_mean(self.logits))}


def accumulator_for(domain: str) -> DomainAccumulator:
    task = get_task(domain)
    if task.head_kind == "class":
        return ClassAccumulator(domain)
    if domain.startswith("depth"):
        return DepthAccumulator(domain)
    if domain == "normal":
        return NormalAccumulator(domain)
    if domain.startswith("segment"):
        return SegmentAccumulator(domain)
    if hasattr(task, "spec"):
        return ScalarAccumulator(domain)
    raise ValueError(f"no statistics for domain {domain!r} (task {type(task).__name__})")


# the statistics the table shows per domain (the JSON holds every one)
SHOWN = {
    VALID: ["masked_pct_mean", "masked_pct_median", "masked_pct_max", "views_fully_valid_pct"],
    "depth_euclidean": ["mean_m", "std_m", "median_m", "p99_m", "max_m", "target_mean", "target_std"],
    "depth_zbuffer": ["mean_m", "std_m", "median_m", "p99_m", "max_m", "target_mean", "target_std"],
    "normal": ["target_mean_x", "target_mean_y", "target_mean_z", "blue_over_128_pct", "masked_fill_pct"],
    "principal_curvature": ["code_mean_ch0", "code_mean_ch1", "code_std_ch0", "code_std_ch1", "at_127_pct",
                            "target_std_ch0", "target_std_ch1", "masked_fill_pct"],
    "reshading": ["code_mean", "code_std", "code_min", "target_mean", "target_std", "masked_median"],
    "edge_texture": ["code_mean", "code_median", "zeros_pct", "over_clip_pct", "target_mean", "target_std"],
    "edge_occlusion": ["code_mean", "code_std", "zeros_pct", "code_median", "code_p99", "code_max", "target_mean",
                       "target_std"],
    "keypoints2d": ["code_mean", "zeros_pct", "over_clip_pct", "view_max_median", "target_mean", "target_std"],
    "keypoints3d": ["code_mean", "zeros_pct", "code_median", "target_mean", "target_std"],
    "segment_unsup2d": ["ids_per_image_mean", "ids_per_image_min", "ids_per_image_max", "views_with_0_pct",
                        "views_with_255_pct", "target_mean", "target_std"],
    "class_object": ["top1_mass_mean", "classes_90_mean", "nonzero_classes_mean", "sums_to_1_pct", "logits_pct"],
}
SHOWN["segment_unsup25d"] = SHOWN["segment_unsup2d"]
SHOWN["class_scene"] = SHOWN["class_object"]


