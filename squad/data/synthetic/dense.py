"""Shared pieces of the synthetic PASCAL-Context and NYUD-v2 generators (``synthetic_pascal``, ``synthetic_nyud``).

Scenes are built from ``squad.data.synthetic.render``'s public primitives (boxes turned about the vertical, spheres,
upright cylinders) and ray-cast with ``render_view``; every shape carries, in ``category``, the index of the object
*instance* it belongs to, so one render gives per-pixel instance ids (``View.category``) and per-pixel primitive ids
(``View.surface``), from which the generators derive class maps, person-part maps, saliency and edges.

* **Articulated people.** ``person_shapes`` builds a person from head, hair, neck, torso, upper/lower arms, hands,
  upper/lower legs and feet, each primitive tagged with its PASCAL-Part part name (``PART_NAMES``); ``PARTS_6``
  maps those names onto the 6 human-part ids ASTMT uses (1 head, 2 torso, 3 upper arms, 4 lower arms and hands,
  5 upper legs, 6 lower legs and feet). Arms take one of several poses (hanging, bent forward, raised, waving):
  a hanging segment is an upright cylinder, a tilted one a chain of spheres.
* **Non-square images.** ``render_rect`` renders a square of the longer side and crops the centre, so a landscape
  image's horizontal field of view is the camera's ``fov_deg``.
* **Culling.** Shapes whose bounding sphere lies outside the view frustum are left out of each view's scene (they
  would only cost time; their shadows are lost, which a synthetic image can afford).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from squad.data.synthetic.render import Box, Camera, Cylinder, Material, Room, Scene, Sphere, View, render_view
from squad.io.files import atomic_save, atomic_write_text, sync_tree

RGB = tuple[float, float, float]
Shape = Box | Sphere | Cylinder

# PASCAL-Part's person part names and ASTMT's 6-part grouping of them (its HUMAN_PART[6] table)
PART_NAMES = (
    "hair", "head", "lear", "lebrow", "leye", "lfoot", "lhand", "llarm", "llleg", "luarm", "luleg", "mouth", "neck",
    "nose", "rear", "rebrow", "reye", "rfoot", "rhand", "rlarm", "rlleg", "ruarm", "ruleg", "torso",
)  # fmt: skip
PARTS_6 = {
    "hair": 1, "head": 1, "lear": 1, "lebrow": 1, "leye": 1, "mouth": 1, "nose": 1, "rear": 1, "rebrow": 1, "reye": 1,
    "neck": 2, "torso": 2, "luarm": 3, "ruarm": 3, "llarm": 4, "rlarm": 4, "lhand": 4, "rhand": 4,
    "luleg": 5, "ruleg": 5, "llleg": 6, "rlleg": 6, "lfoot": 6, "rfoot": 6,
}  # fmt: skip
PART_GROUPS_6 = ("background", "head", "torso", "upper_arms", "lower_arms", "upper_legs", "lower_legs")
ARM_POSES = ("hanging", "forward", "raised", "waving")

SKIN = ((0.95, 0.78, 0.65), (0.85, 0.64, 0.48), (0.62, 0.44, 0.32), (0.42, 0.29, 0.2))
HAIR = ((0.1, 0.07, 0.05), (0.35, 0.22, 0.1), (0.75, 0.6, 0.35), (0.5, 0.5, 0.5))


@dataclass(frozen=True)
class Piece:
    """One primitive of an object, in the object's frame (x forward, y up, z to its left), metres at scale 1.

    ``kind`` is "box" (``at`` = centre, ``size`` = half extents), "sphere" (``at`` = centre, ``size`` = (radius,))
    or "cyl" (``at`` = bottom-cap centre, ``size`` = (radius, height)); ``second`` picks the object's second colour;
    ``part`` is a PASCAL-Part part name (people only).
    """

    kind: str
    at: tuple[float, float, float]
    size: tuple[float, ...]
    second: bool = False
    part: str | None = None


def _rot(yaw: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])  # world = R @ local, as render.Box


def place(
    pieces: Sequence[Piece], origin: tuple[float, float, float], yaw: float, scale: float, mat: Material,
    mat2: Material, instance: int,
) -> list[tuple[Shape, str | None]]:
    """Instantiate ``pieces`` at ``origin`` (floor point under the object's centre), turned by ``yaw`` and scaled;
    every shape's ``category`` is ``instance``. Returns (shape, part name) pairs."""
    rot, o = _rot(yaw), np.asarray(origin, np.float64)
    out: list[tuple[Shape, str | None]] = []
    for p in pieces:
        at = o + rot @ (np.asarray(p.at) * scale)
        c = tuple(float(v) for v in at)
        m = mat2 if p.second else mat
        if p.kind == "box":
            half = tuple(float(v) * scale for v in p.size)
            bevel = min(0.02 * scale, 0.4 * min(half))
            out.append((Box(c, half, yaw, m, instance, bevel), p.part))
        elif p.kind == "sphere":
            out.append((Sphere(c, p.size[0] * scale, m, instance), p.part))
        elif p.kind == "cyl":
            r, h = p.size[0] * scale, p.size[1] * scale
            out.append((Cylinder(c, r, h, m, instance, min(0.01 * scale, 0.3 * r)), p.part))
        else:
            raise ValueError(f"Piece.kind must be box|sphere|cyl, got {p.kind!r}")
    return out


def _segment(a: np.ndarray, b: np.ndarray, radius: float, part: str) -> list[Piece]:
    """A limb from joint ``a`` to joint ``b``: an upright cylinder when it hangs straight down, else a chain of
    spheres 1.4 radii apart."""
    d = b - a
    length = float(np.linalg.norm(d))
    if abs(d[0]) + abs(d[2]) < 1e-3 * max(length, 1e-9):
        lo = a if a[1] < b[1] else b
        return [Piece("cyl", tuple(lo), (radius, length), part=part)]
    count = max(2, math.ceil(length / (1.4 * radius)) + 1)
    return [Piece("sphere", tuple(a + d * t), (radius,), part=part) for t in np.linspace(0.0, 1.0, count)]


def person_pieces(rng: np.random.Generator) -> list[Piece]:
    """An articulated person 1 m tall (scale it to the person's height) standing at the origin, facing +x, with
    random stance and arm poses. Every piece is tagged with a PASCAL-Part part name."""
    pieces = [
        Piece("sphere", (0.0, 0.925, 0.0), (0.068,), part="head"),
        Piece("sphere", (-0.012, 0.945, 0.0), (0.066,), second=True, part="hair"),
        Piece("cyl", (0.0, 0.83, 0.0), (0.03, 0.06), part="neck"),
        Piece("box", (0.0, 0.675, 0.0), (0.07, 0.155, 0.125), second=True, part="torso"),
    ]
    stance = 0.065 if rng.random() < 0.6 else float(rng.uniform(0.03, 0.12))  # 0.065: straight legs, cylinders
    for side, sign in (("l", 1.0), ("r", -1.0)):
        hip, knee_y = np.array([0.0, 0.52, sign * 0.065]), 0.27
        foot_z = sign * stance
        knee = np.array([0.0, knee_y, hip[2] + (foot_z - hip[2]) * 0.5])
        ankle = np.array([0.0, 0.045, foot_z])
        if abs(knee[2] - hip[2]) < 0.01:
            knee[2], ankle[2] = hip[2], hip[2]
        pieces += _segment(hip, knee, 0.05, f"{side}uleg")
        pieces += _segment(knee, ankle, 0.04, f"{side}lleg")
        pieces.append(Piece("box", (0.035, 0.022, ankle[2]), (0.06, 0.022, 0.03), part=f"{side}foot"))
        pose = ARM_POSES[int(rng.integers(len(ARM_POSES)))]
        shoulder = np.array([0.0, 0.8, sign * 0.16])
        if pose == "hanging":
            elbow, wrist = shoulder + [0, -0.17, 0], shoulder + [0, -0.33, 0]
        elif pose == "forward":
            elbow, wrist = shoulder + [0, -0.17, 0], shoulder + [0.15, -0.2, 0]
        elif pose == "raised":
            elbow, wrist = shoulder + [0.04, 0.16, sign * 0.03], shoulder + [0.05, 0.32, sign * 0.05]
        else:  # waving: upper arm out sideways, forearm up
            elbow, wrist = shoulder + [0, -0.02, sign * 0.16], shoulder + [0.02, 0.13, sign * 0.2]
        pieces += _segment(shoulder, elbow, 0.036, f"{side}uarm")
        pieces += _segment(elbow, wrist, 0.03, f"{side}larm")
        pieces.append(Piece("sphere", tuple(wrist + (wrist - elbow) * 0.25), (0.032,), part=f"{side}hand"))
    return pieces


def person_materials(rng: np.random.Generator) -> tuple[Material, Material]:
    """(skin, clothes-and-hair) materials. Hair and clothes share the second material's colour family."""
    skin = SKIN[int(rng.integers(len(SKIN)))]
    clothes = tuple(float(v) for v in rng.uniform(0.05, 0.9, 3))
    return (Material(jitter(rng, skin, 0.04)),
            Material(clothes, jitter(rng, HAIR[int(rng.integers(len(HAIR)))], 0.05), "stripes",
                     float(rng.uniform(0.05, 0.2)), float(rng.uniform(0.0, 0.2))))  # fmt: skip


def jitter(rng: np.random.Generator, c: RGB, amount: float) -> RGB:
    """``c`` with every channel moved by up to ``amount``, clipped to [0, 1]."""
    return tuple(float(x) for x in np.clip(np.asarray(c) + rng.uniform(-amount, amount, 3), 0, 1))


# ----------------------------------------------------------------------------------------------------------------
# Rendering


def _visible(shape: Shape, camera: Camera, basis: tuple[np.ndarray, ...], margin: float = 1.05) -> bool:
    """Whether the bounding sphere of ``shape`` may reach the (square) view frustum of ``camera`` (``basis`` =
    ``camera.basis()``)."""
    r, u, f = basis
    v = np.asarray(shape.center, np.float64) - np.asarray(camera.position, np.float64)
    rad = shape.bounding_radius()
    z = float(v @ f)
    if z < -rad:
        return False
    t = math.tan(math.radians(camera.fov_deg) / 2) * margin
    slack = rad * math.sqrt(1 + t * t)
    return abs(float(v @ r)) <= z * t + slack and abs(float(v @ u)) <= z * t + slack


def render_rect(
    room: Room, shapes: Sequence[Shape], light: tuple[float, float, float], camera: Camera, width: int, height: int,
    *, ambient: float = 0.35, light_power: float = 1.0, noise_seed: int = 0,
) -> tuple[View, list[int]]:
    """Ray-cast a ``width`` x ``height`` view: a square of the longer side, centre-cropped.

    Returns the cropped view and the indices into ``shapes`` of the shapes kept after culling, in scene order
    (``View.surface`` 6 + k refers to ``shapes[kept[k]]``).
    """
    basis = camera.basis()
    kept = [i for i, s in enumerate(shapes) if _visible(s, camera, basis)]
    scene = Scene(room, tuple(shapes[i] for i in kept), light, ambient=ambient, light_power=light_power,
                  noise_seed=noise_seed)  # fmt: skip
    side = max(width, height)
    view = render_view(scene, camera, side)
    top, left = (side - height) // 2, (side - width) // 2
    crop = (slice(top, top + height), slice(left, left + width))
    return View(**{k: getattr(view, k)[crop] for k in view.__dataclass_fields__}), kept


def normals_outward(normal_cam: np.ndarray) -> np.ndarray:
    """Camera-frame normals from ``render`` (x right, y down, z into the scene) in the frame NYUD's and the distilled
    PASCAL normals use: x right, y up, z toward the camera (a wall facing the camera is (0, 0, 1))."""
    out = normal_cam.copy()
    out[..., 1:] *= -1.0
    return out


def label_boundaries(labels: np.ndarray) -> np.ndarray:
    """One-pixel-wide boundaries of a label map: True where a pixel's label differs from its right or lower
    neighbour's (the pixel on the upper/left side of each change), bool (H, W)."""
    edge = np.zeros(labels.shape, bool)
    edge[:, :-1] |= labels[:, :-1] != labels[:, 1:]
    edge[:-1, :] |= labels[:-1, :] != labels[1:, :]
    return edge


def soft_mask(mask: np.ndarray, passes: int = 2) -> np.ndarray:
    """A binary mask blurred by ``passes`` 3 x 3 box filters (edge-replicated): float in [0, 1], about 0.5 on the
    mask's outline, as a distilled network's soft output."""
    x = mask.astype(np.float64)
    for _ in range(passes):
        p = np.pad(x, 1, mode="edge")
        x = sum(p[i : i + x.shape[0], j : j + x.shape[1]] for i in range(3) for j in range(3)) / 9.0
    return x


# ----------------------------------------------------------------------------------------------------------------
# Output folders and workers


def prepare_out(out: Path, manifest_name: str, overwrite: bool, dataset: str) -> None:
    """Make ``out`` ready: absent or empty is fine; a previous render of the same ``dataset`` (its manifest
    present) is removed with ``overwrite``; anything else is refused (``FileExistsError``)."""
    if not out.exists() or not any(out.iterdir()):
        return
    manifest = out / manifest_name
    if not overwrite:
        raise FileExistsError(f"{out} is not empty; choose an empty directory, or replace an earlier render with "
                              "--overwrite (overwrite=True)")
    old = json.loads(manifest.read_text()) if manifest.is_file() else {}
    if old.get("dataset") != dataset:
        raise FileExistsError(f"{out} is not empty and holds no synthetic {dataset} render ({manifest_name}): "
                              "refusing to overwrite it")
    for folder in old.get("folders", []):
        target = (out / folder).resolve()
        if out.resolve() in target.parents:
            shutil.rmtree(target, ignore_errors=True)
    manifest.unlink()



def start_render(out: str | Path, n: int, image_size: int, seed: int, overwrite: bool, manifest_name: str,
                 dataset: str, folders: Sequence[str]) -> tuple[Path, list[tuple[tuple[int, ...], slice]]]:
    """The shared start of a benchmark render: checks the arguments, prepares `out` (`prepare_out`) and its
    `folders`, and cuts the image indices into chunks (several even for small `n`, so every worker gets some).

    Returns:
        ``(out, [(image indices, slice of the id list)])``.

    Raises:
        ValueError: ``n < 2`` (one image per split), ``image_size < 16`` or a negative seed.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2 (one image per split), got {n}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    out = Path(out)
    prepare_out(out, manifest_name, overwrite, dataset)
    for sub in folders:
        (out / sub).mkdir(parents=True, exist_ok=True)
    chunk = min(16, max(1, n // 8))
    return out, [(tuple(range(a, min(n, a + chunk))), slice(a, a + chunk)) for a in range(0, n, chunk)]


def split_ids(ids: Sequence[str], val_share: float, rng_seed: int) -> dict[str, list[str]]:
    """Deterministic train/val split of ``ids`` (at least one each), both lists in id order."""
    n = len(ids)
    n_val = min(n - 1, max(1, round(n * val_share)))
    order = np.random.default_rng([rng_seed, 7919]).permutation(n)
    val = set(order[:n_val].tolist())
    return {"train": [ids[i] for i in range(n) if i not in val], "val": [ids[i] for i in range(n) if i in val]}


def write_lines(path: Path, lines: Sequence[str]) -> None:
    """One entry per line, ``\\n``-terminated (the split lists' format); the file whole or absent."""
    atomic_write_text(path, "".join(f"{line}\n" for line in lines), sync=False)


def save_image(path: Path, array: np.ndarray, mode: str | None = None, **options: Any) -> None:
    """One image file of a render (the format from the suffix: JPEG or PNG, Pillow's ``options``), whole or absent;
    not synced (the render syncs once before its manifest: `finish_render`)."""
    image = Image.fromarray(array, mode=mode) if mode else Image.fromarray(array)
    fmt = "JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG"
    atomic_save(path, lambda f: image.save(f, format=fmt, **options), sync=False)


def save_npy(path: Path, array: np.ndarray) -> None:
    """One ``.npy`` file of a render, whole or absent (not synced, as `save_image`)."""
    atomic_save(path, lambda f: np.save(f, array), sync=False)


def finish_render(out: Path, manifest_name: str, manifest: dict) -> Path:
    """Flushes the render to disk, then writes its manifest (atomically, synced): a manifest marks a complete render."""
    sync_tree(out)
    path = out / manifest_name
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n", "the manifest")
    return path
