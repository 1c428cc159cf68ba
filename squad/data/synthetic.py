"""The embedded default dataset: procedural indoor scenes written as a Taskonomy tree.

``render_dataset`` samples rooms (walls, floor, ceiling, sometimes a window), furnishes them with boxes, spheres and
cylinders whose shape, size and colour identify an object category, ray-casts several views of fixated points with
``squad.data.render`` and writes every image in Taskonomy's own layout and encodings (as the dataset ships)::

    {out}/{domain}/taskonomy/{building}/point_{p}_view_{v}_domain_{domain}.png   (.npy for the class domains)
    {out}/train_val_test_synthetic.csv    id,train,val,test with CR-only line endings, one row per building
    {out}/synthetic.json                  manifest: sizes, seed, splits, categories, encodings

Encodings (S x S images; "invalid" = the ray left the scene through a window):
    rgb                 uint8 RGB.
    depth_euclidean     uint16, distance from the camera centre in metres x 512; 65535 where invalid.
    depth_zbuffer       uint16, depth along the optical axis in metres x 512; 65535 where invalid.
    normal              uint8 RGB, round((e + 1) / 2 * 255) of the unit normal e in the camera frame, with
                        e = (-x, y, z) for x right, y up, z toward the viewer: the Taskonomy generator inverts
                        the red channel of Blender's camera-space normal pass. (128, 128, 128) where invalid.
    principal_curvature uint8 RGB: channel 0 = 127 + 12 * k1, channel 1 = 127 + 12 * k2 (k1 >= k2 in 1/m,
                        positive where convex: a sphere of radius r gives 127 + 12 / r), channel 2 = 127.
    reshading           uint8 RGB grey, 255 * (0.2 + 0.8 * max(0, n . l)) under the scene light, 0 where invalid.
    edge_texture        uint16, Sobel gradient magnitude of the RGB's luminance (per pixel, 0..0.71) * 65535.
    edge_occlusion      uint16, on the near side of a depth discontinuity: 0.01 * depth gap in metres * 65535.
    keypoints2d         uint16, Harris response of the RGB's luminance * 2000, clipped to 1, * 65535.
    keypoints3d         uint16, Harris response of the camera-frame normals and inverse depth * 200, clipped.
    segment_unsup2d     uint8 ids < 16: k-means on colour + position, ids in raster order of first appearance.
    segment_unsup25d    uint8 ids < 16: k-means on colour + normals + log depth + curvature + position.
    class_object        float32 (1000,): visible area share of each object category at its ImageNet index.
    class_scene         float32 (365,): 0.9 on the room type's Places365 index, 0.1 spread over the other types.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from squad.data.render import (
    NUM_ROOM_FACES,
    Box,
    Camera,
    Cylinder,
    Material,
    Room,
    Scene,
    Sphere,
    View,
    Window,
    cast,
    render_view,
)

logger = logging.getLogger(__name__)

DOMAINS = (
    "rgb", "depth_euclidean", "depth_zbuffer", "normal", "principal_curvature", "reshading", "edge_texture",
    "edge_occlusion", "keypoints2d", "keypoints3d", "segment_unsup2d", "segment_unsup25d", "class_object",
    "class_scene",
)  # fmt: skip
NPY_DOMAINS = ("class_object", "class_scene")
DEPTH_SCALE = 512.0  # uint16 units per metre
DEPTH_INVALID = 65535
CURVATURE_SCALE = 12.0  # uint8 steps per 1/m
EDGE_OCCLUSION_SCALE = 0.01  # per metre of depth gap
KEYPOINTS2D_SCALE = 2000.0
KEYPOINTS3D_SCALE = 25.0
NUM_SEGMENTS = 16
FOV_DEG = 60.0
VIEWS_PER_POINT = 3
POINTS_PER_ROOM = 4
FORMAT_VERSION = 1
RGB = tuple[float, float, float]


@dataclass(frozen=True)
class ObjectCategory:
    """An object class: its ImageNet index, its shape, size ranges (metres) and look.

    ``size`` holds (lo, hi) ranges: box (width, height, depth), sphere (radius,), cylinder (radius, height).
    ``lift`` is the range of the bottom's height above the floor (hanging or mounted objects).
    """

    name: str
    imagenet: int
    shape: str
    size: tuple[tuple[float, float], ...]
    color: RGB
    color2: RGB = (0.0, 0.0, 0.0)
    pattern: str = "plain"
    scale: float = 0.25
    lift: tuple[float, float] = (0.0, 0.0)


OBJECTS = (
    ObjectCategory("crate", 519, "box", ((0.4, 0.6), (0.4, 0.6), (0.4, 0.6)), (0.72, 0.55, 0.33), (0.5, 0.36, 0.2),
                   "stripes", 0.12),
    ObjectCategory("chest", 492, "box", ((0.8, 1.0), (0.45, 0.55), (0.45, 0.55)), (0.45, 0.15, 0.1),
                   (0.8, 0.65, 0.2), "bands", 0.25),
    ObjectCategory("file cabinet", 553, "box", ((0.45, 0.5), (1.1, 1.3), (0.55, 0.6)), (0.55, 0.57, 0.6),
                   (0.3, 0.3, 0.32), "bands", 0.3),
    ObjectCategory("refrigerator", 760, "box", ((0.7, 0.8), (1.7, 1.9), (0.65, 0.7)), (0.93, 0.93, 0.92)),
    ObjectCategory("television", 851, "box", ((0.9, 1.2), (0.55, 0.7), (0.06, 0.1)), (0.05, 0.05, 0.07),
                   lift=(0.6, 0.9)),
    ObjectCategory("wardrobe", 894, "box", ((1.0, 1.4), (1.9, 2.2), (0.55, 0.65)), (0.35, 0.22, 0.12),
                   (0.26, 0.16, 0.08), "stripes", 0.3),
    ObjectCategory("soccer ball", 805, "sphere", ((0.15, 0.2),), (0.95, 0.95, 0.95), (0.08, 0.08, 0.08),
                   "checker", 0.1),
    ObjectCategory("basketball", 430, "sphere", ((0.15, 0.2),), (0.9, 0.45, 0.1), (0.15, 0.07, 0.02), "stripes",
                   0.12),
    ObjectCategory("balloon", 417, "sphere", ((0.2, 0.3),), (0.9, 0.1, 0.15), lift=(1.0, 1.8)),
    ObjectCategory("ashcan", 412, "cylinder", ((0.18, 0.25), (0.5, 0.7)), (0.25, 0.35, 0.28), (0.15, 0.2, 0.16),
                   "stripes", 0.05),
    ObjectCategory("barrel", 427, "cylinder", ((0.3, 0.38), (0.8, 1.0)), (0.55, 0.33, 0.15), (0.2, 0.2, 0.2),
                   "bands", 0.3),
    ObjectCategory("vase", 883, "cylinder", ((0.12, 0.16), (0.4, 0.6)), (0.15, 0.3, 0.8), (0.9, 0.9, 0.95),
                   "bands", 0.15),
    ObjectCategory("lampshade", 619, "cylinder", ((0.2, 0.28), (0.25, 0.35)), (0.98, 0.9, 0.6), lift=(1.3, 1.7)),
)  # fmt: skip


@dataclass(frozen=True)
class RoomType:
    """A scene class: its Places365 index, wall and floor looks, and the object categories it holds."""

    name: str
    places: int
    walls: Material
    floor: Material
    objects: tuple[str, ...]


ROOM_TYPES = (
    RoomType("bathroom", 45, Material((0.92, 0.95, 0.97), (0.7, 0.85, 0.92), "checker", 0.3),
             Material((0.6, 0.62, 0.65), (0.45, 0.47, 0.5), "checker", 0.15), ("vase", "ashcan", "basketball")),
    RoomType("bedroom", 52, Material((0.85, 0.7, 0.78)), Material((0.6, 0.42, 0.25), (0.5, 0.34, 0.2), "stripes", 0.2),
             ("wardrobe", "chest", "balloon", "lampshade", "soccer ball")),
    RoomType("kitchen", 203, Material((0.95, 0.9, 0.6)), Material((0.92, 0.92, 0.92), (0.1, 0.1, 0.1), "checker", 0.4),
             ("refrigerator", "ashcan", "crate", "vase", "barrel")),
    RoomType("living_room", 215, Material((0.62, 0.72, 0.55)), Material((0.55, 0.38, 0.22), (0.45, 0.3, 0.17),
             "stripes", 0.3), ("television", "lampshade", "vase", "chest", "basketball")),
    RoomType("office", 244, Material((0.8, 0.8, 0.8)), Material((0.35, 0.42, 0.55)),
             ("file cabinet", "ashcan", "television", "crate")),
    RoomType("storage_room", 318, Material((0.5, 0.5, 0.48), (0.42, 0.42, 0.4), "bands", 0.5),
             Material((0.3, 0.3, 0.3)), ("crate", "barrel", "ashcan", "file cabinet")),
    RoomType("playroom", 269, Material((0.45, 0.7, 0.95)), Material((0.9, 0.25, 0.2), (0.95, 0.85, 0.2), "checker",
             0.5), ("soccer ball", "basketball", "balloon", "crate")),
)  # fmt: skip
_OBJECT_BY_NAME = {c.name: i for i, c in enumerate(OBJECTS)}


@dataclass(frozen=True)
class SyntheticRoom:
    """A sampled room: the renderable scene and its room type (index into ROOM_TYPES)."""

    scene: Scene
    room_type: int


def _jitter(rng: np.random.Generator, c: RGB, amount: float) -> RGB:
    return tuple(float(x) for x in np.clip(np.asarray(c) + rng.uniform(-amount, amount, 3), 0, 1))


def _jitter_material(rng: np.random.Generator, m: Material, amount: float) -> Material:
    return Material(_jitter(rng, m.color, amount), _jitter(rng, m.color2, amount), m.pattern, m.scale)


def _make_object(rng: np.random.Generator, cat: int, x: float, z: float) -> Box | Sphere | Cylinder:
    c = OBJECTS[cat]
    dims = [rng.uniform(lo, hi) for lo, hi in c.size]
    lift = rng.uniform(*c.lift)
    mat = Material(_jitter(rng, c.color, 0.05), _jitter(rng, c.color2, 0.05), c.pattern, c.scale)
    if c.shape == "box":
        w, h, d = dims
        return Box((x, lift + h / 2, z), (w / 2, h / 2, d / 2), float(rng.uniform(0, np.pi)), mat, cat)
    if c.shape == "sphere":
        return Sphere((x, lift + dims[0], z), dims[0], mat, cat)
    return Cylinder((x, lift, z), dims[0], dims[1], mat, cat)


def _footprint(c: ObjectCategory) -> float:
    """Largest horizontal half-extent of a category (metres)."""
    if c.shape == "box":
        return math.hypot(c.size[0][1], c.size[2][1]) / 2
    return c.size[0][1]


def sample_room(rng: np.random.Generator, room_type: int | None = None) -> SyntheticRoom:
    """Sample a furnished room (walls, floor, ceiling, maybe a window, 4-7 objects, one light)."""
    rt = int(rng.integers(len(ROOM_TYPES))) if room_type is None else room_type
    kind = ROOM_TYPES[rt]
    w, h, d = rng.uniform(3.5, 6.5), rng.uniform(2.6, 3.2), rng.uniform(3.5, 6.5)
    window = None
    if rng.random() < 0.7:
        face = int(rng.integers(2, 6))
        span = d if face < 4 else w
        ww, wh = rng.uniform(0.8, 1.6), rng.uniform(0.8, 1.3)
        u0 = rng.uniform(0.3, span - ww - 0.3)
        window = Window(face, (u0, 0.9), (u0 + ww, 0.9 + wh))
    room = Room((w, h, d), _jitter_material(rng, kind.floor, 0.06), _jitter_material(rng, kind.walls, 0.06),
                Material(_jitter(rng, (0.93, 0.93, 0.9), 0.03)), window)  # fmt: skip
    shapes, placed = [], []  # placed: (x, z, footprint radius)
    for _ in range(int(rng.integers(4, 8))):
        cat = _OBJECT_BY_NAME[kind.objects[int(rng.integers(len(kind.objects)))]]
        rad = _footprint(OBJECTS[cat])
        for _try in range(50):
            x, z = rng.uniform(rad + 0.1, w - rad - 0.1), rng.uniform(rad + 0.1, d - rad - 0.1)
            if all(math.hypot(x - px, z - pz) > rad + pr + 0.1 for px, pz, pr in placed):
                placed.append((x, z, rad))
                shapes.append(_make_object(rng, cat, x, z))
                break
    light = (rng.uniform(0.3, 0.7) * w, h - 0.25, rng.uniform(0.3, 0.7) * d)
    return SyntheticRoom(Scene(room, tuple(shapes), light), rt)


def sample_camera(rng: np.random.Generator, scene: Scene, target: int, tries: int = 40) -> Camera:
    """A camera inside the room, clear of every shape, fixating a point of shape ``target`` that it can see."""
    w, h, d = scene.room.size
    shape = scene.shapes[target]
    aim = np.asarray(shape.center) + rng.uniform(-0.05, 0.05, 3)
    cam = None
    for _ in range(tries):
        pos = np.array([rng.uniform(0.4, w - 0.4), rng.uniform(1.0, min(1.8, h - 0.3)), rng.uniform(0.4, d - 0.4)])
        dist = np.linalg.norm(aim - pos)
        if not 1.2 <= dist <= 4.5 or abs(aim[1] - pos[1]) > 0.95 * dist:
            continue
        if any(np.linalg.norm(pos - np.asarray(s.center)) < s.bounding_radius() + 0.3 for s in scene.shapes):
            continue
        cam = Camera(tuple(float(v) for v in pos), tuple(float(v) for v in aim), FOV_DEG)
        _, sid = cast(scene, pos[None], ((aim - pos) / dist)[None])
        if sid[0] == NUM_ROOM_FACES + target:
            return cam
    if cam is None:  # cramped room: the corner farthest from the target
        pos = [0.4 if aim[0] > w / 2 else w - 0.4, min(1.5, h - 0.3), 0.4 if aim[2] > d / 2 else d - 0.4]
        cam = Camera(tuple(float(v) for v in pos), tuple(float(v) for v in aim), FOV_DEG)
    return cam


# ----------------------------------------------------------------------------------------------------------------
# Derived domains


def _luminance(rgb8: np.ndarray) -> np.ndarray:
    return (rgb8.astype(np.float64) / 255.0) @ np.array([0.299, 0.587, 0.114])


def _gradients(img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Derivatives per pixel along x and y (Sobel / 8: a unit step gives 0.5 on both sides of it)."""
    return ndimage.sobel(img, axis=1, mode="nearest") / 8, ndimage.sobel(img, axis=0, mode="nearest") / 8


def _harris(channels: list[np.ndarray], sigma: float) -> np.ndarray:
    """Positive Harris corner response of a multi-channel image (structure tensors summed over channels)."""
    sxx = syy = sxy = 0.0
    for ch in channels:
        gx, gy = _gradients(ch)
        sxx, syy, sxy = sxx + gx * gx, syy + gy * gy, sxy + gx * gy
    sxx, syy, sxy = (ndimage.gaussian_filter(a, sigma, mode="nearest") for a in (sxx, syy, sxy))
    return np.maximum(sxx * syy - sxy * sxy - 0.04 * (sxx + syy) ** 2, 0.0)


def _occlusion_edges(z: np.ndarray) -> np.ndarray:
    """Depth gap (metres) on the near side of each depth discontinuity of a z-buffer (no geometry = far)."""
    zp = np.pad(z, 2, mode="edge")
    s = z.shape[0]
    out = np.zeros_like(z)
    for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
        q = zp[2 + dy : 2 + dy + s, 2 + dx : 2 + dx + s]  # neighbour
        back = zp[2 - dy : 2 - dy + s, 2 - dx : 2 - dx + s]  # the neighbour on the other side
        gap = q - z
        is_edge = gap > np.maximum(0.05 + 0.03 * z, 2.0 * np.abs(z - back))
        out = np.maximum(out, np.where(is_edge, gap, 0.0))
    return out


def _nearest(features: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """Index of the nearest centre per row: (N, F), (K, F) -> (N,)."""
    return np.argmin((centers * centers).sum(1)[None, :] - 2.0 * (features @ centers.T), axis=1)  # (N, K)


def _kmeans_segments(features: np.ndarray, k: int, iters: int = 8, stride: int = 4) -> np.ndarray:
    """Deterministic k-means: farthest-point start at row 0, fitted on every ``stride``-th row, then every row
    labelled with its nearest centre; labels renumbered by first appearance. (N, F) -> (N,)"""
    fit = features[::stride]
    centers = [fit[0]]
    d2 = ((fit - fit[0]) ** 2).sum(1)
    for _ in range(1, k):
        centers.append(fit[int(np.argmax(d2))])
        d2 = np.minimum(d2, ((fit - centers[-1]) ** 2).sum(1))
    c = np.stack(centers)  # (K, F)
    labels = _nearest(fit, c)
    for _ in range(iters):
        counts = np.bincount(labels, minlength=k)
        sums = np.stack([np.bincount(labels, fit[:, j], minlength=k) for j in range(fit.shape[1])], 1)
        c = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], c)
        new = _nearest(fit, c)
        if np.array_equal(new, labels):
            break
        labels = new
    labels = _nearest(features, c)
    ids, first = np.unique(labels, return_index=True)
    remap = np.zeros(k, np.int64)
    remap[ids[np.argsort(first)]] = np.arange(len(ids))
    return remap[labels]


def _pixel_coords(s: int) -> np.ndarray:
    yy, xx = np.meshgrid(np.arange(s) / s, np.arange(s) / s, indexing="ij")
    return np.stack([yy.ravel(), xx.ravel()], 1)


def class_object_vector(category: np.ndarray, room_type: int) -> np.ndarray:
    """Visible-area distribution over object categories in the 1000-way ImageNet vector, float32 (1000,).

    With no object in view, the mass is spread evenly over the room type's object categories.
    """
    vec = np.zeros(1000, np.float64)
    counts = np.bincount(category[category >= 0].ravel(), minlength=len(OBJECTS))
    if counts.sum() == 0:
        cats = [_OBJECT_BY_NAME[n] for n in ROOM_TYPES[room_type].objects]
        counts = np.bincount(cats, minlength=len(OBJECTS)).astype(np.float64)
    for i, c in enumerate(OBJECTS):
        vec[c.imagenet] = counts[i] / counts.sum()
    return vec.astype(np.float32)


def class_scene_vector(room_type: int) -> np.ndarray:
    """0.9 on the room type's Places365 index, 0.1 shared by the other room types; float32 (365,)."""
    vec = np.zeros(365, np.float64)
    for i, rt in enumerate(ROOM_TYPES):
        vec[rt.places] = 0.9 if i == room_type else 0.1 / (len(ROOM_TYPES) - 1)
    return vec.astype(np.float32)


def encode_view(view: View, room_type: int) -> dict[str, np.ndarray]:
    """Every domain of one rendered view in its Taskonomy file encoding (see the module docstring)."""
    s = view.rgb.shape[0]
    valid = view.valid
    rgb8 = np.round(view.rgb * 255).astype(np.uint8)

    def depth16(d: np.ndarray) -> np.ndarray:
        q = np.round(np.where(valid, d, 0.0) * DEPTH_SCALE)
        return np.where(valid & (q < DEPTH_INVALID), q, DEPTH_INVALID).astype(np.uint16)

    def unit16(x: np.ndarray) -> np.ndarray:
        return np.round(np.clip(x, 0, 1) * 65535).astype(np.uint16)

    e = view.normal * np.array([-1.0, 1.0, 1.0])
    normal8 = np.where(valid[..., None], np.round((e + 1) / 2 * 255), 128).astype(np.uint8)
    curv = np.full((s, s, 3), 127.0)
    curv[..., :2] = np.where(valid[..., None], 127 + CURVATURE_SCALE * view.curvature, 127)
    shade = np.round(view.shading * 255).astype(np.uint8)

    lum = _luminance(rgb8)
    gx, gy = _gradients(lum)
    sigma = max(1.0, 1.5 * s / 64)  # structure-tensor window, pixels
    z = np.where(valid, view.zdepth, DEPTH_INVALID / DEPTH_SCALE)
    inv_depth = 1.0 / z
    kp3 = _harris([view.normal[..., i] for i in range(3)] + [inv_depth], sigma)

    coords = _pixel_coords(s)
    colour = rgb8.reshape(-1, 3) / 255.0
    seg2d = _kmeans_segments(np.concatenate([colour, 0.5 * coords], 1), NUM_SEGMENTS)
    geo = np.concatenate([0.5 * view.normal.reshape(-1, 3), 0.5 * np.log(z).reshape(-1, 1) / np.log(8.0),
                          0.05 * view.curvature.reshape(-1, 2)], 1)  # fmt: skip
    seg25d = _kmeans_segments(np.concatenate([colour, geo, 0.5 * coords], 1), NUM_SEGMENTS)
    return {
        "rgb": rgb8,
        "depth_euclidean": depth16(view.distance),
        "depth_zbuffer": depth16(view.zdepth),
        "normal": normal8,
        "principal_curvature": np.round(np.clip(curv, 0, 255)).astype(np.uint8),
        "reshading": np.repeat(shade[..., None], 3, axis=2),
        "edge_texture": unit16(np.hypot(gx, gy)),
        "edge_occlusion": unit16(EDGE_OCCLUSION_SCALE * _occlusion_edges(z)),
        "keypoints2d": unit16(KEYPOINTS2D_SCALE * _harris([lum], sigma)),
        "keypoints3d": unit16(KEYPOINTS3D_SCALE * kp3),
        "segment_unsup2d": seg2d.reshape(s, s).astype(np.uint8),
        "segment_unsup25d": seg25d.reshape(s, s).astype(np.uint8),
        "class_object": class_object_vector(view.category, room_type),
        "class_scene": class_scene_vector(room_type),
    }


def image_path(root: str | Path, domain: str, building: str, point: int, view: int) -> Path:
    """Where Taskonomy's download tool puts one domain of one image."""
    ext = "npy" if domain in NPY_DOMAINS else "png"
    return Path(root) / domain / "taskonomy" / building / f"point_{point}_view_{view}_domain_{domain}.{ext}"


def write_view(
    root: str | Path, building: str, point: int, view: int, encoded: dict[str, np.ndarray], mkdirs: bool = True
) -> None:
    """Write the encoded domains of one image (PNG for images, .npy for class vectors) into ``root``.

    ``mkdirs=False`` skips creating the building folders (the caller made them).
    """
    for domain, arr in encoded.items():
        path = image_path(root, domain, building, point, view)
        if mkdirs:
            path.parent.mkdir(parents=True, exist_ok=True)
        if domain in NPY_DOMAINS:
            np.save(path, arr)
        else:
            Image.fromarray(arr).save(path, format="PNG", compress_level=1)


# ----------------------------------------------------------------------------------------------------------------
# The dataset


def split_buildings(buildings: int) -> dict[str, list[str]]:
    """Building names per split: about 6/8 train, 1/8 val, 1/8 test (at least one each), in name order."""
    if buildings < 3:
        raise ValueError(f"buildings must be >= 3 (one per split), got {buildings}")
    held = max(1, round(buildings / 8))
    names = [f"synth{b:02d}" for b in range(buildings)]
    n_train = buildings - 2 * held
    return {"train": names[:n_train], "val": names[n_train : n_train + held], "test": names[n_train + held :]}


@dataclass(frozen=True)
class _RoomJob:
    out: str
    seed: int
    image_size: int
    building_index: int
    building: str
    room: int
    points: tuple[tuple[int, int], ...]  # (point index in the building, number of views)


def _plan(n: int, names: list[str], out: str, seed: int, image_size: int) -> list[_RoomJob]:
    """Images spread evenly over buildings; points of VIEWS_PER_POINT views; POINTS_PER_ROOM points per room."""
    jobs = []
    for b, name in enumerate(names):
        n_b = n // len(names) + (b < n % len(names))
        points = [(p, min(VIEWS_PER_POINT, n_b - p * VIEWS_PER_POINT)) for p in range(-(-n_b // VIEWS_PER_POINT))]
        for r in range(-(-len(points) // POINTS_PER_ROOM)):
            chunk = tuple(points[r * POINTS_PER_ROOM : (r + 1) * POINTS_PER_ROOM])
            jobs.append(_RoomJob(out, seed, image_size, b, name, r, chunk))
    return jobs


def _render_room(job: _RoomJob) -> tuple[int, int]:
    """Render and write every view of one room; returns (images, pixels without geometry)."""
    rng = np.random.default_rng([job.seed, job.building_index, job.room])
    room = sample_room(rng)
    scene = room.scene
    for domain in DOMAINS:
        image_path(job.out, domain, job.building, 0, 0).parent.mkdir(parents=True, exist_ok=True)
    images = invalid = 0
    for point, views in job.points:
        target = int(rng.integers(len(scene.shapes))) if scene.shapes else -1
        for v in range(views):
            if target >= 0:
                camera = sample_camera(rng, scene, target)
            else:  # an empty room: look at a random wall point
                w, h, d = scene.room.size
                camera = Camera((w / 2, 1.5, d / 2), (float(rng.uniform(0, w)), 1.2, 0.0), FOV_DEG)
            view = render_view(scene, camera, job.image_size)
            write_view(job.out, job.building, point, v, encode_view(view, room.room_type), mkdirs=False)
            images += 1
            invalid += int((~view.valid).sum())
    return images, invalid


def write_split_csv(path: str | Path, splits: dict[str, list[str]]) -> None:
    """Taskonomy's split file: header ``id,train,val,test``, one row per building, CR-only line endings."""
    rows = ["id,train,val,test"]
    for split in ("train", "val", "test"):
        for name in splits[split]:
            rows.append(",".join([name] + ["1" if s == split else "0" for s in ("train", "val", "test")]))
    Path(path).write_bytes(("\r".join(rows) + "\r").encode("ascii"))


def _manifest(n: int, image_size: int, seed: int, splits: dict[str, list[str]], invalid: int) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "n": n,
        "image_size": image_size,
        "seed": seed,
        "fov_deg": FOV_DEG,
        "views_per_point": VIEWS_PER_POINT,
        "domains": list(DOMAINS),
        "buildings": splits,
        "split_csv": "train_val_test_synthetic.csv",
        "pixels_without_geometry": invalid,
        "object_categories": [
            {"name": c.name, "imagenet_index": c.imagenet, "shape": c.shape} for c in OBJECTS
        ],
        "scene_categories": [
            {"name": r.name, "places365_index": r.places, "objects": list(r.objects)} for r in ROOM_TYPES
        ],
        "encodings": {
            "depth": f"uint16 metres*{DEPTH_SCALE:g}, {DEPTH_INVALID} = no geometry",
            "normal": "uint8 round((e+1)/2*255), e = (-x, y, z) in the camera frame (x right, y up, z toward the"
            " viewer); (128,128,128) = no geometry",
            "principal_curvature": f"uint8 ch0 = 127+{CURVATURE_SCALE:g}*k1, ch1 = 127+{CURVATURE_SCALE:g}*k2 "
            "(1/m, k1 >= k2, convex > 0), ch2 = 127",
            "reshading": "uint8 grey RGB, 255*(0.2+0.8*max(0, n.l)), 0 = no geometry",
            "edge_texture": "uint16/65535 = Sobel gradient magnitude of the RGB luminance (per pixel)",
            "edge_occlusion": f"uint16/65535 = {EDGE_OCCLUSION_SCALE:g} * depth gap in metres (near side)",
            "keypoints2d": f"uint16/65535 = min(1, {KEYPOINTS2D_SCALE:g} * Harris(luminance))",
            "keypoints3d": f"uint16/65535 = min(1, {KEYPOINTS3D_SCALE:g} * Harris(normals, 1/depth))",
            "segment_unsup2d": f"uint8 ids < {NUM_SEGMENTS}",
            "segment_unsup25d": f"uint8 ids < {NUM_SEGMENTS}",
            "class_object": "float32 (1000,) visible-area share per ImageNet index, sums to 1",
            "class_scene": "float32 (365,) Places365, 0.9 room type + 0.1 over the other room types, sums to 1",
        },
    }


def _clear_previous(out: Path, overwrite: bool) -> None:
    if not out.exists() or not any(out.iterdir()):
        return
    manifest = out / "synthetic.json"
    if not overwrite:
        raise FileExistsError(f"{out} is not empty; choose an empty directory or pass overwrite=True")
    if not manifest.is_file():
        raise FileExistsError(f"{out} is not empty and holds no synthetic.json: refusing to overwrite it")
    old = json.loads(manifest.read_text())
    for domain in old.get("domains", []):
        for names in old.get("buildings", {}).values():
            for name in names:
                shutil.rmtree(out / domain / "taskonomy" / name, ignore_errors=True)
    (out / old.get("split_csv", "train_val_test_synthetic.csv")).unlink(missing_ok=True)
    manifest.unlink()


@contextmanager
def _single_threaded_children() -> Iterator[None]:
    """Processes spawned inside this block start with one BLAS/OpenMP thread each (the pool is the parallelism;
    idle BLAS threads spinning on 2 cores cost more than the small matmuls gain)."""
    keys = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def render_dataset(
    out: str | Path,
    n: int,
    image_size: int,
    seed: int,
    buildings: int | None = None,
    *,
    workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Render ``n`` synthetic images with all Taskonomy domains into ``out`` (layout: module docstring).

    Args:
        out: output root; must be empty or absent (or a previous render, with ``overwrite=True``).
        n: number of images (>= 3).
        image_size: side in pixels (>= 8).
        seed: non-negative seed; the same arguments give the same bytes whatever ``workers`` is.
        buildings: number of buildings (default min(8, n)), split about 6:1:1 into train/val/test.
        workers: processes (default: up to 2 CPUs; 1 renders in this process).
        overwrite: replace a previous synthetic render in ``out``.

    Returns:
        The path of the split CSV, ``{out}/train_val_test_synthetic.csv``.
    """
    if n < 3:
        raise ValueError(f"n must be >= 3 (one image per split), got {n}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8, got {image_size}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    buildings = min(8, n) if buildings is None else buildings
    if buildings > n:
        raise ValueError(f"buildings ({buildings}) must not exceed n ({n})")
    splits = split_buildings(buildings)
    out = Path(out)
    _clear_previous(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    names = [name for split in ("train", "val", "test") for name in splits[split]]
    jobs = _plan(n, sorted(names), str(out), seed, image_size)
    workers = min(2, os.cpu_count() or 1) if workers is None else workers
    if workers > 1 and len(jobs) > 1:
        with _single_threaded_children(), ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_render_room, jobs, chunksize=max(1, len(jobs) // (8 * workers))))
    else:
        results = [_render_room(job) for job in jobs]
    images = sum(r[0] for r in results)
    invalid = sum(r[1] for r in results)
    assert images == n, f"rendered {images} images, planned {n}"
    csv = out / "train_val_test_synthetic.csv"
    write_split_csv(csv, splits)
    manifest = _manifest(n, image_size, seed, splits, invalid)
    (out / "synthetic.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    logger.info("rendered %d synthetic images (%d px) into %s: %s", n, image_size, out,
                {k: len(v) for k, v in splits.items()})  # fmt: skip
    return csv
