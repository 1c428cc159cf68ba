"""The embedded default dataset: procedural indoor scenes written as a Taskonomy tree.

``render_dataset`` samples rooms (walls, floor, ceiling, windows, doorways and holes in the "scan"), furnishes them
with boxes, spheres and cylinders whose shape, size and colour identify an object category, ray-casts several views
of fixated points with ``squad.data.synthetic.render`` and writes every image in Taskonomy's own layout and
encodings, with the 2-D domains computed the way Taskonomy's generator computes them
(``squad.data.synthetic.annotate``)::

    {out}/{domain}/taskonomy/{building}/point_{p}_view_{v}_domain_{domain}.png   (.npy for the class domains)
    {out}/train_val_test_synthetic.csv    id,train,val,test with CR-only line endings, one row per building
    {out}/synthetic.json                  manifest: sizes, seed, splits, categories, encodings

Encodings (S x S images; "invalid" = no geometry: the ray left the scene through an opening):
    rgb                 uint8 RGB.
    depth_euclidean     uint16, distance from the camera centre in metres x 512; 65535 where invalid.
    depth_zbuffer       uint16, depth along the optical axis in metres x 512; 65535 where invalid.
    normal              uint8 RGB, round((e + 1) * 127.5) of the unit normal e in the camera frame x right, y down,
                        z into the scene (a floor seen from above is about (128, 1, 118), a wall facing the camera
                        has blue near 0). (128, 128, 128) where invalid.
    principal_curvature uint8 RGB as Taskonomy's generator: channel 0 = round(127 + 3.81 k1), channel 1 =
                        round(127 + 3.81 k2), 3.81 = 127 x 0.03 codes per 1/m, k clipped to +-1/0.03 /m (MeshLab APSS
                        K1, K2: |k1| >= |k2|, convex > 0); channel 2 = 0. (0, 0, 0) where invalid.
    reshading           uint8 grey RGB, 255 x min(1, RESHADING_EXPOSURE x shading) under a lamp at the camera
                        (``render.View.shading``); 8..13 (varying per pixel) where invalid.
    edge_texture        uint16 / 65535, Sobel magnitude of the blurred grey image per 512-px pixel (annotate).
    edge_occlusion      uint16 / 65535, Sobel magnitude of sqrt(z-buffer code / 2^16) per 512-px pixel; 0 next to
                        invalid pixels.
    keypoints2d         uint16 / 65535, determinant-of-Hessian response over scales, clipped at 0.
    keypoints3d         uint16 / 65535, NARF-like interest of the geometry in [0, 1]; 0 where invalid.
    segment_unsup2d     uint8, colour segments numbered in raster order and rescaled over 0..255 (0 and 255 present).
    segment_unsup25d    uint8, the same on depth, normals and occlusion edges.
    class_object        float32 (1000,), a softmax spread over many ImageNet classes (as ResNet-152's distilled
                        outputs are); its argmax is the category covering most of the view (the room type's
                        likeliest object when none is in view).
    class_scene         float32 (365,), a Places365 softmax whose argmax is the room type.

Calibration. The file statistics are held to real Taskonomy's (``python tools/make_data.py stats ROOT``, references
in ``squad.data.offline.stats``) at the default 64 px. Geometry-driven domains come out of the scenes as rendered
(depth, normals, curvature with its crease radii, roughness and clutter, masked share, keypoints3d's support), except
for these constants, each for something a 64-px procedural room lacks against a 512-px photo of a furnished scan:
``EDGE_TEXTURE_GAIN`` (fine texture: even a real view emulated at 64 px keeps only 2/3 of its edge_texture mean and
no pixel at the 0.08 clip), ``KEYPOINTS2D_GAIN`` and ``KEYPOINTS2D_POWER`` (the small SURF scales a 64-px image
cannot resolve: the 64-px response is flatter, mean up and tail down), ``EDGE_OCCLUSION_GAINS`` (fewer and more
frontal surfaces than real clutter) and ``RESHADING_EXPOSURE`` (the lamp's brightness). Other sizes use the same
constants, so their statistics drift somewhat from the real ones.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from squad.data.synthetic import annotate
from squad.data.synthetic.jobs import default_workers, run_jobs
from squad.data.synthetic.render import (
    NUM_ROOM_FACES,
    Box,
    Camera,
    Cylinder,
    Material,
    Opening,
    Room,
    Scene,
    Sphere,
    View,
    cast,
    render_view,
)
from squad.io.files import atomic_save, atomic_write_bytes, atomic_write_text, removed_on_failure, sync_tree

logger = logging.getLogger(__name__)

DOMAINS = (
    "rgb", "depth_euclidean", "depth_zbuffer", "normal", "principal_curvature", "reshading", "edge_texture",
    "edge_occlusion", "keypoints2d", "keypoints3d", "segment_unsup2d", "segment_unsup25d", "class_object",
    "class_scene",
)  # fmt: skip
NPY_DOMAINS = ("class_object", "class_scene")
DEPTH_SCALE = 512.0  # uint16 units per metre
DEPTH_INVALID = 65535
CURVATURE_MIN_RADIUS = 0.03  # metres: Taskonomy clips curvature at 1 / this
CURVATURE_SCALE = 127.0 * CURVATURE_MIN_RADIUS  # uint8 steps per 1/m (3.81)
RESHADING_EXPOSURE = 1.15
RESHADING_FILL = (8, 13)  # inclusive range of the values invalid reshading pixels hold
EDGE_TEXTURE_GAIN = 2.3
EDGE_OCCLUSION_GAINS = (1.5, 1.6)  # (smooth surfaces, depth discontinuities), see the module docstring
KEYPOINTS2D_GAIN = 17.0
KEYPOINTS2D_POWER = 1.5
FOV_DEG = 60.0
VIEWS_PER_POINT = 3
POINTS_PER_ROOM = 2
FORMAT_VERSION = 2  # 1: normals in (-x, y up, z toward the viewer), curvature 127 + 12 k, 16 segment ids, ...
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
    ObjectCategory("bookcase", 453, "box", ((0.8, 1.0), (1.8, 2.1), (0.3, 0.4)), (0.5, 0.33, 0.2), (0.85, 0.8, 0.7),
                   "bands", 0.35),
    ObjectCategory("desk", 526, "box", ((1.1, 1.5), (0.72, 0.78), (0.6, 0.75)), (0.6, 0.45, 0.3), (0.4, 0.3, 0.2),
                   "stripes", 0.08),
    ObjectCategory("studio couch", 831, "box", ((1.8, 2.3), (0.75, 0.9), (0.85, 1.0)), (0.2, 0.25, 0.45),
                   (0.15, 0.18, 0.35), "checker", 0.2),
    ObjectCategory("dining table", 532, "box", ((1.2, 1.8), (0.05, 0.07), (0.8, 1.0)), (0.55, 0.35, 0.2),
                   lift=(0.68, 0.74)),
    ObjectCategory("pot", 738, "cylinder", ((0.15, 0.25), (0.25, 0.4)), (0.7, 0.35, 0.2), (0.2, 0.5, 0.15), "bands",
                   0.12),
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
             Material((0.6, 0.62, 0.65), (0.45, 0.47, 0.5), "checker", 0.15), ("vase", "ashcan", "pot", "basketball")),
    RoomType("bedroom", 52, Material((0.85, 0.7, 0.78)), Material((0.6, 0.42, 0.25), (0.5, 0.34, 0.2), "stripes", 0.2),
             ("wardrobe", "chest", "balloon", "lampshade", "soccer ball", "desk")),
    RoomType("kitchen", 203, Material((0.95, 0.9, 0.6)), Material((0.92, 0.92, 0.92), (0.1, 0.1, 0.1), "checker", 0.4),
             ("refrigerator", "ashcan", "crate", "vase", "barrel", "dining table")),
    RoomType("living_room", 215, Material((0.62, 0.72, 0.55)), Material((0.55, 0.38, 0.22), (0.45, 0.3, 0.17),
             "stripes", 0.3), ("television", "lampshade", "vase", "chest", "studio couch", "bookcase", "pot")),
    RoomType("office", 244, Material((0.8, 0.8, 0.8)), Material((0.35, 0.42, 0.55)),
             ("file cabinet", "ashcan", "television", "desk", "bookcase", "pot")),
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


def _jitter_material(rng: np.random.Generator, m: Material, amount: float, grain: tuple[float, float]) -> Material:
    return Material(_jitter(rng, m.color, amount), _jitter(rng, m.color2, amount), m.pattern, m.scale,
                    float(rng.uniform(*grain)))  # fmt: skip


def _make_object(rng: np.random.Generator, cat: int, x: float, z: float) -> Box | Sphere | Cylinder:
    c = OBJECTS[cat]
    dims = [rng.uniform(lo, hi) for lo, hi in c.size]
    lift = rng.uniform(*c.lift)
    mat = Material(_jitter(rng, c.color, 0.05), _jitter(rng, c.color2, 0.05), c.pattern, c.scale,
                   float(rng.uniform(0.1, 0.4)))  # fmt: skip
    if c.shape == "box":
        w, h, d = dims
        bevel = min(float(rng.uniform(0.02, 0.045)), 0.45 * min(dims) / 2)
        return Box((x, lift + h / 2, z), (w / 2, h / 2, d / 2), float(rng.uniform(0, np.pi)), mat, cat, bevel)
    if c.shape == "sphere":
        return Sphere((x, lift + dims[0], z), dims[0], mat, cat)
    bevel = min(float(rng.uniform(0.015, 0.035)), 0.45 * min(dims[0], dims[1] / 2))
    return Cylinder((x, lift, z), dims[0], dims[1], mat, cat, bevel)


def _footprint(c: ObjectCategory) -> float:
    """Largest horizontal half-extent of a category (metres)."""
    if c.shape == "box":
        return math.hypot(c.size[0][1], c.size[2][1]) / 2
    return c.size[0][1]


def _face_extent(size: tuple[float, float, float], face: int) -> tuple[float, float]:
    """Extent of a room face along its (u, v) coordinates (``render.Opening``)."""
    w, h, d = size
    return ((w, d), (w, d), (d, h), (d, h), (w, h), (w, h))[face]


def _openings(rng: np.random.Generator, size: tuple[float, float, float]) -> tuple[Opening, ...]:
    """Windows (rectangles in the walls split by mullions), a doorway, and holes in the scan (frayed ellipses on any
    face): no geometry behind them, as on Taskonomy's meshes (glass, open doors and unscanned surfaces)."""
    h = size[1]
    out = []
    for _ in range(int(rng.integers(1, 5))):  # windows
        face = int(rng.integers(2, 6))
        span = _face_extent(size, face)[0]
        ww, wh = min(rng.uniform(0.8, 2.4), span - 0.6), rng.uniform(0.9, min(1.7, h - 1.2))
        u0, v0 = rng.uniform(0.3, span - ww - 0.3), rng.uniform(0.6, h - wh - 0.3)
        panes = int(rng.integers(1, 4))  # split by mullions 8 cm wide
        pw = (ww - 0.08 * (panes - 1)) / panes
        for i in range(panes):
            a = u0 + i * (pw + 0.08)
            out.append(Opening(face, (a, v0), (a + pw, v0 + wh)))
    if rng.random() < 0.8:  # a doorway
        face = int(rng.integers(2, 6))
        span = _face_extent(size, face)[0]
        dw = min(rng.uniform(0.8, 1.6), span - 0.6)
        u0 = rng.uniform(0.3, span - dw - 0.3)
        out.append(Opening(face, (u0, 0.0), (u0 + dw, min(rng.uniform(2.0, 2.4), h - 0.1))))
    for _ in range(int(rng.integers(2, 8))):  # holes in the scan
        face = int(rng.integers(0, 6))
        eu, ev = _face_extent(size, face)
        hu, hv = rng.uniform(0.6, 2.6), rng.uniform(0.5, 1.8)
        u0, v0 = rng.uniform(0.0, max(eu - hu, 0.01)), rng.uniform(0.0, max(ev - hv, 0.01))
        out.append(Opening(face, (u0, v0), (u0 + hu, v0 + hv), ellipse=True, ragged=int(rng.integers(1, 1 << 30))))
    return tuple(out)


def sample_room(rng: np.random.Generator, room_type: int | None = None) -> SyntheticRoom:
    """Sample a furnished room: 3-8 m wide, 3.5-8 m deep (45 % are 10-18 m halls), 2.5-3.4 m high, with
    openings, 10-20 objects, rounded creases, scan roughness and clutter, and one light."""
    rt = int(rng.integers(len(ROOM_TYPES))) if room_type is None else room_type
    kind = ROOM_TYPES[rt]
    w, h = rng.uniform(3.0, 8.0), rng.uniform(2.5, 3.4)
    d = rng.uniform(10.0, 18.0) if rng.random() < 0.45 else rng.uniform(3.5, 8.0)
    room = Room((w, h, d), _jitter_material(rng, kind.floor, 0.06, (0.15, 0.45)),
                _jitter_material(rng, kind.walls, 0.06, (0.05, 0.25)),
                Material(_jitter(rng, (0.93, 0.93, 0.9), 0.03), grain=float(rng.uniform(0.0, 0.08))),
                _openings(rng, (w, h, d)), float(rng.uniform(0.02, 0.045)))  # fmt: skip
    shapes, placed = [], []  # placed: (x, z, footprint radius)
    for _ in range(int(rng.integers(10, 21))):
        cat = _OBJECT_BY_NAME[kind.objects[int(rng.integers(len(kind.objects)))]]
        rad = _footprint(OBJECTS[cat])
        for _try in range(50):
            x, z = rng.uniform(rad + 0.1, w - rad - 0.1), rng.uniform(rad + 0.1, d - rad - 0.1)
            if all(math.hypot(x - px, z - pz) > rad + pr + 0.1 for px, pz, pr in placed):
                placed.append((x, z, rad))
                shapes.append(_make_object(rng, cat, x, z))
                break
    light = (rng.uniform(0.3, 0.7) * w, h - 0.25, rng.uniform(0.3, 0.7) * d)
    scene = Scene(room, tuple(shapes), light, roughness=float(rng.uniform(0.3, 1.0)),
                  clutter=float(rng.uniform(18, 42)), noise_seed=int(rng.integers(1 << 30)))  # fmt: skip
    return SyntheticRoom(scene, rt)


def sample_fixation(rng: np.random.Generator, scene: Scene) -> tuple[np.ndarray, int]:
    """A point to fixate and the surface it lies on (``render.View.surface`` ids): an object's centre (85 % of the
    time) or a point on a wall, the floor or the ceiling."""
    w, h, d = scene.room.size
    if scene.shapes and rng.random() < 0.85:
        target = int(rng.integers(len(scene.shapes)))
        shape = scene.shapes[target]
        lift = rng.uniform(-0.1, 1.0)  # a point on or above it: views look up as often as down
        aim = np.asarray(shape.center) + np.array([0.0, lift, 0.0]) + rng.uniform(-0.03, 0.03, 3)
        return aim, NUM_ROOM_FACES + target
    face = int(rng.choice([0, 1, 2, 3, 4, 5]))
    u, v = rng.uniform(0.2, 0.8, 2) * np.array([[w, d], [w, d], [d, h], [d, h], [w, h], [w, h]][face])
    point = {0: (u, 0.0, v), 1: (u, h, v), 2: (0.0, v, u), 3: (w, v, u), 4: (u, v, 0.0), 5: (u, v, d)}[face]
    return np.asarray(point, np.float64), face


def sample_camera(rng: np.random.Generator, scene: Scene, aim: np.ndarray, surface: int, tries: int = 40) -> Camera:
    """A camera inside the room, clear of every shape, 0.8-3.5 m from ``aim`` (0.8-14 m in half the views),
    seeing it on ``surface``: the first of ``tries`` random positions that qualifies."""
    w, h, d = scene.room.size
    far = 3.5 if rng.random() < 0.5 else 14.0
    lo, hi = np.array([0.3, 0.9, 0.3]), np.array([w - 0.3, min(1.9, h - 0.3), d - 0.3])
    pos = lo + rng.random((tries, 3)) * (hi - lo)  # (T, 3) candidates, tried in order
    dist = np.linalg.norm(aim - pos, axis=1)
    ok = (dist >= 0.8) & (dist <= far) & (np.abs(aim[1] - pos[:, 1]) <= 0.95 * dist)
    for shape in scene.shapes:
        ok &= np.linalg.norm(pos - np.asarray(shape.center), axis=1) >= shape.bounding_radius() + 0.3
    if ok.any():
        _, sid = cast(scene, pos[ok], (aim - pos[ok]) / dist[ok, None])
        sees = np.flatnonzero(sid == surface)
        best = pos[ok][sees[0]] if len(sees) else pos[ok][-1]
    else:  # cramped room: the corner farthest from the target
        best = np.array([0.4 if aim[0] > w / 2 else w - 0.4, min(1.5, h - 0.3), 0.4 if aim[2] > d / 2 else d - 0.4])
    return Camera(tuple(float(v) for v in best), tuple(float(v) for v in aim), FOV_DEG)


# ----------------------------------------------------------------------------------------------------------------
# Class labels


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def _related(index: int, classes: int, count: int) -> np.ndarray:
    """A fixed set of other classes a classifier confuses with ``index`` (deterministic per index)."""
    others = np.random.default_rng([index, classes]).choice(classes - 1, count, replace=False)
    return others + (others >= index)


def _soft_label(
    rng: np.random.Generator, classes: int, weights: dict[int, float], peak: float, related: int
) -> np.ndarray:
    """A classifier-like softmax over ``classes``: every class gets a random logit around 0, each index in
    ``weights`` (share in (0, 1]) a logit ``peak + log(share)`` and its related classes a few less; the index of the
    largest share is made the argmax. float32 (classes,)."""
    logits = rng.normal(0.0, 1.0, classes)
    for index, share in weights.items():
        top = peak + math.log(share) + rng.normal(0.0, 0.4)
        rel = _related(index, classes, related)
        logits[rel] = np.maximum(logits[rel], top - rng.uniform(2.5, 5.0, related))
        logits[index] = max(logits[index], top)
    best = max(weights, key=lambda i: (weights[i], -i))
    others = np.delete(logits, best)
    logits[best] = max(logits[best], others.max() + 0.5)
    return _softmax(logits).astype(np.float32)


def class_object_vector(category: np.ndarray, room_type: int, rng: np.random.Generator) -> np.ndarray:
    """ImageNet distribution (1000,) float32 for a view whose pixels show object ``category`` (-1: none).

    Mass follows the visible area of each category (the largest is the argmax, holding 0.2-0.75 of the mass), the
    rest spread over many classes like a ResNet-152's softmax. With no object in view, the room type's categories
    share the peak (its first listed category on top).
    """
    counts = np.bincount(category[category >= 0].ravel(), minlength=len(OBJECTS)).astype(np.float64)
    if counts.sum() == 0:
        cats = [_OBJECT_BY_NAME[n] for n in ROOM_TYPES[room_type].objects]
        counts = np.zeros(len(OBJECTS))
        counts[cats] = np.linspace(1.0, 0.5, len(cats))
    shares = counts / counts.max()
    weights = {OBJECTS[i].imagenet: float(s) for i, s in enumerate(shares) if s > 0}
    return _soft_label(rng, 1000, weights, peak=7.6, related=6)


def class_scene_vector(room_type: int, rng: np.random.Generator) -> np.ndarray:
    """Places365 distribution (365,) float32: the room type is the argmax (0.25-0.75 of the mass), the other room
    types and a few related scenes next, the rest spread thin."""
    weights = {rt.places: (1.0 if i == room_type else 0.03) for i, rt in enumerate(ROOM_TYPES)}
    return _soft_label(rng, 365, weights, peak=6.6, related=4)


# ----------------------------------------------------------------------------------------------------------------
# Encoding


def encode_view(
    view: View, room_type: int, rng: np.random.Generator | None = None, fov_deg: float = FOV_DEG
) -> dict[str, np.ndarray]:
    """Every domain of one rendered view in its Taskonomy file encoding (see the module docstring).

    ``rng`` draws the class distributions' spread and the reshading fill (default: a fixed seed); ``fov_deg`` is the
    camera's field of view (keypoints3d measures its support in metres).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    s = view.rgb.shape[0]
    valid = view.valid
    rgb8 = np.round(view.rgb * 255).astype(np.uint8)

    def depth16(d: np.ndarray) -> np.ndarray:
        q = np.round(np.where(valid, d, 0.0) * DEPTH_SCALE)
        return np.where(valid & (q < DEPTH_INVALID), q, DEPTH_INVALID).astype(np.uint16)

    def unit16(x: np.ndarray) -> np.ndarray:
        return np.round(np.clip(x, 0, 1) * 65535).astype(np.uint16)

    normal8 = np.where(valid[..., None], np.clip(np.round((view.normal + 1) * 127.5), 0, 255), 128).astype(np.uint8)
    curv = np.zeros((s, s, 3))
    k = np.clip(view.curvature, -1 / CURVATURE_MIN_RADIUS, 1 / CURVATURE_MIN_RADIUS)
    curv[..., :2] = np.where(valid[..., None], np.round(127 + CURVATURE_SCALE * k), 0)
    fill = rng.integers(RESHADING_FILL[0], RESHADING_FILL[1] + 1, (s, s))
    shade = np.where(valid, np.round(255 * np.clip(RESHADING_EXPOSURE * view.shading, 0, 1)), fill).astype(np.uint8)

    zbuffer = depth16(view.zdepth)
    lum = annotate.luminance(rgb8)
    occlusion = unit16(annotate.edge_occlusion(zbuffer.astype(np.float64), *EDGE_OCCLUSION_GAINS))
    focal = s / 2 / math.tan(math.radians(fov_deg) / 2)
    return {
        "rgb": rgb8,
        "depth_euclidean": depth16(view.distance),
        "depth_zbuffer": zbuffer,
        "normal": normal8,
        "principal_curvature": curv.astype(np.uint8),
        "reshading": np.repeat(shade[..., None], 3, axis=2),
        "edge_texture": unit16(EDGE_TEXTURE_GAIN * annotate.edge_texture(lum)),
        "edge_occlusion": occlusion,
        "keypoints2d": unit16(KEYPOINTS2D_GAIN * annotate.keypoints2d(lum) ** KEYPOINTS2D_POWER),
        "keypoints3d": unit16(annotate.keypoints3d(view.normal, view.zdepth, valid, focal)),
        "segment_unsup2d": annotate.segment_unsup2d(rgb8),
        "segment_unsup25d": annotate.segment_unsup25d(zbuffer.astype(np.float64), normal8, occlusion),
        "class_object": class_object_vector(view.category, room_type, rng),
        "class_scene": class_scene_vector(room_type, rng),
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
        # each file whole or absent; the render syncs once, before its manifest (squad.io.files)
        if domain in NPY_DOMAINS:
            atomic_save(path, lambda f, arr=arr: np.save(f, arr), sync=False)
        else:
            image = Image.fromarray(arr)
            atomic_save(path, lambda f, image=image: image.save(f, format="PNG", compress_level=1), sync=False)


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
        aim, surface = sample_fixation(rng, scene)
        for v in range(views):
            camera = sample_camera(rng, scene, aim, surface)
            view = render_view(scene, camera, job.image_size)
            labels = np.random.default_rng([job.seed, job.building_index, job.room, point, v])
            write_view(job.out, job.building, point, v, encode_view(view, room.room_type, labels), mkdirs=False)
            images += 1
            invalid += int((~view.valid).sum())
    return images, invalid


def write_split_csv(path: str | Path, splits: dict[str, list[str]]) -> None:
    """Taskonomy's split file: header ``id,train,val,test``, one row per building, CR-only line endings."""
    rows = ["id,train,val,test"]
    for split in ("train", "val", "test"):
        for name in splits[split]:
            rows.append(",".join([name] + ["1" if s == split else "0" for s in ("train", "val", "test")]))
    atomic_write_bytes(path, ("\r".join(rows) + "\r").encode("ascii"), "the split CSV")


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
            "normal": "uint8 round((e+1)*127.5), e = unit normal in the camera frame x right, y down, z into the "
            "scene (Taskonomy's); (128,128,128) = no geometry",
            "principal_curvature": f"uint8 ch0 = round(127+{CURVATURE_SCALE:g}*k1), ch1 = round(127+"
            f"{CURVATURE_SCALE:g}*k2) (1/m clipped to +-{1 / CURVATURE_MIN_RADIUS:.1f}, |k1| >= |k2|, convex > 0), "
            "ch2 = 0; (0,0,0) = no geometry",
            "reshading": f"uint8 grey RGB, 255*min(1, {RESHADING_EXPOSURE:g}*cos*8/(8+r^2)) under a lamp at the "
            f"camera; {RESHADING_FILL[0]}..{RESHADING_FILL[1]} = no geometry",
            "edge_texture": "uint16/65535 = Sobel magnitude of the blurred grey image per 512-px pixel",
            "edge_occlusion": "uint16/65535 = Sobel magnitude of sqrt(z-buffer code/65536) per 512-px pixel; 0 next "
            "to no geometry",
            "keypoints2d": "uint16/65535 = max over scales of the determinant of Hessian, clipped at 0",
            "keypoints3d": "uint16/65535 = NARF-like interest in [0, 1]; 0 = no geometry",
            "segment_unsup2d": "uint8 colour segments in raster order, ids rescaled over 0..255",
            "segment_unsup25d": "uint8 depth/normal/edge segments in raster order, ids rescaled over 0..255",
            "class_object": "float32 (1000,) softmax over ImageNet, argmax = the largest visible category, sums to 1",
            "class_scene": "float32 (365,) softmax over Places365, argmax = the room type, sums to 1",
        },
    }


def _clear_previous(out: Path, overwrite: bool) -> None:
    if not out.exists() or not any(out.iterdir()):
        return
    manifest = out / "synthetic.json"
    if not overwrite:
        raise FileExistsError(f"{out} is not empty; choose an empty directory, or replace an earlier render with "
                              "--overwrite (overwrite=True)")
    if not manifest.is_file():
        raise FileExistsError(f"{out} is not empty and holds no synthetic.json: refusing to overwrite it")
    old = json.loads(manifest.read_text())
    for domain in old.get("domains", []):
        for names in old.get("buildings", {}).values():
            for name in names:
                shutil.rmtree(out / domain / "taskonomy" / name, ignore_errors=True)
    (out / old.get("split_csv", "train_val_test_synthetic.csv")).unlink(missing_ok=True)
    manifest.unlink()



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
        workers: processes (default: `jobs.default_workers`: 1, in this process, for a small render; else up to 2).
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
    workers = default_workers(n, image_size) if workers is None else workers
    csv = out / "train_val_test_synthetic.csv"
    made = [out / domain for domain in DOMAINS] + [csv, out / "synthetic.json"]
    with removed_on_failure(made, f"the render in {out}"):  # a full disk leaves nothing behind
        results = run_jobs(_render_room, jobs, workers)
        images = sum(r[0] for r in results)
        invalid = sum(r[1] for r in results)
        assert images == n, f"rendered {images} images, planned {n}"
        write_split_csv(csv, splits)
        manifest = _manifest(n, image_size, seed, splits, invalid)
        sync_tree(out)  # every image on disk before the manifest that marks the render complete
        atomic_write_text(out / "synthetic.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n",
                          "the manifest")
    logger.info("rendered %d synthetic images (%d px) into %s: %s", n, image_size, out,
                {k: len(v) for k, v in splits.items()})  # fmt: skip
    return csv
