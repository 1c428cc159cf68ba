"""A random tree in Taskonomy's layout and encodings (`write_random_tree`): every domain's file type with random
content, for tests, the shard bench and the README's ``pack`` example.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from squad.tasks import get_task


def write_random_tree(root: str | Path, n: int = 200, size: int = 256, buildings: int = 4, seed: int = 0,
                      layout: Literal["official", "flat"] = "official", unique: int | None = None) -> Path:
    """Writes a Taskonomy-format tree of smooth random files in every domain's encoding (for benches and tests).

    Args:
        root: output folder.
        n: samples, spread over `buildings` buildings named ``b0, b1, ...``.
        size: image side in pixels.
        buildings: number of buildings; all are in the train split of ``train_val_test_random.csv`` (CR-only).
        seed: random seed.
        layout: ``"official"`` (``{domain}/taskonomy/{building}``) or ``"flat"`` (``{domain}/{building}``).
        unique: draw only this many distinct samples and fill the rest with byte copies of them (PNG encoding is
            the slow part of writing; reading a copy costs the same as reading an original). None: all distinct.

    Returns:
        `root`.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)

    def smooth(channels: int, lo: float, hi: float) -> np.ndarray:
        coarse = rng.uniform(lo, hi, size=(size // 16 + 1, size // 16 + 1, channels))
        up = np.kron(coarse, np.ones((16, 16, 1)))[:size, :size]
        return up + rng.normal(0, (hi - lo) * 0.01, size=up.shape)

    written: list[dict[str, Path]] = []
    for i in range(n):
        b = f"b{i % buildings}"
        stem = f"point_{i // buildings}_view_{i % 3}"
        sub = "taskonomy" if layout == "official" else ""
        if unique is not None and i >= unique:
            for domain, source in written[i % unique].items():
                folder = root / domain / sub / b
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, folder / f"{stem}_domain_{domain}{source.suffix}")
            continue
        paths: dict[str, Path] = {}
        depth = smooth(1, 512, 20000)[..., 0]
        depth[:8, :8] = 65535
        normal = smooth(3, -1, 1)
        normal /= np.linalg.norm(normal, axis=-1, keepdims=True) + 1e-6
        files: dict[str, np.ndarray] = {
            "rgb": smooth(3, 0, 255), "depth_euclidean": depth * 1.05, "depth_zbuffer": depth,
            "normal": (normal + 1) * 127.5, "principal_curvature": smooth(3, 90, 160), "reshading": smooth(3, 0, 255),
            "edge_texture": smooth(1, 0, 6000)[..., 0], "edge_occlusion": smooth(1, 0, 500)[..., 0],
            "keypoints2d": smooth(1, 0, 400)[..., 0], "keypoints3d": smooth(1, 0, 65535)[..., 0],
            "segment_unsup2d": np.floor(smooth(1, 0, 63.99)[..., 0]),
            "segment_unsup25d": np.floor(smooth(1, 0, 63.99)[..., 0]),
        }
        for domain, arr in files.items():
            bits = 8 if domain == "rgb" else get_task(domain).bits
            dtype = np.uint8 if bits == 8 else np.uint16
            arr = np.clip(np.round(arr), 0, np.iinfo(dtype).max).astype(dtype)
            folder = root / domain / sub / b
            folder.mkdir(parents=True, exist_ok=True)
            paths[domain] = folder / f"{stem}_domain_{domain}.png"
            Image.fromarray(arr).save(paths[domain])
        for domain in ("class_object", "class_scene"):
            folder = root / domain / sub / b
            folder.mkdir(parents=True, exist_ok=True)
            paths[domain] = folder / f"{stem}_domain_{domain}.npy"
            np.save(paths[domain], rng.dirichlet(np.full(get_task(domain).channels, 0.1)).astype(np.float32))
        written.append(paths)
    rows = ["id,train,val,test", *(f"b{k},1,0,0" for k in range(buildings))]
    (root / "train_val_test_random.csv").write_bytes(("\r".join(rows) + "\r").encode())
    return root
