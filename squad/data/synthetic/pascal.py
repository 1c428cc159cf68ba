"""A synthetic PASCAL-Context, written in the PASCAL_MT layout and encodings that the real reader loads.

``render_pascal`` samples indoor rooms and outdoor lots (a large "room" whose ceiling is open sky), places the 20
VOC classes built from primitives (cars with cabins and wheels, four-legged animals, chairs, tables, planes, ...),
context-only objects (trees, poles, cabinets, beds, ...) and articulated people (``synthetic_dense``; in about half
of the images), aims a camera at a main subject, ray-casts it (``squad.data.synthetic.render``) and writes, per image
id::

    {out}/JPEGImages/{id}.jpg                 RGB JPEG (quality 90), W x H, non-square (see "Sizes")
    {out}/semseg/pascal-context/{id}.png      uint8 grey: 0 background, 1..20 VOC classes (VOC_CLASSES order),
                                              255 = unlabelled (LabelMap 0: objects too small to annotate)
    {out}/pascal-context/trainval/{id}.mat    {"LabelMap": uint16 H x W}: PASCAL-Context's 459-class labels
                                              (CONTEXT_LABELS ids, 1-based; 0 unlabelled); edges are derived from it
                                              by the reader, as ASTMT does (|Laplacian| > 0, thinned)
    {out}/human_parts/{id}.mat                PASCAL-Part's {"anno"}: 1x1 struct (imname, objects); objects 1xN
                                              struct (class, class_ind, mask uint8 H x W, parts); parts 1xM struct
                                              (part_name, mask) for people, [] otherwise. Part names are
                                              PASCAL-Part's (head, hair, neck, torso, luarm, llarm, lhand, ...,
                                              ``synthetic_dense.PART_NAMES``), grouped into 6 ids by
                                              ``synthetic_dense.PARTS_6`` as ASTMT's reader does
    {out}/sal_distill/{id}.png                uint8 grey saliency in 0..255, soft at object outlines (> 127.5 = salient)
    {out}/normals_distill/{id}.png            uint8 RGB round((n + 1) * 127.5), n = unit normal, x right, y up, z toward
                                              the camera, everywhere (the reader keeps NYU-mappable classes only);
                                              (128, 128, 255) where no geometry (sky, windows)
    {out}/ImageSets/Context/{train,val}.txt   image ids, one per line
    {out}/ImageSets/Parts/{train,val}.txt     ASTMT's object-category cache: JSON {id: [class_ind of each object]}
    {out}/synthetic.json                      manifest: dataset, n, sizes, seed, splits, classes, encodings, folders

Ids look like PASCAL's (``2008_000123``). The train/val split follows the real proportions (4,998 / 5,105).

Sizes. Real images are about 500 x 375 and vary (landscape 4:3 most, portrait 3:4, 3:2, near square); here the long
side is ``image_size`` (default 128, a quarter of 500-ish) and the aspect is drawn from those shapes per image, so a
default image is 128 x 96, 96 x 128, 128 x 85 or 128 x 120: about 2,000 images a minute on 2 cores.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.io

from squad.data.synthetic.dense import (
    PART_NAMES,
    PARTS_6,
    Piece,
    Shape,
    finish_render,
    jitter,
    normals_outward,
    person_materials,
    person_pieces,
    place,
    render_rect,
    save_image,
    soft_mask,
    split_ids,
    start_render,
    write_lines,
)
from squad.data.synthetic.jobs import default_workers, run_jobs
from squad.data.synthetic.render import Camera, Material, Opening, Room
from squad.io.files import atomic_write_bytes, removed_on_failure

logger = logging.getLogger(__name__)

DATASET = "pascal_context"
MANIFEST = "synthetic.json"
FORMAT_VERSION = 1
FOV_DEG = 55.0
JPEG_QUALITY = 90
VAL_SHARE = 5105 / (4998 + 5105)
PERSON_SHARE = 0.5  # images with at least one person
MIN_LABELLED_PIXELS = 6  # smaller object instances stay unlabelled (LabelMap 0, semseg 255)
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)  # fmt: skip
# PASCAL-Context label ids (labels.txt, 1-based) of the classes this generator draws
CONTEXT_LABELS = {
    "aeroplane": 2, "bicycle": 23, "bird": 25, "boat": 31, "bottle": 34, "bus": 45, "car": 59, "cat": 65, "chair": 72,
    "cow": 98, "diningtable": 397, "dog": 113, "horse": 207, "motorbike": 258, "person": 284, "pottedplant": 308,
    "sheep": 347, "sofa": 368, "train": 416, "tvmonitor": 427,
    "bed": 18, "box": 37, "building": 44, "cabinet": 46, "ceiling": 68, "fence": 144, "floor": 158, "grass": 187,
    "ground": 189, "pole": 303, "road": 324, "sand": 334, "shelves": 349, "sky": 360, "tree": 420, "wall": 440,
    "water": 445, "window": 454,
}  # fmt: skip
VOC_OF_CONTEXT = {CONTEXT_LABELS[c]: i for i, c in enumerate(VOC_CLASSES) if i}
ASPECTS = ((4, 3, 0.55), (3, 4, 0.2), (3, 2, 0.15), (16, 15, 0.1))  # (w, h, probability)


@dataclass(frozen=True)
class ObjectClass:
    """A class drawn from primitives: pieces at scale 1, (lo, hi) scale, footprint radius at scale 1 (metres),
    colours, where it appears ("in", "out" or "both") and a lift range (flying birds and planes)."""

    name: str
    pieces: tuple[Piece, ...]
    scale: tuple[float, float]
    footprint: float
    color: tuple[float, float, float]
    color2: tuple[float, float, float]
    where: str = "both"
    lift: tuple[float, float] = (0.0, 0.0)
    pattern: str = "plain"


def _legs(length: float, width: float, y: float, radius: float) -> tuple[Piece, ...]:
    return tuple(Piece("cyl", (sx * length, 0.0, sz * width), (radius, y)) for sx in (-1, 1) for sz in (-1, 1))


def _wheels(length: float, width: float, r: float) -> tuple[Piece, ...]:
    return tuple(Piece("sphere", (sx * length, r, sz * width), (r,), second=True) for sx in (-1, 1) for sz in (-1, 1))


CLASSES = (
    ObjectClass("aeroplane", (Piece("box", (0, 1.0, 0), (2.0, 0.3, 0.3)), Piece("box", (0.2, 1.0, 0), (0.5, 0.04, 2.5)),
                Piece("box", (-1.8, 1.45, 0), (0.25, 0.4, 0.04), True), Piece("box", (-1.8, 1.1, 0), (0.2, 0.03, 0.7)),
                Piece("cyl", (0.3, 0.0, 0.0), (0.06, 0.7), True)), (1.0, 1.6), 2.6, (0.92, 0.92, 0.95),
                (0.8, 0.1, 0.1), "out", (0.0, 6.0)),
    ObjectClass("bicycle", (Piece("sphere", (0.5, 0.32, 0), (0.3,), True),
                Piece("sphere", (-0.5, 0.32, 0), (0.3,), True),
                Piece("box", (0, 0.62, 0), (0.5, 0.03, 0.03)), Piece("box", (-0.3, 0.85, 0), (0.12, 0.03, 0.08)),
                Piece("cyl", (0.45, 0.6, 0), (0.02, 0.4))), (0.9, 1.1), 0.8, (0.1, 0.3, 0.8), (0.1, 0.1, 0.1)),
    ObjectClass("bird", (Piece("sphere", (0, 0.12, 0), (0.1,)), Piece("sphere", (0.11, 0.2, 0), (0.055,), True)),
                (0.6, 1.5), 0.2, (0.45, 0.35, 0.25), (0.9, 0.6, 0.1), "both", (0.0, 2.5)),
    ObjectClass("boat", (Piece("box", (0, 0.3, 0), (1.6, 0.3, 0.6)),
                Piece("box", (-0.3, 0.85, 0), (0.5, 0.25, 0.4), True),
                Piece("cyl", (0.4, 0.6, 0), (0.04, 2.4), True)), (0.8, 1.5), 1.8, (0.9, 0.9, 0.9), (0.6, 0.3, 0.15),
                "water"),
    ObjectClass("bottle", (Piece("cyl", (0, 0, 0), (0.04, 0.2)), Piece("cyl", (0, 0.2, 0), (0.016, 0.09), True)),
                (0.9, 1.4), 0.06, (0.1, 0.5, 0.2), (0.9, 0.85, 0.7), "both", (0.0, 0.8)),
    ObjectClass("bus", (Piece("box", (0, 1.75, 0), (5.0, 1.35, 1.25)),) + _wheels(3.2, 1.05, 0.5), (0.9, 1.1), 5.2,
                (0.95, 0.75, 0.1), (0.15, 0.15, 0.15), "out", pattern="bands"),
    ObjectClass("car", (Piece("box", (0, 0.65, 0), (2.1, 0.35, 0.9)), Piece("box", (-0.2, 1.25, 0), (1.1, 0.28, 0.8)))
                + _wheels(1.35, 0.8, 0.33), (0.9, 1.1), 2.3, (0.7, 0.1, 0.1), (0.1, 0.1, 0.1), "out"),
    ObjectClass("cat", (Piece("sphere", (0.1, 0.22, 0), (0.12,)), Piece("sphere", (-0.1, 0.22, 0), (0.12,)),
                Piece("sphere", (0.27, 0.33, 0), (0.08,), True)) + _legs(0.12, 0.06, 0.14, 0.022), (0.8, 1.2), 0.35,
                (0.9, 0.55, 0.2), (0.25, 0.2, 0.18)),
    ObjectClass("chair", (Piece("box", (0, 0.45, 0), (0.23, 0.03, 0.23)),
                Piece("box", (-0.21, 0.72, 0), (0.03, 0.27, 0.23)))
                + _legs(0.2, 0.2, 0.43, 0.02), (0.9, 1.1), 0.35, (0.5, 0.32, 0.18), (0.3, 0.2, 0.1), "in"),
    ObjectClass("cow", (Piece("box", (0, 1.0, 0), (0.8, 0.35, 0.3)),
                Piece("box", (0.95, 1.2, 0), (0.22, 0.17, 0.15), True))
                + _legs(0.6, 0.2, 0.66, 0.07), (0.9, 1.1), 1.1, (0.95, 0.95, 0.92), (0.15, 0.12, 0.1), "out",
                pattern="checker"),
    ObjectClass("diningtable", (Piece("box", (0, 0.74, 0), (0.7, 0.03, 0.43), True),) + _legs(0.6, 0.35, 0.72, 0.04),
                (0.9, 1.2), 0.85, (0.55, 0.35, 0.2), (0.7, 0.5, 0.3), "in"),
    ObjectClass("dog", (Piece("box", (0, 0.45, 0), (0.35, 0.15, 0.13)), Piece("sphere", (0.42, 0.62, 0), (0.13,), True))
                + _legs(0.27, 0.08, 0.32, 0.04), (0.7, 1.3), 0.5, (0.6, 0.42, 0.25), (0.35, 0.25, 0.15)),
    ObjectClass("horse", (Piece("box", (0, 1.3, 0), (0.9, 0.3, 0.25)), Piece("box", (0.95, 1.7, 0), (0.18, 0.35, 0.12)))
                + _legs(0.7, 0.15, 1.0, 0.06), (0.9, 1.1), 1.2, (0.45, 0.27, 0.12), (0.1, 0.07, 0.05), "out"),
    ObjectClass("motorbike", (Piece("box", (0, 0.62, 0), (0.6, 0.2, 0.15)),
                Piece("sphere", (0.7, 0.3, 0), (0.3,), True),
                Piece("sphere", (-0.7, 0.3, 0), (0.3,), True), Piece("box", (0.55, 0.95, 0), (0.04, 0.03, 0.35), True)),
                (0.9, 1.1), 1.0, (0.1, 0.1, 0.12), (0.2, 0.2, 0.2), "out"),
    ObjectClass("pottedplant", (Piece("cyl", (0, 0, 0), (0.15, 0.3)), Piece("sphere", (0, 0.58, 0), (0.3,), True)),
                (0.7, 1.5), 0.3, (0.7, 0.35, 0.2), (0.15, 0.55, 0.15)),
    ObjectClass("sheep", (Piece("sphere", (0, 0.7, 0), (0.4,)), Piece("sphere", (0.45, 0.85, 0), (0.15,), True))
                + _legs(0.2, 0.15, 0.4, 0.04), (0.8, 1.1), 0.6, (0.92, 0.9, 0.85), (0.12, 0.1, 0.1), "out"),
    ObjectClass("sofa", (Piece("box", (0, 0.22, 0), (0.45, 0.22, 1.0)),
                Piece("box", (-0.35, 0.65, 0), (0.1, 0.25, 1.0)),
                Piece("box", (0.05, 0.5, 0.92), (0.4, 0.12, 0.08), True),
                Piece("box", (0.05, 0.5, -0.92), (0.4, 0.12, 0.08), True)), (0.9, 1.1), 1.1, (0.25, 0.3, 0.55),
                (0.2, 0.24, 0.45), "in"),
    ObjectClass("train", (Piece("box", (0, 1.8, 0), (8.0, 1.6, 1.5)),
                Piece("box", (8.3, 1.4, 0), (0.3, 1.2, 1.4), True)),
                (0.9, 1.1), 8.5, (0.2, 0.35, 0.7), (0.85, 0.85, 0.2), "out", pattern="bands"),
    ObjectClass("tvmonitor", (Piece("box", (0, 1.0, 0), (0.03, 0.3, 0.5), True), Piece("cyl", (0, 0, 0), (0.05, 0.72))),
                (0.8, 1.3), 0.5, (0.2, 0.2, 0.2), (0.03, 0.03, 0.05), "in"),
)  # fmt: skip
# context-only classes (semseg background): name, pieces, scale, footprint, colours, where
EXTRAS = (
    ObjectClass("tree", (Piece("cyl", (0, 0, 0), (0.18, 2.5), True), Piece("sphere", (0, 3.3, 0), (1.3,))), (0.8, 1.4),
                1.3, (0.2, 0.5, 0.15), (0.35, 0.25, 0.15), "out"),
    ObjectClass("pole", (Piece("cyl", (0, 0, 0), (0.07, 4.0)),), (0.8, 1.2), 0.1, (0.5, 0.5, 0.5), (0.0, 0.0, 0.0),
                "out"),
    ObjectClass("fence", (Piece("box", (0, 0.5, 0), (3.0, 0.5, 0.04)),), (0.8, 1.5), 3.0, (0.75, 0.7, 0.6),
                (0.5, 0.45, 0.4), "out", pattern="stripes"),
    ObjectClass("box", (Piece("box", (0, 0.25, 0), (0.25, 0.25, 0.25)),), (0.6, 1.5), 0.4, (0.75, 0.6, 0.4),
                (0.6, 0.45, 0.3)),
    ObjectClass("cabinet", (Piece("box", (0, 0.9, 0), (0.3, 0.9, 0.5)),), (0.8, 1.1), 0.6, (0.6, 0.45, 0.3),
                (0.4, 0.3, 0.2), "in", pattern="bands"),
    ObjectClass("bed", (Piece("box", (0, 0.25, 0), (1.0, 0.25, 0.8)),
                Piece("box", (-0.95, 0.6, 0), (0.05, 0.6, 0.8), True)),
                (0.9, 1.1), 1.3, (0.9, 0.9, 0.95), (0.5, 0.35, 0.2), "in"),
    ObjectClass("shelves", (Piece("box", (0, 0.9, 0), (0.18, 0.9, 0.6)),), (0.8, 1.1), 0.65, (0.6, 0.5, 0.35),
                (0.3, 0.3, 0.3), "in", pattern="bands"),
)  # fmt: skip
_CLASS = {c.name: c for c in CLASSES + EXTRAS}
GROUNDS = (("grass", (0.25, 0.5, 0.2)), ("road", (0.35, 0.35, 0.37)), ("ground", (0.5, 0.42, 0.3)),
           ("sand", (0.85, 0.78, 0.55)), ("water", (0.15, 0.3, 0.5)))  # fmt: skip


@dataclass
class Instance:
    """An object instance in a scene: its class name, PASCAL-Context label, VOC index (0 for context-only) and
    where its pieces sit in the scene's shape list."""

    name: str
    context: int
    voc: int
    center: tuple[float, float, float]
    size: float


@dataclass
class PascalScene:
    room: Room
    shapes: list[Shape]
    parts: list[str | None]  # PASCAL-Part name of each shape (people), None otherwise
    instances: list[Instance]
    light: tuple[float, float, float]
    outdoor: bool
    floor_label: int
    wall_label: int
    open_label: int  # what rays through openings see: sky outdoors, window indoors
    light_power: float


def _material(rng: np.random.Generator, c: ObjectClass) -> tuple[Material, Material]:
    base = jitter(rng, c.color, 0.12)
    second = jitter(rng, c.color2, 0.08)
    pattern_mat = Material(base, second, c.pattern, float(rng.uniform(0.15, 0.4)), float(rng.uniform(0.0, 0.15)))
    return pattern_mat, Material(second, grain=float(rng.uniform(0.0, 0.1)))


def sample_scene(rng: np.random.Generator, with_people: bool) -> PascalScene:
    """An indoor room (55 %) or outdoor lot with 2-7 VOC objects, 0-3 context-only objects and, when
    ``with_people``, 1-3 articulated people."""
    outdoor = rng.random() < 0.45
    if outdoor:
        w, d, h = rng.uniform(30, 50), rng.uniform(30, 50), rng.uniform(10, 18)
        ground, gcolor = GROUNDS[int(rng.integers(len(GROUNDS)))]
        openings = [Opening(1, (0.0, 0.0), (w, d))]  # the ceiling is open sky
        for _ in range(int(rng.integers(0, 3))):  # gaps between buildings
            face = int(rng.integers(2, 6))
            span = d if face < 4 else w
            a = rng.uniform(0.0, span * 0.7)
            openings.append(Opening(face, (a, 0.0), (a + rng.uniform(3, span * 0.3), h)))
        room = Room((w, h, d), Material(jitter(rng, gcolor, 0.06), grain=0.15),
                    Material(jitter(rng, (0.7, 0.6, 0.5), 0.2), jitter(rng, (0.3, 0.35, 0.45), 0.1), "checker",
                             float(rng.uniform(1.5, 3.0))),
                    Material((0.9, 0.9, 0.9)), tuple(openings))  # fmt: skip
        area = (w / 2 - 9, w / 2 + 9, d / 2 - 9, d / 2 + 9)
        floor_label, wall_label, open_label = CONTEXT_LABELS[ground], CONTEXT_LABELS["building"], CONTEXT_LABELS["sky"]
        light = (float(rng.uniform(0.2, 0.8) * w), h - 0.5, float(rng.uniform(0.2, 0.8) * d))
        power = 4.0
    else:
        ground = "floor"
        w, d, h = rng.uniform(4, 9), rng.uniform(4, 9), rng.uniform(2.5, 3.2)
        openings = []
        for _ in range(int(rng.integers(0, 3))):  # windows
            face = int(rng.integers(2, 6))
            span = d if face < 4 else w
            ww = rng.uniform(0.8, min(2.0, span - 1.0))
            a = rng.uniform(0.4, span - ww - 0.4)
            openings.append(Opening(face, (a, 0.9), (a + ww, min(h - 0.3, 2.2))))
        room = Room((w, h, d), Material(jitter(rng, (0.55, 0.4, 0.25), 0.15), jitter(rng, (0.45, 0.32, 0.2), 0.1),
                                        "stripes", 0.2, 0.2),
                    Material(jitter(rng, (0.85, 0.82, 0.75), 0.15)), Material((0.93, 0.93, 0.9)), tuple(openings),
                    0.03)  # fmt: skip
        area = (0.0, w, 0.0, d)
        floor_label, wall_label, open_label = CONTEXT_LABELS["floor"], CONTEXT_LABELS["wall"], CONTEXT_LABELS["window"]
        light = (float(rng.uniform(0.3, 0.7) * w), h - 0.2, float(rng.uniform(0.3, 0.7) * d))
        power = 1.0

    def allowed(c: ObjectClass) -> bool:
        if c.where == "water":
            return ground == "water"
        if ground == "water":
            return c.name in ("bird", "aeroplane")
        return c.where == "both" or (c.where == "out") == outdoor

    voc_pool = [c for c in CLASSES if allowed(c)]
    extra_pool = [c for c in EXTRAS if allowed(c)]
    shapes: list[Shape] = []
    parts: list[str | None] = []
    instances: list[Instance] = []
    placed: list[tuple[float, float, float]] = []

    def spot(radius: float) -> tuple[float, float] | None:
        x0, x1, z0, z1 = area
        if min(x1 - x0, z1 - z0) < 2 * radius + 0.5:
            return None
        for _ in range(30):
            x, z = rng.uniform(x0 + radius + 0.2, x1 - radius - 0.2), rng.uniform(z0 + radius + 0.2, z1 - radius - 0.2)
            if all(math.hypot(x - px, z - pz) > radius + pr + 0.15 for px, pz, pr in placed):
                placed.append((x, z, radius))
                return float(x), float(z)
        return None

    def add(c: ObjectClass | None, pieces: tuple[Piece, ...] | list[Piece], scale: float, radius: float,
            mats: tuple[Material, Material], name: str, lift: float = 0.0) -> None:  # fmt: skip
        at = spot(radius * scale)
        if at is None:
            return
        k = len(instances)
        yaw = float(rng.uniform(0, 2 * math.pi))
        made = place(pieces, (at[0], lift, at[1]), yaw, scale, mats[0], mats[1], k)
        shapes.extend(s for s, _ in made)
        parts.extend(p for _, p in made)
        top = max(s.center[1] + s.bounding_radius() for s, _ in made)
        label = CONTEXT_LABELS[name]
        instances.append(Instance(name, label, VOC_OF_CONTEXT.get(label, 0), (at[0], (lift + top) / 2, at[1]),
                                  max(radius * scale * 2, top - lift)))  # fmt: skip

    if with_people and ground != "water":
        for _ in range(int(rng.integers(1, 4))):
            skin, clothes = person_materials(rng)
            add(None, person_pieces(rng), float(rng.uniform(1.1, 1.9)), 0.25, (skin, clothes), "person")
    if voc_pool:
        for _ in range(int(rng.integers(2, 8))):
            c = voc_pool[int(rng.integers(len(voc_pool)))]
            lift = float(rng.uniform(*c.lift)) if rng.random() < 0.5 else 0.0
            add(c, c.pieces, float(rng.uniform(*c.scale)), c.footprint, _material(rng, c), c.name, lift)
    for _ in range(int(rng.integers(0, 4)) if extra_pool else 0):
        c = extra_pool[int(rng.integers(len(extra_pool)))]
        add(c, c.pieces, float(rng.uniform(*c.scale)), c.footprint, _material(rng, c), c.name)
    return PascalScene(room, shapes, parts, instances, light, outdoor, floor_label, wall_label, open_label, power)


def sample_camera(rng: np.random.Generator, scene: PascalScene) -> tuple[Camera, int]:
    """A camera aimed at a main subject (a person when there is one, 70 % of the time; else a VOC object), at a
    distance that makes it fill a good part of the frame. Returns the camera and the subject's instance index."""
    people = [i for i, s in enumerate(scene.instances) if s.name == "person"]
    voc = [i for i, s in enumerate(scene.instances) if s.voc]
    pool = people if people and rng.random() < 0.7 else (voc or list(range(len(scene.instances))))
    w, h, d = scene.room.size
    if not pool:
        aim = np.array([w / 2, 1.0, d / 2])
        return Camera((w / 2 - 2.0, 1.5, d / 2 - 2.0), tuple(aim.tolist()), FOV_DEG), -1
    main = pool[int(rng.integers(len(pool)))]
    inst = scene.instances[main]
    aim = np.asarray(inst.center) + rng.uniform(-0.05, 0.05, 3) * inst.size
    cam = aim
    for _ in range(25):
        dist = inst.size * rng.uniform(1.2, 3.2) + 0.5
        ang = rng.uniform(0, 2 * math.pi)
        y = float(np.clip(aim[1] + rng.uniform(-0.5, 1.0), 0.5, min(2.2, h - 0.3)))
        horiz = math.sqrt(max(dist**2 - (y - aim[1]) ** 2, 0.25))
        cam = np.array([aim[0] + horiz * math.cos(ang), y, aim[2] + horiz * math.sin(ang)])
        inside = 0.3 <= cam[0] <= w - 0.3 and 0.3 <= cam[2] <= d - 0.3
        clear = all(np.linalg.norm(cam - np.asarray(s.center)) > s.bounding_radius() + 0.2 for s in scene.shapes)
        if inside and clear:
            break
    cam = np.clip(cam, [0.3, 0.3, 0.3], [w - 0.3, h - 0.3, d - 0.3])
    if np.linalg.norm(cam[[0, 2]] - aim[[0, 2]]) < 0.3:  # no straight-down views
        cam[0] += 0.5 if cam[0] < w / 2 else -0.5
    return Camera(tuple(float(v) for v in cam), tuple(float(v) for v in aim), FOV_DEG), main


def image_shape(rng: np.random.Generator, long_side: int) -> tuple[int, int]:
    """(width, height) of one image: long side ``long_side``, aspect drawn from ASPECTS."""
    probs = np.array([a[2] for a in ASPECTS])
    aw, ah, _ = ASPECTS[int(rng.choice(len(ASPECTS), p=probs / probs.sum()))]
    if aw >= ah:
        return long_side, max(2, round(long_side * ah / aw))
    return max(2, round(long_side * aw / ah)), long_side


def savemat_fixed(path: Path, data: dict) -> None:
    """``scipy.io.savemat`` (v5, compressed) with a fixed header text in place of its creation timestamp, so
    reruns are byte-identical."""
    buf = io.BytesIO()
    scipy.io.savemat(buf, data, do_compression=True, oned_as="row")
    raw = bytearray(buf.getvalue())
    raw[:116] = b"MATLAB 5.0 MAT-file, written by squad's synthetic data generator".ljust(116)
    atomic_write_bytes(path, bytes(raw), sync=False)  # whole or absent; the render syncs before its manifest


def parts_struct(imname: str, objects: list[tuple[str, int, np.ndarray, list[tuple[str, np.ndarray]]]]) -> np.ndarray:
    """PASCAL-Part's ``anno`` struct: (imname, objects[class, class_ind, mask, parts[part_name, mask]])."""
    obj = np.empty((1, len(objects)), dtype=[("class", "O"), ("class_ind", "O"), ("mask", "O"), ("parts", "O")])
    for j, (name, ind, mask, parts) in enumerate(objects):
        if parts:
            ps = np.empty((1, len(parts)), dtype=[("part_name", "O"), ("mask", "O")])
            for i, (pname, pmask) in enumerate(parts):
                ps[0, i] = (pname, pmask.astype(np.uint8))
        else:
            ps = np.zeros((0, 0))
        obj[0, j] = (name, np.array([[float(ind)]]), mask.astype(np.uint8), ps)
    anno = np.empty((1, 1), dtype=[("imname", "O"), ("objects", "O")])
    anno[0, 0] = (imname, obj)
    return anno


@dataclass(frozen=True)
class _Job:
    out: str
    seed: int
    long_side: int
    indices: tuple[int, ...]
    ids: tuple[str, ...]


_ROOM_NORMALS = np.array([[0, 1, 0], [0, -1, 0], [1, 0, 0], [-1, 0, 0], [0, 0, 1], [0, 0, -1]], np.float64)


def _opening_normals(room: Room, camera: Camera, width: int, height: int, where: np.ndarray) -> np.ndarray:
    """Normals (x right, y up, z toward the camera) of the room faces that the rays at pixels ``where`` leave
    through (windows are cut into walls): (N, 3)."""
    side = max(width, height)
    top, left = (side - height) // 2, (side - width) // 2
    rays = camera.rays(side).reshape(side, side, 3)[top : top + height, left : left + width][where]
    _, face = room.intersect(np.broadcast_to(np.asarray(camera.position, np.float64), rays.shape), rays)
    n = _ROOM_NORMALS[face]
    r, u, f = camera.basis()
    return np.stack([n @ r, n @ u, -(n @ f)], axis=1)


def render_image(seed: int, index: int, long_side: int) -> dict:
    """Render image ``index`` of the dataset with ``seed``: every file's array plus bookkeeping (see module doc)."""
    rng = np.random.default_rng([seed, index])
    width, height = image_shape(rng, long_side)
    with_people = rng.random() < PERSON_SHARE
    for _attempt in range(20):  # every PASCAL image shows at least one annotated VOC object: redraw until so
        scene = sample_scene(rng, with_people=with_people)
        camera, main = sample_camera(rng, scene)
        view, kept = render_rect(scene.room, scene.shapes, scene.light, camera, width, height,
                                 light_power=scene.light_power, noise_seed=int(rng.integers(1 << 30)))  # fmt: skip
        inst = view.category  # instance per pixel, -1 for room surfaces and sky
        counts = np.bincount(inst[inst >= 0].ravel(), minlength=len(scene.instances))
        labelled = counts >= MIN_LABELLED_PIXELS
        if any(s.voc and labelled[k] for k, s in enumerate(scene.instances)):
            break
    surf = view.surface
    label_map = np.zeros((height, width), np.uint16)
    label_map[surf == 0] = scene.floor_label
    label_map[surf == 1] = CONTEXT_LABELS["ceiling"]
    label_map[(surf >= 2) & (surf < 6)] = scene.wall_label
    label_map[surf < 0] = scene.open_label
    ctx = np.array([s.context for s in scene.instances] + [0], np.uint16)
    ok = np.append(labelled, False)
    obj = inst >= 0
    label_map[obj] = np.where(ok[inst[obj]], ctx[inst[obj]], 0)
    voc_lut = np.zeros(460, np.uint8)
    for c, v in VOC_OF_CONTEXT.items():
        voc_lut[c] = v
    semseg = voc_lut[label_map]
    semseg[label_map == 0] = 255

    # people and PASCAL-Part objects
    part_of_surface = np.array([None] * 6 + [scene.parts[k] for k in kept] + [None], dtype=object)
    objects = []
    for k, s in enumerate(scene.instances):
        if not s.voc or not labelled[k]:
            continue
        mask = inst == k
        parts = []
        if s.name == "person":
            names = part_of_surface[np.where(mask, surf, -1)]
            for pname in PART_NAMES:
                pm = mask & (names == pname)
                if pm.any():
                    parts.append((pname, pm))
        objects.append((s.name, s.voc, mask, parts))

    # saliency: the main subject and any other large VOC object, soft at the outlines
    sal_mask = np.zeros((height, width), np.float64)
    for k, s in enumerate(scene.instances):
        share = counts[k] / (width * height)
        if s.voc and labelled[k] and (k == main or share > 0.06):
            sal_mask = np.maximum(sal_mask, soft_mask(inst == k) * (1.0 if k == main else 0.9))
    sal = np.round(255 * sal_mask * rng.uniform(0.9, 1.0)).astype(np.uint8)

    normals = normals_outward(view.normal)
    normals[surf < 0] = (0.0, 0.0, 1.0)  # sky: facing the camera (not a class the reader keeps normals for)
    if not scene.outdoor and (surf < 0).any():  # a window: the normal of the wall it is cut into
        normals[surf < 0] = _opening_normals(scene.room, camera, width, height, surf < 0)
    normals8 = np.clip(np.round((normals + 1.0) * 127.5), 0, 255).astype(np.uint8)
    return {"rgb": np.round(view.rgb * 255).astype(np.uint8), "semseg": semseg, "label_map": label_map,
            "objects": objects, "sal": sal, "normals": normals8, "has_person": any(o[1] == 15 for o in objects),
            "categories": [int(o[1]) for o in objects]}  # fmt: skip


def _render_chunk(job: _Job) -> list[tuple[str, list[int], bool]]:
    out = Path(job.out)
    rows = []
    for index, image_id in zip(job.indices, job.ids, strict=True):
        r = render_image(job.seed, index, job.long_side)
        save_image(out / "JPEGImages" / f"{image_id}.jpg", r["rgb"], quality=JPEG_QUALITY)
        save_image(out / "semseg" / "pascal-context" / f"{image_id}.png", r["semseg"], "L", compress_level=1)
        save_image(out / "sal_distill" / f"{image_id}.png", r["sal"], "L", compress_level=1)
        save_image(out / "normals_distill" / f"{image_id}.png", r["normals"], compress_level=1)
        savemat_fixed(out / "pascal-context" / "trainval" / f"{image_id}.mat", {"LabelMap": r["label_map"]})
        savemat_fixed(out / "human_parts" / f"{image_id}.mat", {"anno": parts_struct(image_id, r["objects"])})
        rows.append((image_id, r["categories"], r["has_person"]))
    return rows


FOLDERS = ("JPEGImages", "semseg", "pascal-context", "human_parts", "sal_distill", "normals_distill", "ImageSets")


def image_ids(n: int) -> list[str]:
    """PASCAL-like ids, ``{2008 + i % 3}_{i:06d}``."""
    return [f"{2008 + i % 3}_{i:06d}" for i in range(n)]


def render_pascal(
    out: str | Path, n: int, image_size: int = 128, seed: int = 0, *, workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Render ``n`` synthetic PASCAL-Context images into ``out`` in the PASCAL_MT layout (module docstring).

    Args:
        out: output root (the PASCAL_MT folder); must be empty or absent, or a previous synthetic PASCAL render
            with ``overwrite=True``.
        n: number of images (>= 2: one per split).
        image_size: long side in pixels (>= 16); the other side follows each image's aspect.
        seed: non-negative seed; the same arguments give the same bytes whatever ``workers`` is.
        workers: processes (default: `jobs.default_workers`: 1, in this process, for a small render; else up to 2).
        overwrite: replace a previous synthetic PASCAL render in ``out``.

    Returns:
        The manifest's path, ``{out}/synthetic.json``.
    """
    out, chunks = start_render(out, n, image_size, seed, overwrite, MANIFEST, DATASET, (
        "JPEGImages", "semseg/pascal-context", "pascal-context/trainval", "human_parts", "sal_distill",
        "normals_distill", "ImageSets/Context", "ImageSets/Parts"))
    ids = image_ids(n)
    jobs = [_Job(str(out), seed, image_size, index, tuple(ids[part])) for index, part in chunks]
    workers = default_workers(n, image_size) if workers is None else workers
    with removed_on_failure([out / f for f in FOLDERS], f"the render in {out}"):  # a full disk leaves nothing
        rows = [row for part in run_jobs(_render_chunk, jobs, workers) for row in part]
        cats = {image_id: c for image_id, c, _ in rows}
        splits = split_ids(sorted(ids), VAL_SHARE, seed)
        for split, names in splits.items():
            write_lines(out / "ImageSets" / "Context" / f"{split}.txt", names)
            write_lines(out / "ImageSets" / "Parts" / f"{split}.txt",
                        ["{", ",\n".join(f'\t"{i}": {json.dumps(cats[i])}' for i in names), "}"])
        with_people = sum(1 for _, _, p in rows if p)
        path = finish_render(out, MANIFEST, _manifest(n, image_size, seed, splits, with_people))
    logger.info("rendered %d synthetic PASCAL-Context images (long side %d px, %d with people) into %s", n,
                image_size, with_people, out)  # fmt: skip
    return path


def _manifest(n: int, image_size: int, seed: int, splits: dict[str, list[str]], with_people: int) -> dict:
    return {
        "dataset": DATASET,
        "format_version": FORMAT_VERSION,
        "n": n,
        "image_size": image_size,
        "seed": seed,
        "fov_deg": FOV_DEG,
        "splits": {k: len(v) for k, v in splits.items()},
        "images_with_people": with_people,
        "folders": list(FOLDERS),
        "voc_classes": list(VOC_CLASSES),
        "context_labels": dict(sorted(CONTEXT_LABELS.items(), key=lambda kv: kv[1])),
        "human_parts_6": {name: PARTS_6[name] for name in PART_NAMES},
        "encodings": {
            "JPEGImages": f"RGB JPEG quality {JPEG_QUALITY}; long side {image_size}, aspect 4:3, 3:4, 3:2 or 16:15",
            "semseg/pascal-context": "uint8 grey PNG, 0 background, 1..20 VOC classes, 255 unlabelled",
            "pascal-context/trainval": "MAT v5 {LabelMap: uint16 HxW}, PASCAL-Context 459-class ids, 0 unlabelled",
            "human_parts": "MAT v5 PASCAL-Part anno struct (imname, objects[class, class_ind, mask, parts"
                           "[part_name, mask]])",
            "sal_distill": "uint8 grey PNG, soft saliency 0..255 (> 127.5 salient)",
            "normals_distill": "uint8 RGB PNG round((n+1)*127.5), x right, y up, z toward the camera; "
                               "(128,128,255) where no geometry",
            "ImageSets/Context": "image ids, one per line",
            "ImageSets/Parts": "JSON {id: [class_ind of each annotated object]} (ASTMT's cache)",
        },
    }  # fmt: skip
