"""Readable pictures of predictions: one ``uint8`` image per task and image, saved as PNG by `squad.deploy.predict`.

``picture(task, units)`` takes one prediction in task units (``Task.to_units``, ``[C, H, W]``) and returns an
``uint8`` array ``[H, W]`` (grey) or ``[H, W, 3]`` (colour). Matplotlib colormaps are applied to the arrays directly
(no figure); `save_png` writes them with Pillow.

| task | picture |
| --- | --- |
| depth_euclidean, depth_zbuffer | ``magma_r`` of metres, near = bright, over the image's 2nd–98th percentile |
| normal | RGB = (n + 1) / 2 per axis (Taskonomy's own rendering: x → red, y → green, z → blue) |
| principal_curvature | ``coolwarm`` of the mean of the two curvature channels, symmetric about 0 (red > 0 > blue) |
| reshading | grey, 0 → black, 1 → white |
| edge_texture, edge_occlusion | grey over the task's target range (0–0.08, 0–0.00625): edges are white |
| keypoints2d, keypoints3d | ``inferno`` heat map over the target range (keypoints2d 0–0.005), else 0 to the p99 |
| segment_unsup2d, segment_unsup25d | a fixed palette of 256 distinct colours, one per (rounded) segment id |
| other dense heads | 1 channel: ``viridis`` over the image's range; 3: each channel min–max as RGB; else channel 0 |

Class tasks get no picture: `top_k` gives their top-5 classes (written as JSON). Non-finite values draw black.
"""

from __future__ import annotations

import colorsys
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from squad.io.files import atomic_save
from squad.tasks import ScalarTask, get_task
from squad.tasks.depth import DepthTask
from squad.tasks.normal import NormalTask

_EPS = 1e-12


def _check(units: np.ndarray, channels: int | None, what: str) -> np.ndarray:
    a = np.asarray(units, dtype=np.float64)
    if a.ndim != 3 or (channels is not None and a.shape[0] != channels):
        want = f"[{channels}, H, W]" if channels is not None else "[C, H, W]"
        raise ValueError(f"{what}: expected a prediction {want}, got shape {a.shape}")
    return a


def apply_colormap(values: np.ndarray, cmap: str, vmin: float, vmax: float) -> np.ndarray:
    """Colours ``values [H, W]`` with a matplotlib colormap over ``[vmin, vmax]`` (clipped): ``uint8 [H, W, 3]``."""
    from matplotlib import colormaps  # the colormap registry only: no figure, no pyplot backend

    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    scale = max(vmax - vmin, _EPS)
    normed = np.clip((np.where(finite, v, vmin) - vmin) / scale, 0.0, 1.0)
    rgb = colormaps[cmap](normed, bytes=True)[..., :3]
    rgb[~finite] = 0
    return np.ascontiguousarray(rgb)


def grey(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """``values [H, W]`` over ``[vmin, vmax]`` (clipped) as ``uint8 [H, W]`` grey, vmin black; non-finite black."""
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v)
    normed = np.clip((np.where(finite, v, vmin) - vmin) / max(vmax - vmin, _EPS), 0.0, 1.0)
    return np.where(finite, np.round(normed * 255), 0).astype(np.uint8)


def _robust_range(values: np.ndarray, low: float, high: float) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    lo, hi = np.percentile(finite, [low, high])
    return float(lo), float(max(hi, lo + 1e-6))


def depth_picture(metres: np.ndarray) -> np.ndarray:
    """Depth ``[1, H, W]`` in metres → ``magma_r`` colours, near bright, over the 2nd–98th percentile."""
    d = _check(metres, 1, "depth")[0]
    return apply_colormap(d, "magma_r", *_robust_range(d, 2, 98))


def normal_picture(normals: np.ndarray) -> np.ndarray:
    """Unit normals ``[3, H, W]`` → RGB ``(n + 1) / 2``."""
    n = np.nan_to_num(_check(normals, 3, "normal"))
    return np.clip(np.round((n + 1.0) * 127.5), 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()


def curvature_picture(curvature: np.ndarray) -> np.ndarray:
    """Principal curvature ``[2, H, W]`` → ``coolwarm`` of their mean, symmetric about 0 at its 98th |percentile|."""
    k = _check(curvature, 2, "principal_curvature").mean(axis=0)
    finite = np.abs(k[np.isfinite(k)])
    top = float(np.percentile(finite, 98)) if finite.size else 1.0
    top = max(top, 1e-6)
    return apply_colormap(k, "coolwarm", -top, top)


@lru_cache(maxsize=1)
def segment_palette() -> np.ndarray:
    """256 distinct colours ``uint8 [256, 3]``: hues a golden-ratio step apart, three brightness levels; id 0 black."""
    colours = np.zeros((256, 3), dtype=np.uint8)
    for i in range(1, 256):
        h = (i * 0.618033988749895) % 1.0
        s, v = (0.9, 0.95) if i % 3 == 0 else (0.6, 0.85) if i % 3 == 1 else (0.85, 0.6)
        colours[i] = np.round(np.array(colorsys.hsv_to_rgb(h, s, v)) * 255)
    return colours


def segment_picture(ids: np.ndarray) -> np.ndarray:
    """Segment ids ``[1, H, W]`` (rounded, clipped to 0–255) → palette colours ``uint8 [H, W, 3]``."""
    s = np.nan_to_num(_check(ids, 1, "segment")[0])
    return segment_palette()[np.clip(np.round(s), 0, 255).astype(np.int64)]


def _generic(units: np.ndarray, what: str) -> np.ndarray:
    a = _check(units, None, what)
    if a.shape[0] == 3:
        lo = np.nanmin(a, axis=(1, 2), keepdims=True)
        hi = np.nanmax(a, axis=(1, 2), keepdims=True)
        rgb = (np.nan_to_num(a) - lo) / np.maximum(hi - lo, _EPS)
        return np.clip(np.round(rgb * 255), 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()
    return apply_colormap(a[0], "viridis", *_robust_range(a[0], 0, 100))


def picture(task: str, units: np.ndarray) -> np.ndarray:
    """The readable picture of one dense prediction (see the module table).

    Args:
        task: the model's head name (a Taskonomy task, or any other dense head).
        units: ``[C, H, W]`` in task units (``Task.to_units``); the raw head output for a head outside Taskonomy.

    Returns:
        ``uint8 [H, W]`` or ``[H, W, 3]``.
    """
    try:
        spec = get_task(task)
    except ValueError:
        return _generic(units, task)
    if spec.head_kind != "dense":
        raise ValueError(f"task {task} is a class task: it has no picture (use top_k)")
    if isinstance(spec, DepthTask):
        return depth_picture(units)
    if isinstance(spec, NormalTask):
        return normal_picture(units)
    if isinstance(spec, ScalarTask):
        # the units range the target maps onto [-1, 1] (`ScalarSpec.span` where the spec has it, else its clip)
        name, clip = spec.name, getattr(spec.spec, "span", None) or spec.spec.clip
        if name == "principal_curvature":
            return curvature_picture(units)
        u = _check(units, 1, name)[0]
        if name == "reshading":
            return grey(u, 0.0, 1.0)
        if name.startswith("edge_"):
            return grey(u, *(clip or (0.0, 1.0)))
        if name.startswith("keypoints"):
            return apply_colormap(u, "inferno", *(clip or _robust_range(u, 0, 99)))
        if name.startswith("segment_"):
            return segment_picture(units)
    return _generic(units, task)


def top_k(probabilities: np.ndarray, k: int = 5, names: list[str] | None = None) -> list[dict]:
    """The ``k`` most probable classes of one ``[C]`` distribution, most probable first.

    Returns:
        ``[{"index": i, "probability": p}, ...]`` with ``"name"`` added when ``names`` (one per class) is given.
    """
    p = np.asarray(probabilities, dtype=np.float64).reshape(-1)
    order = np.argsort(-np.nan_to_num(p, nan=-np.inf), kind="stable")[: min(k, p.size)]
    out = []
    for i in order:
        entry = {"index": int(i), "probability": float(p[i])}
        if names is not None:
            entry["name"] = names[int(i)]
        out.append(entry)
    return out


def save_png(path: str | Path, image: np.ndarray, *, sync: bool = True) -> Path:
    """Writes an ``uint8`` / ``uint16`` image ``[H, W]`` or ``[H, W, 3]`` as PNG (16-bit grey stays 16-bit),
    atomically (`squad.io.files.atomic_save`; ``sync=False``: no fsync, the caller syncs once at the end).

    Raises:
        squad.io.files.WriteError: the file could not be written.
    """
    picture = Image.fromarray(np.ascontiguousarray(image))
    return atomic_save(path, lambda f: picture.save(f, format="PNG"), sync=sync)
