"""Statistics of a Taskonomy dataset beside the real files' (``python tools/make_data.py stats ROOT``).

`dataset_stats(root)` samples up to `max_images` views of a Taskonomy tree (either layout, split CSVs as the reader
takes them), of the synthetic tree (the same format) or of HDF5 shards written by ``make_data.py pack``, and gives
per domain: code statistics (on the raw codes, read with `squad.data.taskonomy.read_raw`), target-space statistics
(through the project's own decoders: ``get_task(d).decode`` then ``.target``), the masked share, ids per image for
the segment domains and the spread of the class distributions, each beside the range real Taskonomy files show and
flagged when it falls outside. It is how a user checks a download, and how the synthetic renderer is held to
Taskonomy (``tests/test_data_stats.py``).

Pixels: valid pixels are the depth_zbuffer geometry mask (code ≠ 65535), ANDed with the task's own decode mask, for
the geometric tasks (`Task.geometric`); every pixel counts for the others. The "masked" statistics look at the
geometry-invalid pixels (the fill codes). Views lacking depth_zbuffer use the task's own mask.

Sampling: views are taken evenly across buildings (sorted), deterministically: with more buildings than
`max_images`, one view (the middle one of the sorted names) from each of `max_images` evenly spaced buildings;
otherwise the budget is shared out evenly over buildings (water filling) and each building's views are taken evenly
spaced in sorted order. Accumulators stream (codes go into integer histograms — exact quantiles, means and shares —
target values into per-channel moments), so memory does not grow with the number of pixels.

Reference ranges (`REFERENCES`) are the real files' figures collected in the project's FACTS (§5, "What real files
look like"): real-format example views shipped in the omnidata repository (a Taskonomy building, Replica, HM3D) and
the per-task constants of tstandley/taskgrouping, measured on real Taskonomy. They are never fitted to synthetic
data. Tolerance rule (one rule for every row): since single views are indicative only, a value is accepted within
the stated range widened on each side by `TOLERANCE` (25 %) of the larger magnitude of its bounds, and at least by
the row's ``floor`` (non-zero only for ranges around 0, where a relative margin is empty). An approximate figure
("~2.9 m") is the range [2.9, 2.9] under the same rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from squad.data.taskonomy import (
    SPLITS,
    CorruptFileError,
    domain_dir,
    file_ext,
    find_split_csv,
    list_stems,
    make_data_hint,
    read_raw,
    read_split_csv,
)
from squad.tasks import TASK_NAMES, DecodeError, get_task

TOLERANCE = 0.25
GEOMETRY = "depth_zbuffer"
NO_GEOMETRY = 65535
VALID = "valid pixels"  # the pseudo-domain of the geometry mask's statistics

SOURCES = {
    "facts": "FACTS §5 'What real files look like' (real-format example views of the omnidata repository)",
    "tg": "tstandley/taskgrouping per-task constants, measured on real Taskonomy (via FACTS §5)",
    "taskonomy": "Taskonomy file format (FACTS §5 decoding table and fills)",
}


# ------------------------------------------------------------------------------------------- references
@dataclasses.dataclass(frozen=True)
class Reference:
    """A real range of one statistic.

    Attributes:
        lo, hi: the range stated by the source (``hi = inf`` for a lower bound only).
        source: a key of `SOURCES`.
        floor: the least tolerance (for ranges around 0), in the statistic's units.
        note: what the figure was stated as, when it helps to read it.
    """

    lo: float
    hi: float
    source: str
    floor: float = 0.0
    note: str = ""

    @property
    def tolerance(self) -> float:
        """The margin added on each side (the module's tolerance rule)."""
        finite = [abs(v) for v in (self.lo, self.hi) if math.isfinite(v)]
        return max(TOLERANCE * max(finite), self.floor)

    @property
    def accepted(self) -> tuple[float, float]:
        """The widened range a value must fall in."""
        return self.lo - self.tolerance, self.hi + self.tolerance

    def flag(self, value: float | None) -> str:
        """``""`` inside, ``"LOW"`` / ``"HIGH"`` outside, ``"n/a"`` when there is no value."""
        if value is None or not math.isfinite(value):
            return "n/a"
        lo, hi = self.accepted
        return "LOW" if value < lo else "HIGH" if value > hi else ""

    def stated(self) -> str:
        """The source's range as text."""
        if math.isinf(self.hi):
            return f"≥ {_fmt(self.lo)}"
        return f"~{_fmt(self.lo)}" if self.lo == self.hi else f"{_fmt(self.lo)}–{_fmt(self.hi)}"


def _r(lo: float, hi: float | None = None, source: str = "facts", floor: float = 0.0, note: str = "") -> Reference:
    return Reference(lo, lo if hi is None else hi, source, floor, note)


_SEGMENT_REFS = {
    "ids_per_image_mean": _r(25, 65),
    "views_with_0_pct": _r(100, note="0 always present"),
    "views_with_255_pct": _r(100, note="255 always present (ids rescaled over the byte range)"),
    "target_std": _r(0.5, 0.7),
}

REFERENCES: dict[str, dict[str, Reference]] = {
    VALID: {
        "masked_pct_mean": _r(6, 8, note="~6-8 % masked on Taskonomy views (windows, holes, far geometry)"),
        "masked_pct_median": _r(0, 8, note="92-100 % of the pixels valid per view"),
    },
    "depth_zbuffer": {
        "mean_m": _r(2.9, source="tg"),
        "std_m": _r(2.0, source="tg"),
    },
    "depth_euclidean": {
        "mean_m": _r(2.9, 3.7, note="taskgrouping ~2.9 m; example views mean 3.7 m"),
        "std_m": _r(2.0, source="tg"),
    },
    "normal": {
        "target_mean_x": _r(0.0, floor=0.1, note="decoded target means ≈ (0.0, -0.1…0.2, -0.3…-0.6)"),
        "target_mean_y": _r(-0.1, 0.2),
        "target_mean_z": _r(-0.6, -0.3, note="z points into the scene: surfaces facing the camera are blue ≈ 20"),
        "masked_fill_pct": _r(100, source="taskonomy", note="invalid pixels hold (128, 128, 128)"),
    },
    "principal_curvature": {
        "code_std_ch0": _r(35, 41, note="127 ± 41 on valid pixels; taskgrouping 35"),
        "code_std_ch1": _r(9, 13, note="127 ± 13 on valid pixels; taskgrouping 9.2"),
        "target_std_ch0": _r(1.1, 1.3),
        "target_std_ch1": _r(0.5, 0.6),
        "masked_fill_pct": _r(100, source="taskonomy", note="invalid pixels hold (0, 0, 0)"),
    },
    "reshading": {
        "code_mean": _r(75, 112, note="example views; taskgrouping 126.5"),
        "code_std": _r(72.6, source="tg"),
        "target_mean": _r(-0.4, -0.1),
        "masked_median": _r(8, 13, source="taskonomy", note="fill 8-13 on invalid pixels"),
    },
    "edge_texture": {
        "code_mean": _r(920, 1100),
        "over_clip_pct": _r(2, note="~2 % at or over the 0.08 clip"),
    },
    "edge_occlusion": {
        # ~10 % of ALL pixels are exact zeros on the example view, but most of them lie where there is no geometry:
        # on pixels with geometry (what this table measures) the same file has 2.9 % zeros.
        "zeros_pct": _r(2.9, note="~10 % of all pixels, 2.9 % of pixels with geometry (omnidata's Taskonomy view)"),
        "code_median": _r(29),
        "code_p99": _r(1100),
        "code_mean": _r(56, source="tg"),
        "code_std": _r(239, source="tg"),
    },
    "keypoints2d": {
        "code_mean": _r(71, 92),
        "zeros_pct": _r(4, 5),
        "over_clip_pct": _r(3, 5, note="over the 0.005 clip"),
        "view_max_median": _r(1100, 1600, note="max ~1.1-1.6 k per view"),
    },
    "keypoints3d": {
        "code_mean": _r(3800, 5500),
        "zeros_pct": _r(44, 59),
    },
    "segment_unsup2d": _SEGMENT_REFS,
    "segment_unsup25d": _SEGMENT_REFS,
    "class_object": {
        "classes_90_mean": _r(3, math.inf, note="a ResNet-152 softmax spread over many classes, not one-hot; no "
                                                "published figure: a lower bound only"),
    },
}

_LABELS = {
    "views": "views read",
    "masked_pct_mean": "masked share, mean over views (%)",
    "masked_pct_median": "masked share per view, median (%)",
    "masked_pct_max": "masked share per view, max (%)",
    "views_fully_valid_pct": "views without masked pixels (%)",
    "mean_m": "mean (m)",
    "std_m": "std (m)",
    "median_m": "median (m)",
    "p99_m": "p99 (m)",
    "max_m": "max (m)",
    "target_mean": "target mean",
    "target_std": "target std",
    "target_mean_x": "target mean x (ch0)",
    "target_mean_y": "target mean y (ch1)",
    "target_mean_z": "target mean z (ch2)",
    "blue_over_128_pct": "blue > 128 (% of valid)",
    "masked_fill_pct": "masked pixels holding the fill (%)",
    "masked_median": "masked pixels, median code",
    "code_mean": "code mean",
    "code_std": "code std",
    "code_median": "code median",
    "code_p99": "code p99",
    "code_min": "code min",
    "code_max": "code max",
    "zeros_pct": "zeros (%)",
    "over_clip_pct": "at/over the clip (%)",
    "at_127_pct": "code 127 on every channel (% of valid)",
    "view_max_median": "max per view, median (codes)",
    "ids_per_image_mean": "ids per image, mean",
    "ids_per_image_min": "ids per image, min",
    "ids_per_image_max": "ids per image, max",
    "views_with_0_pct": "views holding id 0 (%)",
    "views_with_255_pct": "views holding id 255 (%)",
    "top1_mass_mean": "top-1 mass, mean",
    "classes_90_mean": "classes holding 90 % of the mass, mean",
    "nonzero_classes_mean": "non-zero classes, mean",
    "sums_to_1_pct": "files summing to 1 (%)",
    "logits_pct": "files holding logits (%)",
}


def _label(key: str) -> str:
    for suffix in ("_ch0", "_ch1", "_ch2"):
        if key.endswith(suffix):
            return f"{_LABELS.get(key[: -len(suffix)], key[: -len(suffix)])} {suffix[1:]}"
    return _LABELS.get(key, key)


def _fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-" if v is None else str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


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
def _as_numpy(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


class _Domain:
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
        target = _as_numpy(self.task.target(value)).astype(np.float64)
        valid = _as_numpy(mask)[0].astype(bool)
        if self.task.geometric and geometry is not None:
            if geometry.shape != valid.shape:
                raise DecodeError(f"{self.domain}: size {valid.shape} differs from depth_zbuffer's {geometry.shape}")
            valid = valid & geometry
        return code, target, valid

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        raise NotImplementedError

    def summary(self) -> dict[str, float]:
        raise NotImplementedError


class _Geometry(_Domain):
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


class _Depth(_Domain):
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


class _Normal(_Domain):
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


class _Scalar(_Domain):
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


class _Segment(_Domain):
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


class _Class(_Domain):
    def __init__(self, domain: str) -> None:
        super().__init__(domain)
        self.top1: list[float] = []
        self.n90: list[int] = []
        self.nonzero: list[int] = []
        self.sum1: list[bool] = []
        self.logits: list[bool] = []

    def add(self, raw: np.ndarray, geometry: np.ndarray | None) -> None:
        value, mask = self.task.decode(raw)
        if not bool(_as_numpy(mask).all()):
            raise DecodeError(f"{self.domain}: not a distribution (non-finite or all zero)")
        arr = np.asarray(raw, dtype=np.float64).reshape(-1)
        p = np.sort(_as_numpy(value).astype(np.float64))[::-1]
        self.top1.append(float(p[0]))
        self.n90.append(int(np.searchsorted(np.cumsum(p), 0.9 - 1e-9) + 1))
        self.nonzero.append(int((p > 0).sum()))
        self.logits.append(bool((arr < 0).any()))
        self.sum1.append(not self.logits[-1] and abs(float(arr.sum()) - 1.0) < 1e-3)

    def summary(self) -> dict[str, float]:
        return {"top1_mass_mean": _mean(self.top1), "classes_90_mean": _mean(self.n90),
                "nonzero_classes_mean": _mean(self.nonzero), "sums_to_1_pct": _pct(_mean(self.sum1)),
                "logits_pct": _pct(_mean(self.logits))}


def _accumulator(domain: str) -> _Domain:
    task = get_task(domain)
    if task.head_kind == "class":
        return _Class(domain)
    if domain.startswith("depth"):
        return _Depth(domain)
    if domain == "normal":
        return _Normal(domain)
    if domain.startswith("segment"):
        return _Segment(domain)
    if hasattr(task, "spec"):
        return _Scalar(domain)
    raise ValueError(f"no statistics for domain {domain!r} (task {type(task).__name__})")


# the statistics the table shows per domain (the JSON holds every one)
_SHOWN = {
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
_SHOWN["segment_unsup25d"] = _SHOWN["segment_unsup2d"]
_SHOWN["class_scene"] = _SHOWN["class_object"]


# ---------------------------------------------------------------------------------------------- sources
def sample_views(groups: dict[str, Sequence[str]], max_images: int | None) -> list[tuple[str, str]]:
    """Chooses views evenly across buildings (module docstring), deterministically.

    Args:
        groups: building → its view stems (any order; sorted here).
        max_images: the most views to take (None: all).

    Returns:
        ``(building, stem)`` pairs, buildings in sorted order.
    """
    names = sorted(b for b, stems in groups.items() if len(stems))
    total = sum(len(groups[b]) for b in names)
    budget = total if max_images is None else min(int(max_images), total)
    quota: dict[str, int] = {}
    if budget < len(names):  # more buildings than views: one each from evenly spaced buildings
        picks = set(np.linspace(0, len(names) - 1, budget).round().astype(int).tolist()) if budget else set()
        quota = {b: int(i in picks) for i, b in enumerate(names)}
    else:  # water filling, smallest buildings first: each takes its share or all it has
        left = budget
        for i, b in enumerate(sorted(names, key=lambda b: (len(groups[b]), b))):
            quota[b] = min(len(groups[b]), left // (len(names) - i))
            left -= quota[b]
    out = []
    for b in names:
        stems = sorted(groups[b])
        q = quota.get(b, 0)
        if q == 1:
            out.append((b, stems[len(stems) // 2]))
        elif q:
            out.extend((b, stems[i]) for i in np.linspace(0, len(stems) - 1, q).round().astype(int))
    return out


class _TreeSource:
    """Views of a Taskonomy tree (either layout)."""

    kind = "tree"

    def __init__(self, root: Path, domains: list[str], split: str | None, partitions: Sequence[str],
                 max_images: int | None) -> None:
        self.root = root
        self.dirs = {d: domain_dir(root, d) for d in ["rgb", *domains]}
        self.present = [d for d in domains if self.dirs[d] is not None]
        self.absent = [d for d in domains if self.dirs[d] is None]
        self.layouts = {d: ("{domain}/taskonomy/{building}" if p.name == "taskonomy" else "{domain}/{building}")
                        for d, p in self.dirs.items() if p is not None}
        ref = next((d for d in ("rgb", GEOMETRY, *domains) if self.dirs.get(d) is not None), None)
        if ref is None:
            raise FileNotFoundError(f"no Taskonomy domain folder in {root} (looked for rgb and "
                                    f"{', '.join(domains)} in either layout). {make_data_hint(root)}")
        self.listed = ref
        on_disk = sorted(e.name for e in os.scandir(self.dirs[ref]) if e.is_dir())
        self.split_csv: str | None = None
        if split is None:
            buildings = on_disk
        else:
            csv = find_split_csv(root, None if split in (*SPLITS, "all") else split)
            if csv is None:
                raise ValueError(f"no split CSV (train_val_test_*.csv) in {root}: --split {split} needs one")
            self.split_csv = str(csv)
            table = read_split_csv(csv)
            chosen = SPLITS if split == "all" else [split] if split in SPLITS else list(partitions)
            wanted = list(dict.fromkeys(b for s in chosen for b in table[s]))
            have = set(on_disk)
            self.unlisted = [b for b in wanted if b not in have]
            buildings = [b for b in wanted if b in have]
        self.buildings = buildings
        self.views = self._sample(buildings, max_images)

    def _sample(self, buildings: list[str], max_images: int | None) -> list[tuple[str, str]]:
        folder = self.dirs[self.listed]
        if max_images is not None and len(buildings) > max_images:  # list only the buildings that give a view
            picks = sorted(set(np.linspace(0, len(buildings) - 1, max_images).round().astype(int).tolist()))
            buildings = [buildings[i] for i in picks]
        groups = {b: list_stems(folder / b, self.listed) for b in buildings}
        return sample_views(groups, max_images)

    def name(self, view: tuple[str, str], domain: str) -> str:
        b, stem = view
        return str(self.dirs[domain] / b / f"{stem}_domain_{domain}{file_ext(domain)}")

    def read(self, view: tuple[str, str], domain: str) -> np.ndarray:
        """The raw file (FileNotFoundError when the view lacks it; CorruptFileError)."""
        return read_raw(self.name(view, domain))

    def describe(self) -> str:
        layouts = sorted(set(self.layouts.values()))
        return f"Taskonomy tree, layout {' and '.join(layouts)}"


class _ShardSource:
    """Views of HDF5 shards written by ``make_data.py pack``."""

    kind = "shards"

    def __init__(self, root: Path, domains: list[str], split: str | None, partitions: Sequence[str],
                 max_images: int | None) -> None:
        import h5py

        from squad.data.shards import FORMAT, INDEX_NAME

        self.root = root
        self.index = json.loads((root / INDEX_NAME).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{root / INDEX_NAME}: not a squad shard index (format {self.index.get('format')!r})")
        packed = self.index["domains"]
        self.present = [d for d in domains if d in packed]
        self.absent = [d for d in domains if d not in packed]
        if split is not None and split not in (*SPLITS, "all"):
            raise ValueError(f"--split {split!r}: shards were split when packed; use one of "
                             f"{', '.join((*SPLITS, 'all'))} (packed: "
                             f"{sorted({s['split'] for s in self.index['shards']})})")
        chosen = None if split in (None, "all") else [split] if split in SPLITS else list(partitions)
        self.files = [s["file"] for s in self.index["shards"] if chosen is None or s["split"] in chosen]
        self.split_csv = self.index.get("split_csv")
        self.cols = {d: packed.index(d) for d in self.present}
        groups: dict[str, list[str]] = {}
        self.where: dict[tuple[str, str], tuple[int, int, np.ndarray]] = {}
        for fi, name in enumerate(self.files):
            with h5py.File(root / name, "r") as f:
                ids = f["id"].asstr()[...]
                present = f["present"][...]
            for row, sid in enumerate(ids):
                b, _, stem = str(sid).partition("/")
                groups.setdefault(b, []).append(stem)
                self.where[(b, stem)] = (fi, row, present[row])
        self.buildings = sorted(groups)
        self.views = sample_views(groups, max_images)
        self._handles: dict[int, Any] = {}

    def name(self, view: tuple[str, str], domain: str) -> str:
        fi, row, _ = self.where[view]
        return f"{self.root / self.files[fi]}[{row}] {view[0]}/{view[1]} ({domain})"

    def read(self, view: tuple[str, str], domain: str) -> np.ndarray:
        import h5py

        fi, row, present = self.where[view]
        if not present[self.cols[domain]]:
            raise FileNotFoundError(self.name(view, domain))
        try:
            if fi not in self._handles:
                self._handles[fi] = h5py.File(self.root / self.files[fi], "r")
            return self._handles[fi][domain][row]
        except (OSError, KeyError) as e:
            raise CorruptFileError(f"unreadable {self.name(view, domain)}: {e}") from e

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles = {}

    def describe(self) -> str:
        return f"HDF5 shards ({len(self.files)} files, stored at {self.index.get('image_size')} px)"


# ---------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class Stat:
    """One statistic of one domain, with its real range when there is one."""

    key: str
    value: float
    reference: Reference | None = None

    @property
    def flag(self) -> str:
        """``""``, ``"LOW"``, ``"HIGH"`` or ``"n/a"`` (only statistics with a reference are flagged)."""
        return self.reference.flag(self.value) if self.reference is not None else ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "label": _label(self.key),
                               "value": None if not math.isfinite(self.value) else self.value}
        if self.reference is not None:
            r = self.reference
            out.update(real=[r.lo, r.hi if math.isfinite(r.hi) else None],
                       accepted=[v if math.isfinite(v) else None for v in r.accepted],
                       source=SOURCES[r.source], note=r.note, flag=self.flag)
        return out


@dataclasses.dataclass
class DomainStats:
    """What was read of one domain and its statistics.

    Attributes:
        domain: the domain (or ``"valid pixels"`` for the geometry mask).
        files: files read and used.
        missing: sampled views lacking the file.
        corrupt: the files that could not be read or decoded (named, with the reason).
        stats: every statistic, in the accumulator's order.
    """

    domain: str
    files: int = 0
    missing: int = 0
    corrupt: list[str] = dataclasses.field(default_factory=list)
    stats: list[Stat] = dataclasses.field(default_factory=list)

    @property
    def outside(self) -> list[Stat]:
        """Statistics outside their real range."""
        return [s for s in self.stats if s.flag in ("LOW", "HIGH")]

    def get(self, key: str) -> float:
        """The value of one statistic (KeyError naming the known keys)."""
        for s in self.stats:
            if s.key == key:
                return s.value
        raise KeyError(f"{self.domain}: no statistic {key!r} (have {', '.join(s.key for s in self.stats)})")


@dataclasses.dataclass
class DatasetStats:
    """The result of `dataset_stats`: per-domain statistics and what could not be read."""

    root: str
    source: str
    views: int
    buildings: int
    split: str
    domains: dict[str, DomainStats]
    absent: list[str]
    buildings_not_found: list[str] = dataclasses.field(default_factory=list)

    @property
    def outside(self) -> list[tuple[str, Stat]]:
        """(domain, statistic) pairs outside their real range."""
        return [(d, s) for d, ds in self.domains.items() for s in ds.outside]

    @property
    def corrupt(self) -> list[str]:
        """Every file that could not be read or decoded."""
        return [c for ds in self.domains.values() for c in ds.corrupt]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``--json``)."""
        return {"root": self.root, "source": self.source, "views": self.views, "buildings": self.buildings,
                "split": self.split, "tolerance": TOLERANCE, "absent_domains": self.absent,
                "buildings_not_found": self.buildings_not_found,
                "outside": [f"{d}: {s.key}" for d, s in self.outside],
                "domains": {d: {"files": ds.files, "missing": ds.missing, "corrupt": ds.corrupt,
                                "stats": [s.to_dict() for s in ds.stats]} for d, ds in self.domains.items()}}

    def table(self, full: bool = False) -> str:
        """The readable report: per domain, statistic | value | real range | accepted | flag | source.

        Args:
            full: show every statistic, not only the chosen ones (the referenced ones are always shown).
        """
        w = (44, 10, 12, 18, 5)
        lines = [f"statistics of {self.root} ({self.source}; split {self.split}): {self.views} views from "
                 f"{self.buildings} buildings",
                 f"real = the range real Taskonomy files show; accepted = real widened by {TOLERANCE:.0%} of its "
                 f"larger bound (single views are indicative)"]
        lines += [f"{'sources:' if i == 0 else '':<9}{k} = {v}" for i, (k, v) in enumerate(SOURCES.items())]
        if self.buildings_not_found:
            shown = ", ".join(self.buildings_not_found[:10]) + (" ..." if len(self.buildings_not_found) > 10 else "")
            lines.append(f"{len(self.buildings_not_found)} buildings of the split have no files here: {shown}")
        if self.absent:
            lines.append(f"absent domains (not in this dataset): {', '.join(self.absent)}")
        for domain, ds in self.domains.items():
            lines.append("")
            what = f"{ds.files} files"
            if ds.missing:
                what += f", {ds.missing} missing"
            if ds.corrupt:
                what += f", {len(ds.corrupt)} corrupt"
            lines.append(f"== {domain} ({what})")
            for name in ds.corrupt[:5]:
                lines.append(f"   corrupt: {name}")
            if len(ds.corrupt) > 5:
                lines.append(f"   ... and {len(ds.corrupt) - 5} more corrupt files")
            if not ds.stats:
                continue
            lines.append(f"   {'statistic':<{w[0]}}{'value':>{w[1]}}  {'real':<{w[2]}}{'accepted':<{w[3]}}"
                         f"{'flag':<{w[4]}} source")
            shown = set(_SHOWN.get(domain, [s.key for s in ds.stats]))
            for s in ds.stats:
                if not (full or s.key in shown or s.reference is not None):
                    continue
                r = s.reference
                real = r.stated() if r else ""
                acc = f"{_fmt(r.accepted[0])}…{_fmt(r.accepted[1])}" if r else ""
                lines.append(f"   {_label(s.key):<{w[0]}}{_fmt(s.value):>{w[1]}}  {real:<{w[2]}}{acc:<{w[3]}}"
                             f"{s.flag:<{w[4]}} {r.source if r else ''}".rstrip())
        out = self.outside
        lines.append("")
        lines.append(f"{len(out)} statistic{'s' if len(out) != 1 else ''} outside the real ranges"
                     + (": " + ", ".join(f"{d} {s.key}" for d, s in out) if out else ""))
        if self.corrupt:
            lines.append(f"{len(self.corrupt)} corrupt file{'s' if len(self.corrupt) != 1 else ''} (named above)")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- driver
def dataset_stats(root: str | Path, max_images: int | None = 100, split: str | None = None,
                  partitions: Sequence[str] = SPLITS, domains: Iterable[str] | None = None) -> DatasetStats:
    """Statistics of a Taskonomy tree, the synthetic tree or packed shards beside the real files' ranges.

    Args:
        root: a Taskonomy root (either layout) or a shard folder (holds ``shards.json``).
        max_images: the most views to sample (evenly across buildings; None: every view).
        split: None: every building on disk (every packed shard); ``"train"``, ``"val"``, ``"test"`` or ``"all"``:
            that partition of the one split CSV in `root` (of the shards); a CSV name (``"tiny"``) or path: the
            buildings of `partitions` in that CSV (trees only).
        partitions: the partitions a named CSV contributes.
        domains: task domains or aliases to look at (default: the 13); depth_zbuffer is read for the valid mask
            whenever it exists.

    Returns:
        A `DatasetStats`; ``.table()`` prints it, ``.outside`` lists the statistics out of range.

    Raises:
        FileNotFoundError: `root` does not exist or holds no domain folder.
        ValueError: no views to read, or a bad split.
    """
    from squad.data.shards import is_shard_root
    from squad.tasks import resolve_task_names

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {root} does not exist. {make_data_hint(root)}")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    names = list(TASK_NAMES) if domains is None else resolve_task_names(list(domains))
    wanted = list(dict.fromkeys([*names, GEOMETRY]))
    source_cls = _ShardSource if is_shard_root(root) else _TreeSource
    source = source_cls(root, wanted, split, partitions, max_images)
    if not source.views:
        absent = getattr(source, "unlisted", [])
        raise ValueError(f"no views to read in {root} (split {split or 'all buildings'}; {len(source.buildings)} "
                         f"buildings with files" + (f"; not here: {', '.join(absent[:10])}" if absent else "")
                         + f"). {make_data_hint(root)}")
    shown = [d for d in names if d in source.present]
    accs: dict[str, _Domain] = {d: _accumulator(d) for d in shown}
    results = {d: DomainStats(d) for d in ([VALID] if GEOMETRY in source.present else []) + shown}
    geometry_acc = _Geometry()
    try:
        with _one_thread():
            _accumulate(source, shown, accs, geometry_acc, results)
    finally:
        if isinstance(source, _ShardSource):
            source.close()
    for d, ds in results.items():
        acc = geometry_acc if d == VALID else accs[d]
        if ds.files:
            refs = REFERENCES.get(d, {})
            ds.stats = [Stat(k, float(v), refs.get(k)) for k, v in acc.summary().items()]
    split_name = split or "all buildings on disk"
    if isinstance(source, _TreeSource) and source.split_csv:
        split_name = f"{split} of {Path(source.split_csv).name}"
    return DatasetStats(root=str(root), source=source.describe(), views=len(source.views),
                        buildings=len({b for b, _ in source.views}), split=split_name, domains=results,
                        absent=[d for d in names if d not in source.present],
                        buildings_not_found=list(getattr(source, "unlisted", [])))


def _accumulate(source: _TreeSource | _ShardSource, shown: list[str], accs: dict[str, _Domain],
                geometry_acc: _Geometry, results: dict[str, DomainStats]) -> None:
    """Reads every sampled view once per domain into the accumulators; missing and bad files are counted."""
    for view in source.views:
        geometry = None
        if GEOMETRY in source.present:
            try:
                geometry = _geometry(source.read(view, GEOMETRY))
                geometry_acc.add(None, geometry)  # type: ignore[arg-type]
                results[VALID].files += 1
            except FileNotFoundError:
                results[VALID].missing += 1
            except (CorruptFileError, DecodeError) as e:
                results[VALID].corrupt.append(f"{source.name(view, GEOMETRY)}: {_reason(e)}")
        for d in shown:
            try:
                accs[d].add(source.read(view, d), geometry)
                results[d].files += 1
            except FileNotFoundError:
                results[d].missing += 1
            except (CorruptFileError, DecodeError) as e:
                results[d].corrupt.append(f"{source.name(view, d)}: {_reason(e)}")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one intra-op thread meanwhile: per-file tensors are small, and threads only contend on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _geometry(raw: np.ndarray) -> np.ndarray:
    """depth_zbuffer's valid pixels ``bool [H, W]`` (code ≠ 65535)."""
    task = get_task(GEOMETRY)
    _, mask = task.decode(raw)  # validates the encoding
    return _as_numpy(mask)[0].astype(bool)


def _reason(e: BaseException) -> str:
    text = str(e)
    return text.split(": ", 1)[-1] if text.startswith("corrupt file ") else text
