"""What real Taskonomy files look like, as reference ranges (`REFERENCES`), and the one tolerance rule every
statistic is held to (`TOLERANCE`; see the package docstring).
"""

from __future__ import annotations

import dataclasses
import math

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
            return f"≥ {fmt(self.lo)}"
        return f"~{fmt(self.lo)}" if self.lo == self.hi else f"{fmt(self.lo)}–{fmt(self.hi)}"


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


def label(key: str) -> str:
    for suffix in ("_ch0", "_ch1", "_ch2"):
        if key.endswith(suffix):
            return f"{_LABELS.get(key[: -len(suffix)], key[: -len(suffix)])} {suffix[1:]}"
    return _LABELS.get(key, key)


def fmt(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-" if v is None else str(v)
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


