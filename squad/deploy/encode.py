"""Predictions → Taskonomy's own file encodings: the inverse of each task's `decode` (``squad.tasks``).

``encode_taskonomy(task, units)`` turns a prediction in task units (what ``Task.to_units`` gives, ``[C, H, W]``) into
the integer array Taskonomy stores for that domain; written as PNG it reads back through the data reader
(`squad.data.taskonomy.read_raw`) and the task's `decode` to the same values, within one code (the rounding):

| task | file | code |
| --- | --- | --- |
| depth_euclidean, depth_zbuffer | 16-bit grey | round(metres × 512), at most 65534 (65535 means no geometry) |
| normal | 8-bit RGB | round((n + 1) × 127.5) per axis |
| principal_curvature | 8-bit RGB | channels 0–1 round(127 × u + 127), channel 2 = 0 (as the dataset's files) |
| reshading | 8-bit RGB, three equal channels | round(255 × u) |
| edge_texture, edge_occlusion, keypoints2d, keypoints3d | 16-bit grey | round(65535 × u) |
| segment_unsup2d, segment_unsup25d | 8-bit grey | round(u), the segment id |

Codes are clipped to the file's range first (a prediction outside it, e.g. a negative edge strength, becomes the
nearest code). Class tasks have no PNG encoding: Taskonomy stores their distributions as ``.npy`` vectors, which is
what `squad.deploy.predict` writes for them anyway. A prediction never holds the invalid codes (no geometry for depth,
the (128, 128, 128) fill for normals): a model predicts everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from squad.tasks import SCALAR_SPECS, ScalarSpec
from squad.tasks.depth import DEPTH_SCALE, NO_GEOMETRY


def _finite(units: np.ndarray, name: str, channels: int) -> np.ndarray:
    a = np.asarray(units, dtype=np.float64)
    if a.ndim != 3 or a.shape[0] != channels:
        raise ValueError(f"task {name}: expected a prediction [{channels}, H, W] in task units, got shape {a.shape}")
    return np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)


def encode_depth(units: np.ndarray, name: str = "depth_euclidean") -> np.ndarray:
    """Depth in metres ``[1, H, W]`` → ``uint16 [H, W]`` codes (metres × 512, valid codes only)."""
    d = _finite(units, name, 1)[0]
    return np.clip(np.round(d * DEPTH_SCALE), 0, NO_GEOMETRY - 1).astype(np.uint16)


def encode_normal(units: np.ndarray) -> np.ndarray:
    """Unit normals ``[3, H, W]`` → ``uint8 [H, W, 3]`` codes ((n + 1) × 127.5 per axis)."""
    n = _finite(units, "normal", 3)
    return np.clip(np.round((n + 1.0) * 127.5), 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()


def encode_scalar(units: np.ndarray, spec: ScalarSpec) -> np.ndarray:
    """A `ScalarSpec` task's value ``[C, H, W]`` → its file codes: the inverse of ``code · scale + offset``.

    Returns:
        ``uint8`` or ``uint16`` (the spec's bits): ``[H, W]`` for one-channel domains, except reshading, whose files
        hold the shading in three equal channels; ``[H, W, 3]`` for two-channel domains (curvature: third channel 0).
    """
    u = _finite(units, spec.name, spec.channels)
    top = 2**spec.bits - 1
    code = np.clip(np.round((u - spec.code_offset) / spec.code_scale), 0, top)
    code = code.astype(np.uint16 if spec.bits == 16 else np.uint8).transpose(1, 2, 0)  # [H, W, C]
    if spec.name == "reshading":
        return np.repeat(code, 3, axis=2)
    if spec.channels == 1:
        return np.ascontiguousarray(code[..., 0])
    pad = np.zeros((*code.shape[:2], 3 - spec.channels), dtype=code.dtype)
    return np.concatenate([code, pad], axis=2)


TASKONOMY_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "depth_euclidean": partial(encode_depth, name="depth_euclidean"),
    "depth_zbuffer": partial(encode_depth, name="depth_zbuffer"),
    "normal": encode_normal,
    **{spec.name: partial(encode_scalar, spec=spec) for spec in SCALAR_SPECS},
}


def has_taskonomy_encoding(task: str) -> bool:
    """Whether `encode_taskonomy` can write ``task`` as a PNG (every dense Taskonomy task; not class tasks)."""
    return task in TASKONOMY_ENCODERS


def encode_taskonomy(task: str, units: np.ndarray) -> np.ndarray:
    """One prediction in task units → the integer array Taskonomy stores for the task (see the module table).

    Args:
        task: canonical task name.
        units: ``[C, H, W]`` as ``Task.to_units`` gives it (one image).

    Returns:
        ``uint8`` / ``uint16`` ``[H, W]`` or ``[H, W, 3]``, ready for ``PIL.Image.fromarray(...).save(path)``.

    Raises:
        ValueError: a task without a PNG encoding (class tasks, heads outside Taskonomy) or a wrong shape.
    """
    if task not in TASKONOMY_ENCODERS:
        raise ValueError(f"task {task!r} has no Taskonomy PNG encoding (the dense Taskonomy tasks have: "
                         f"{', '.join(TASKONOMY_ENCODERS)})")
    return TASKONOMY_ENCODERS[task](units)
