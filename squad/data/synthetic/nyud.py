"""A synthetic NYUD-v2, written in the MTI-Net ``NYUD_MT`` layout and encodings that the real reader loads.

``render_nyud`` samples furnished rooms holding the NYU-40 classes (beds, chairs, sofas, tables, cabinets, shelves,
fridges, televisions, toilets, lamps, ...; doors, windows, pictures, blinds, curtains, mirrors and whiteboards on the
walls; articulated people in some rooms, ``synthetic_dense``), ray-casts a Kinect-like view of each
(``squad.data.synthetic.render``) and writes, per image id::

    {out}/images/{id}.jpg           RGB JPEG (quality 90), W x H (4:3)
    {out}/segmentation/{id}.png     uint8 grey: 1..40 NYU-40 classes (NYU40_CLASSES order), 0 = unlabelled (rays
                                    through an open doorway); the reader maps 0 to 255 and shifts 1..40 to 0..39
    {out}/depth/{id}.npy            float32 H x W, z-depth in metres; 0 where invalid (no geometry)
    {out}/normals/{id}.npy          float32 H x W x 3, unit normals, x right, y up, z toward the camera; (0, 0, 0)
                                    where invalid
    {out}/edge/{id}.npy             float32 H x W in {0, 1}: one-pixel boundaries of the class-and-instance label
                                    map (``synthetic_dense.label_boundaries``)
    {out}/gt_sets/{train,val}.txt   image ids, one per line (the real proportions: 795 / 654)
    {out}/synthetic.json            manifest: dataset, n, sizes, seed, splits, classes, encodings, folders

Sizes. The real images are 640 x 480; here the width is ``image_size`` (default 128, a fifth) and the height 3/4 of
it (96): about 2,000 images a minute on 2 cores.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from squad.data.synthetic.dense import (
    Piece,
    Shape,
    finish_render,
    jitter,
    label_boundaries,
    normals_outward,
    person_materials,
    person_pieces,
    place,
    render_rect,
    save_image,
    save_npy,
    split_ids,
    start_render,
    write_lines,
)
from squad.data.synthetic.jobs import default_workers, run_jobs
from squad.data.synthetic.pascal import CLASSES as PASCAL_CLASSES
from squad.data.synthetic.render import Box, Camera, Material, Opening, Room
from squad.io.files import removed_on_failure

logger = logging.getLogger(__name__)

DATASET = "nyud"
MANIFEST = "synthetic.json"
FORMAT_VERSION = 1
FOV_DEG = 58.0  # the Kinect's horizontal field of view, about
JPEG_QUALITY = 90
VAL_SHARE = 654 / (795 + 654)
PERSON_SHARE = 0.25
NYU40_CLASSES = (
    "wall", "floor", "cabinet", "bed", "chair", "sofa", "table", "door", "window", "bookshelf", "picture", "counter",
    "blinds", "desk", "shelves", "curtain", "dresser", "pillow", "mirror", "floor mat", "clothes", "ceiling", "books",
    "refridgerator", "television", "paper", "towel", "shower curtain", "box", "whiteboard", "person", "night stand",
    "toilet", "sink", "lamp", "bathtub", "bag", "otherstructure", "otherfurniture", "otherprop",
)  # fmt: skip
CLASS_ID = {name: i + 1 for i, name in enumerate(NYU40_CLASSES)}
_P = {c.name: c.pieces for c in PASCAL_CLASSES}


def _box(h: tuple[float, float, float], y: float | None = None) -> tuple[Piece, ...]:
    return (Piece("box", (0.0, h[1] if y is None else y, 0.0), h),)


@dataclass(frozen=True)
class NyuObject:
    """A floor-standing NYU-40 object: pieces at scale 1, a scale range, footprint radius, colours, lift range."""

    name: str
    pieces: tuple[Piece, ...]
    footprint: float
    color: tuple[float, float, float]
    color2: tuple[float, float, float] = (0.2, 0.2, 0.2)
    lift: tuple[float, float] = (0.0, 0.0)
    pattern: str = "plain"
    scale: tuple[float, float] = (0.85, 1.15)


FLOOR_OBJECTS = (
    NyuObject("cabinet", _box((0.3, 0.45, 0.25)), 0.4, (0.6, 0.45, 0.3), (0.4, 0.3, 0.2), pattern="bands"),
    NyuObject("bed", (Piece("box", (0, 0.25, 0), (1.0, 0.25, 0.8)),
              Piece("box", (-0.95, 0.6, 0), (0.05, 0.6, 0.8), True)),
              1.3, (0.9, 0.9, 0.95), (0.5, 0.35, 0.2)),
    NyuObject("chair", _P["chair"], 0.35, (0.5, 0.32, 0.18), (0.3, 0.2, 0.1)),
    NyuObject("sofa", _P["sofa"], 1.1, (0.3, 0.35, 0.55), (0.25, 0.28, 0.5)),
    NyuObject("table", _P["diningtable"], 0.85, (0.55, 0.35, 0.2), (0.7, 0.5, 0.3)),
    NyuObject("bookshelf", _box((0.18, 0.9, 0.45)), 0.5, (0.5, 0.33, 0.2), (0.85, 0.8, 0.7), pattern="bands"),
    NyuObject("counter", _box((0.3, 0.45, 0.9)), 0.95, (0.8, 0.8, 0.78), (0.4, 0.3, 0.2)),
    NyuObject("desk", (Piece("box", (0, 0.74, 0), (0.35, 0.03, 0.65)), Piece("box", (0, 0.37, 0.5), (0.3, 0.37, 0.12))),
              0.75, (0.6, 0.45, 0.3), (0.4, 0.3, 0.2)),
    NyuObject("shelves", _box((0.15, 0.8, 0.5)), 0.55, (0.6, 0.6, 0.62), (0.3, 0.3, 0.3), pattern="bands"),
    NyuObject("dresser", _box((0.25, 0.42, 0.5)), 0.6, (0.45, 0.3, 0.2), (0.3, 0.2, 0.1), pattern="bands"),
    NyuObject("pillow", _box((0.2, 0.08, 0.3)), 0.35, (0.9, 0.85, 0.8), lift=(0.0, 0.5)),
    NyuObject("clothes", (Piece("sphere", (0, 0.18, 0), (0.18,)),), 0.2, (0.3, 0.3, 0.6), lift=(0.0, 0.4)),
    NyuObject("books", _box((0.1, 0.12, 0.15)), 0.2, (0.7, 0.2, 0.2), (0.2, 0.3, 0.6), (0.0, 0.75), "stripes"),
    NyuObject("refridgerator", _box((0.35, 0.9, 0.35)), 0.5, (0.93, 0.93, 0.92)),
    NyuObject("television", _P["tvmonitor"], 0.5, (0.2, 0.2, 0.2), (0.03, 0.03, 0.05)),
    NyuObject("paper", _box((0.15, 0.005, 0.11)), 0.2, (0.97, 0.97, 0.95), lift=(0.0, 0.75)),
    NyuObject("towel", _box((0.03, 0.3, 0.2)), 0.25, (0.9, 0.5, 0.5), lift=(0.3, 0.8)),
    NyuObject("box", _box((0.25, 0.25, 0.25)), 0.4, (0.75, 0.6, 0.4)),
    NyuObject("night stand", _box((0.22, 0.28, 0.22)), 0.35, (0.5, 0.35, 0.22)),
    NyuObject("toilet", (Piece("cyl", (0.1, 0, 0), (0.2, 0.4)), Piece("box", (-0.15, 0.6, 0), (0.1, 0.2, 0.2))), 0.35,
              (0.95, 0.95, 0.95)),
    NyuObject("sink", _box((0.25, 0.1, 0.3)), 0.4, (0.9, 0.9, 0.92), lift=(0.7, 0.8)),
    NyuObject("lamp", (Piece("cyl", (0, 0, 0), (0.02, 1.3), True), Piece("cyl", (0, 1.3, 0), (0.18, 0.25))), 0.25,
              (0.98, 0.9, 0.6), (0.2, 0.2, 0.2)),
    NyuObject("bathtub", _box((0.8, 0.28, 0.38)), 0.9, (0.95, 0.95, 0.97)),
    NyuObject("bag", _box((0.18, 0.2, 0.08)), 0.25, (0.3, 0.2, 0.1)),
    NyuObject("otherstructure", _box((0.2, 1.6, 0.2)), 0.3, (0.85, 0.85, 0.8), scale=(1.0, 1.0)),
    NyuObject("otherfurniture", _box((0.3, 0.3, 0.4)), 0.5, (0.5, 0.4, 0.3), (0.3, 0.2, 0.2), pattern="checker"),
    NyuObject("otherprop", (Piece("cyl", (0, 0, 0), (0.08, 0.25)),), 0.1, (0.2, 0.5, 0.7), lift=(0.0, 0.75)),
    NyuObject("floor mat", _box((0.6, 0.006, 0.4)), 0.7, (0.6, 0.2, 0.2), (0.8, 0.7, 0.3), pattern="stripes"),
)  # fmt: skip
# wall-mounted: name, (half width, half height) ranges, centre height range, colour
WALL_OBJECTS = (
    ("door", (0.4, 0.5), (0.95, 1.05), (1.0, 1.05), (0.6, 0.45, 0.3)),
    ("window", (0.4, 0.9), (0.4, 0.7), (1.3, 1.6), (0.75, 0.85, 0.95)),
    ("picture", (0.15, 0.5), (0.15, 0.35), (1.4, 1.7), (0.7, 0.3, 0.2)),
    ("blinds", (0.4, 0.8), (0.5, 0.7), (1.4, 1.6), (0.9, 0.88, 0.8)),
    ("curtain", (0.3, 0.6), (0.8, 1.0), (1.2, 1.4), (0.6, 0.2, 0.3)),
    ("mirror", (0.2, 0.4), (0.3, 0.6), (1.3, 1.5), (0.8, 0.82, 0.85)),
    ("whiteboard", (0.6, 1.0), (0.4, 0.6), (1.4, 1.6), (0.97, 0.97, 0.97)),
    ("shower curtain", (0.4, 0.6), (0.8, 0.9), (1.1, 1.2), (0.8, 0.9, 0.95)),
)


@dataclass
class NyuScene:
    room: Room
    shapes: list[Shape]
    classes: list[int]  # NYU-40 id per instance
    light: tuple[float, float, float]
    aims: list[tuple[float, float, float]]


def sample_scene(rng: np.random.Generator) -> NyuScene:
    """A room 3-7 m a side, 2.4-3 m high, with 5-14 floor objects, 1-5 wall objects, people in some rooms and an
    open doorway in 30 % of them."""
    w, d, h = rng.uniform(3, 7), rng.uniform(3, 7), rng.uniform(2.4, 3.0)
    openings = []
    if rng.random() < 0.3:
        face = int(rng.integers(2, 6))
        span = d if face < 4 else w
        a = rng.uniform(0.3, span - 1.2)
        openings.append(Opening(face, (a, 0.0), (a + rng.uniform(0.7, 0.9), 2.05)))
    room = Room((w, h, d), Material(jitter(rng, (0.5, 0.4, 0.3), 0.15), jitter(rng, (0.4, 0.3, 0.2), 0.1), "stripes",
                                    0.15, 0.15),
                Material(jitter(rng, (0.85, 0.83, 0.78), 0.12)), Material((0.93, 0.93, 0.91)), tuple(openings), 0.03)
    shapes: list[Shape] = []
    classes: list[int] = []
    aims: list[tuple[float, float, float]] = []
    placed: list[tuple[float, float, float]] = []
    for _ in range(int(rng.integers(1, 6))):  # wall objects
        name, hw_r, hh_r, y_r, color = WALL_OBJECTS[int(rng.integers(len(WALL_OBJECTS)))]
        face = int(rng.integers(2, 6))
        span = d if face < 4 else w
        hw, hh = rng.uniform(*hw_r), rng.uniform(*hh_r)
        if span < 2 * hw + 0.4:
            continue
        u, y = rng.uniform(hw + 0.2, span - hw - 0.2), min(rng.uniform(*y_r), h - hh - 0.05)
        t = 0.02
        pos = {2: (t, y, u), 3: (w - t, y, u), 4: (u, y, t), 5: (u, y, d - t)}[face]
        half = (t, hh, hw) if face < 4 else (hw, hh, t)
        shapes.append(Box(tuple(float(v) for v in pos), tuple(float(v) for v in half), 0.0,
                          Material(jitter(rng, color, 0.08)), len(classes)))  # fmt: skip
        classes.append(CLASS_ID[name])
        aims.append(pos)

    def spot(radius: float) -> tuple[float, float] | None:
        if min(w, d) < 2 * radius + 0.5:
            return None
        for _ in range(30):
            x, z = rng.uniform(radius + 0.15, w - radius - 0.15), rng.uniform(radius + 0.15, d - radius - 0.15)
            if all(math.hypot(x - px, z - pz) > radius + pr + 0.1 for px, pz, pr in placed):
                placed.append((x, z, radius))
                return float(x), float(z)
        return None

    def add(pieces: tuple[Piece, ...] | list[Piece], scale: float, radius: float, mats: tuple[Material, Material],
            cls: int, lift: float = 0.0) -> None:  # fmt: skip
        at = spot(radius * scale)
        if at is None:
            return
        made = place(pieces, (at[0], lift, at[1]), float(rng.uniform(0, 2 * math.pi)), scale, *mats, len(classes))
        shapes.extend(s for s, _ in made)
        classes.append(cls)
        top = max(s.center[1] + s.bounding_radius() for s, _ in made)
        aims.append((at[0], (lift + min(top, h)) / 2, at[1]))

    if rng.random() < PERSON_SHARE:
        for _ in range(int(rng.integers(1, 3))):
            add(person_pieces(rng), float(rng.uniform(1.2, 1.9)), 0.25, person_materials(rng), CLASS_ID["person"])
    for _ in range(int(rng.integers(5, 15))):
        c = FLOOR_OBJECTS[int(rng.integers(len(FLOOR_OBJECTS)))]
        mats = (Material(jitter(rng, c.color, 0.1), jitter(rng, c.color2, 0.08), c.pattern, 0.2,
                         float(rng.uniform(0.0, 0.15))), Material(jitter(rng, c.color2, 0.08)))  # fmt: skip
        add(c.pieces, float(rng.uniform(*c.scale)), c.footprint, mats, CLASS_ID[c.name], float(rng.uniform(*c.lift)))
    light = (float(rng.uniform(0.3, 0.7) * w), h - 0.2, float(rng.uniform(0.3, 0.7) * d))
    return NyuScene(room, shapes, classes, light, aims)


def sample_camera(rng: np.random.Generator, scene: NyuScene) -> Camera:
    """A hand-held Kinect: 1.0-1.7 m high, in the room, looking at an object (or across the room), slightly down."""
    w, h, d = scene.room.size
    if scene.aims and rng.random() < 0.85:
        aim = np.asarray(scene.aims[int(rng.integers(len(scene.aims)))], np.float64)
    else:
        aim = np.array([rng.uniform(0.2, 0.8) * w, rng.uniform(0.5, 1.2), rng.uniform(0.2, 0.8) * d])
    cam = np.array([w / 2, 1.4, d / 2])
    for _ in range(25):
        cam = np.array([rng.uniform(0.3, w - 0.3), rng.uniform(1.0, min(1.7, h - 0.3)), rng.uniform(0.3, d - 0.3)])
        far = np.linalg.norm(cam[[0, 2]] - aim[[0, 2]])
        clear = all(np.linalg.norm(cam - np.asarray(s.center)) > s.bounding_radius() + 0.15 for s in scene.shapes)
        if far > 1.2 and clear:
            break
    if np.linalg.norm(cam[[0, 2]] - aim[[0, 2]]) < 0.3:
        cam[0] += 0.5 if cam[0] < w / 2 else -0.5
    return Camera(tuple(float(v) for v in cam), tuple(float(v) for v in aim), FOV_DEG)


def render_image(seed: int, index: int, width: int) -> dict[str, np.ndarray]:
    """Render image ``index`` of the dataset with ``seed``: the arrays of its five files (module docstring)."""
    rng = np.random.default_rng([seed, index])
    height = max(2, round(width * 3 / 4))
    scene = sample_scene(rng)
    camera = sample_camera(rng, scene)
    view, _ = render_rect(scene.room, scene.shapes, scene.light, camera, width, height,
                          noise_seed=int(rng.integers(1 << 30)))  # fmt: skip
    surf, inst = view.surface, view.category
    valid = surf >= 0
    seg = np.zeros((height, width), np.uint8)
    seg[surf == 0] = CLASS_ID["floor"]
    seg[surf == 1] = CLASS_ID["ceiling"]
    seg[(surf >= 2) & (surf < 6)] = CLASS_ID["wall"]
    lut = np.array(scene.classes + [0], np.uint8)
    obj = inst >= 0
    seg[obj] = lut[inst[obj]]
    regions = np.where(obj, 1000 + inst, seg.astype(np.int64))  # class for room surfaces, instance for objects
    depth = np.where(valid, view.zdepth, 0.0).astype(np.float32)
    normals = np.where(valid[..., None], normals_outward(view.normal), 0.0).astype(np.float32)
    return {"rgb": np.round(view.rgb * 255).astype(np.uint8), "segmentation": seg, "depth": depth,
            "normals": normals, "edge": label_boundaries(regions).astype(np.float32)}  # fmt: skip


@dataclass(frozen=True)
class _Job:
    out: str
    seed: int
    width: int
    indices: tuple[int, ...]
    ids: tuple[str, ...]


def _render_chunk(job: _Job) -> int:
    out = Path(job.out)
    for index, image_id in zip(job.indices, job.ids, strict=True):
        r = render_image(job.seed, index, job.width)
        save_image(out / "images" / f"{image_id}.jpg", r["rgb"], quality=JPEG_QUALITY)
        save_image(out / "segmentation" / f"{image_id}.png", r["segmentation"], "L", compress_level=1)
        for name in ("depth", "normals", "edge"):
            save_npy(out / name / f"{image_id}.npy", r[name])
    return len(job.indices)


FOLDERS = ("images", "segmentation", "depth", "normals", "edge", "gt_sets")


def image_ids(n: int) -> list[str]:
    """Zero-padded ids, ``0000`` onward (wider past 10,000 images)."""
    width = max(4, len(str(n - 1)))
    return [f"{i:0{width}d}" for i in range(n)]


def render_nyud(
    out: str | Path, n: int, image_size: int = 128, seed: int = 0, *, workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Render ``n`` synthetic NYUD-v2 images into ``out`` in the MTI-Net layout (module docstring).

    Args:
        out: output root (the NYUD_MT folder); must be empty or absent, or a previous synthetic NYUD render with
            ``overwrite=True``.
        n: number of images (>= 2: one per split).
        image_size: image width in pixels (>= 16); the height is 3/4 of it.
        seed: non-negative seed; the same arguments give the same bytes whatever ``workers`` is.
        workers: processes (default: `jobs.default_workers`: 1, in this process, for a small render; else up to 2).
        overwrite: replace a previous synthetic NYUD render in ``out``.

    Returns:
        The manifest's path, ``{out}/synthetic.json``.
    """
    out, chunks = start_render(out, n, image_size, seed, overwrite, MANIFEST, DATASET, FOLDERS)
    ids = image_ids(n)
    jobs = [_Job(str(out), seed, image_size, index, tuple(ids[part])) for index, part in chunks]
    workers = default_workers(n, image_size) if workers is None else workers
    with removed_on_failure([out / f for f in FOLDERS], f"the render in {out}"):  # a full disk leaves nothing
        done = sum(run_jobs(_render_chunk, jobs, workers))
        assert done == n, f"rendered {done} images, planned {n}"
        splits = split_ids(ids, VAL_SHARE, seed)
        for split, names in splits.items():
            write_lines(out / "gt_sets" / f"{split}.txt", names)
        path = finish_render(out, MANIFEST, _manifest(n, image_size, seed, splits))
    logger.info("rendered %d synthetic NYUD-v2 images (%d px wide) into %s", n, image_size, out)
    return path


def _manifest(n: int, image_size: int, seed: int, splits: dict[str, list[str]]) -> dict:
    manifest = {
        "dataset": DATASET,
        "format_version": FORMAT_VERSION,
        "n": n,
        "image_size": [image_size, max(2, round(image_size * 3 / 4))],
        "seed": seed,
        "fov_deg": FOV_DEG,
        "splits": {k: len(v) for k, v in splits.items()},
        "folders": list(FOLDERS),
        "classes": list(NYU40_CLASSES),
        "encodings": {
            "images": f"RGB JPEG quality {JPEG_QUALITY}, width x height = image_size x 3/4 image_size",
            "segmentation": "uint8 grey PNG, 1..40 NYU-40 classes, 0 unlabelled",
            "depth": "float32 npy HxW, z-depth in metres, 0 invalid",
            "normals": "float32 npy HxWx3, unit normals x right, y up, z toward the camera, 0 invalid",
            "edge": "float32 npy HxW in {0,1}, one-pixel class/instance boundaries",
            "gt_sets": "image ids, one per line",
        },
    }
    return manifest
