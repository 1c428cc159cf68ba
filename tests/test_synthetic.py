"""The synthetic Taskonomy: determinism, layout, and physical consistency read back from the written files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from squad.data.synthetic import annotate
from squad.data.synthetic import taskonomy as syn
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
    render_view,
)

SIZE = 40


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read(root: Path, domain: str, building: str, point: int, view: int) -> np.ndarray:
    path = syn.image_path(root, domain, building, point, view)
    return np.load(path) if path.suffix == ".npy" else np.asarray(Image.open(path))


def _images(root: Path) -> list[tuple[str, int, int]]:
    """(building, point, view) of every image, from the rgb tree."""
    out = []
    for p in sorted((root / "rgb" / "taskonomy").glob("*/*.png")):
        parts = p.name.split("_")  # point_{p}_view_{v}_domain_rgb.png
        out.append((p.parent.name, int(parts[1]), int(parts[3])))
    return out


def _decode_normal(n8: np.ndarray) -> np.ndarray:
    return n8.astype(np.float64) / 255 * 2 - 1


def _angles_deg(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.degrees(np.arccos(np.clip((a * b).sum(-1), -1, 1)))


def _to_renderer(e: np.ndarray) -> np.ndarray:
    """A decoded normal file (x right, y down, z into the scene) in the frame of `_camera_rays` (x right, y up,
    z toward the viewer)."""
    return e * np.array([1.0, -1.0, -1.0])


def _camera_rays(size: int, fov_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """Camera-frame (x right, y up) image-plane coordinates at z = -1 for every pixel: (S, S) each."""
    f = size / 2 / np.tan(np.radians(fov_deg) / 2)
    c = (np.arange(size) + 0.5 - size / 2) / f
    xc, yc = np.meshgrid(c, -c)
    return xc, yc


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    syn.render_dataset(root, 12, SIZE, seed=3, buildings=3, workers=1)
    return root


@pytest.mark.slow
def test_same_seed_same_bytes_other_seed_differs(dataset: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    syn.render_dataset(again, 12, SIZE, seed=3, buildings=3, workers=2)  # another process layout, same bytes
    assert _files(again) == _files(dataset)
    other = tmp_path / "other"
    syn.render_dataset(other, 12, SIZE, seed=4, buildings=3, workers=1)
    a, b = _files(dataset), _files(other)
    assert a.keys() == b.keys()
    rgb = [k for k in a if "domain_rgb" in k]
    assert sum(a[k] != b[k] for k in rgb) == len(rgb)


def test_layout_csv_and_manifest(dataset: Path) -> None:
    images = _images(dataset)
    assert len(images) == 12
    assert {b for b, _, _ in images} == {"synth00", "synth01", "synth02"}
    for domain in syn.DOMAINS:
        files = list((dataset / domain / "taskonomy").glob(f"*/point_*_view_*_domain_{domain}.*"))
        assert len(files) == 12, domain
        for b, p, v in images:
            assert syn.image_path(dataset, domain, b, p, v).is_file()
    raw = (dataset / "train_val_test_synthetic.csv").read_bytes()
    assert b"\n" not in raw and raw.endswith(b"\r")
    rows = [r.split(",") for r in raw.decode().split("\r") if r]
    assert rows[0] == ["id", "train", "val", "test"]
    assert rows[1:] == [["synth00", "1", "0", "0"], ["synth01", "0", "1", "0"], ["synth02", "0", "0", "1"]]
    manifest = json.loads((dataset / "synthetic.json").read_text())
    assert manifest["n"] == 12 and manifest["image_size"] == SIZE and manifest["seed"] == 3
    assert manifest["buildings"] == {"train": ["synth00"], "val": ["synth01"], "test": ["synth02"]}
    assert manifest["domains"] == list(syn.DOMAINS)
    assert [c["imagenet_index"] for c in manifest["object_categories"]] == [c.imagenet for c in syn.OBJECTS]


def test_split_proportions() -> None:
    assert {k: len(v) for k, v in syn.split_buildings(8).items()} == {"train": 6, "val": 1, "test": 1}
    assert {k: len(v) for k, v in syn.split_buildings(16).items()} == {"train": 12, "val": 2, "test": 2}
    assert {k: len(v) for k, v in syn.split_buildings(3).items()} == {"train": 1, "val": 1, "test": 1}


def test_file_encodings(dataset: Path) -> None:
    b, p, v = _images(dataset)[0]
    modes = {}
    for domain in syn.DOMAINS:
        path = syn.image_path(dataset, domain, b, p, v)
        if path.suffix == ".png":
            modes[domain] = Image.open(path).mode
    assert modes["rgb"] == modes["normal"] == modes["principal_curvature"] == modes["reshading"] == "RGB"
    for d in ("depth_euclidean", "depth_zbuffer", "edge_texture", "edge_occlusion", "keypoints2d", "keypoints3d"):
        assert modes[d] == "I;16", d
    assert modes["segment_unsup2d"] == modes["segment_unsup25d"] == "L"
    for b, p, v in _images(dataset):
        for d in ("segment_unsup2d", "segment_unsup25d"):
            seg = _read(dataset, d, b, p, v)
            ids = np.unique(seg)
            assert seg.shape == (SIZE, SIZE) and ids[0] == 0 and ids[-1] == 255 and len(ids) >= 3  # rescaled ids
        assert _read(dataset, "rgb", b, p, v).shape == (SIZE, SIZE, 3)


def test_class_vectors_are_soft_distributions(dataset: Path) -> None:
    object_indices = {c.imagenet for c in syn.OBJECTS}
    scene_indices = {r.places for r in syn.ROOM_TYPES}
    for b, p, v in _images(dataset):
        obj, scene = _read(dataset, "class_object", b, p, v), _read(dataset, "class_scene", b, p, v)
        assert obj.shape == (1000,) and scene.shape == (365,)
        assert obj.dtype == scene.dtype == np.float32
        assert abs(obj.sum() - 1) < 1e-5 and abs(scene.sum() - 1) < 1e-5 and (obj > 0).all() and (scene > 0).all()
        assert int(np.argmax(obj)) in object_indices and int(np.argmax(scene)) in scene_indices
        for vec in (obj, scene):  # a classifier's softmax: a clear top class, the rest spread over many classes
            assert 0.15 < vec.max() < 0.8 and (vec > 1e-3).sum() >= 10


def test_class_argmax_follows_the_largest_visible_object() -> None:
    category = np.full((16, 16), -1)
    category[:, :10] = 7  # basketball on 10 columns, television (4) on 3
    category[:, 13:] = 4
    for seed in range(20):
        obj = syn.class_object_vector(category, room_type=0, rng=np.random.default_rng(seed))
        assert int(np.argmax(obj)) == syn.OBJECTS[7].imagenet
        assert obj[syn.OBJECTS[4].imagenet] > np.median(obj) * 10  # the smaller object keeps visible mass
        scene = syn.class_scene_vector(3, np.random.default_rng(seed))
        assert int(np.argmax(scene)) == syn.ROOM_TYPES[3].places


def test_depths_agree_and_masks_coincide(dataset: Path) -> None:
    xc, yc = _camera_rays(SIZE, syn.FOV_DEG)
    cos = 1 / np.sqrt(1 + xc**2 + yc**2)
    for b, p, v in _images(dataset):
        e = _read(dataset, "depth_euclidean", b, p, v).astype(np.int64)
        z = _read(dataset, "depth_zbuffer", b, p, v).astype(np.int64)
        invalid = e == 65535
        assert ((z == 65535) == invalid).all()
        assert (z[~invalid] <= e[~invalid]).all()
        assert np.abs(z - np.round(e * cos))[~invalid].max() <= 1  # z = distance * cos(angle to the axis)
        assert (e[~invalid] / 512).max() < 21  # inside a room of at most 8 m x 18 m x 3.4 m
        normal = _read(dataset, "normal", b, p, v)
        assert ((normal == 128).all(-1) == invalid).all()
        curvature = _read(dataset, "principal_curvature", b, p, v)
        assert (curvature[invalid] == 0).all() and (curvature[..., 2] == 0).all()  # fill (0, 0, 0), blue unused
        shade = _read(dataset, "reshading", b, p, v)[..., 0]
        assert ((shade[invalid] >= 8) & (shade[invalid] <= 13)).all()
        assert (_read(dataset, "keypoints3d", b, p, v)[invalid] == 0).all()
        assert (_read(dataset, "edge_occlusion", b, p, v)[invalid] == 0).all()


def test_normals_agree_with_depth_gradients_on_planes(dataset: Path) -> None:
    xc, yc = _camera_rays(SIZE, syn.FOV_DEG)
    errors = []
    for b, p, v in _images(dataset):
        z = _read(dataset, "depth_zbuffer", b, p, v).astype(np.float64) / 512
        n8 = _read(dataset, "normal", b, p, v).astype(np.int64)
        curv = _read(dataset, "principal_curvature", b, p, v)
        pts = np.stack([xc * z, yc * z, -z], -1)  # camera-frame points, (S, S, 3)
        du, dv = pts[1:-1, 2:] - pts[1:-1, :-2], pts[2:, 1:-1] - pts[:-2, 1:-1]
        n = np.cross(dv, du)
        n *= -np.sign((n * pts[1:-1, 1:-1]).sum(-1, keepdims=True))  # face the camera
        # interior of planar regions: 3 x 3 neighbourhood with one normal colour, zero curvature, valid depth
        same = np.ones((SIZE - 2, SIZE - 2), bool)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                same &= (n8[1 + dy : SIZE - 1 + dy, 1 + dx : SIZE - 1 + dx] == n8[1:-1, 1:-1]).all(-1)
        same &= (curv[1:-1, 1:-1, :2] > 0).all(-1) & (z[1:-1, 1:-1] < 100)
        stored = _to_renderer(_decode_normal(n8[1:-1, 1:-1]))
        errors.append(_angles_deg(n[same], stored[same]))
    err = np.concatenate(errors)
    assert len(err) > 1000
    assert np.median(err) < 2.0 and np.percentile(err, 90) < 6.0


def _single_object_scene(shape: Sphere | Cylinder | Box, window: Opening | None = None, bevel: float = 0.0) -> Scene:
    grey = Material((0.6, 0.6, 0.6))
    openings = () if window is None else (window,)
    return Scene(Room((6.0, 3.0, 6.0), grey, grey, grey, openings, bevel), (shape,), light=(3.0, 2.8, 4.0))


@pytest.mark.parametrize("radius", [0.25, 0.5])
def test_sphere_curvature_depth_and_normals_match_its_radius(tmp_path: Path, radius: float) -> None:
    center = np.array([3.0, 1.2, 2.5])
    scene = _single_object_scene(Sphere(tuple(center), radius, Material((0.8, 0.2, 0.2)), category=6))
    camera = Camera((3.0, 1.2, 4.5), tuple(center), syn.FOV_DEG)
    view = render_view(scene, camera, 48)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=0))
    on_sphere = view.surface == NUM_ROOM_FACES
    assert on_sphere.sum() > 50

    curv = _read(tmp_path, "principal_curvature", "b", 0, 0)
    assert syn.CURVATURE_SCALE == pytest.approx(3.81)  # Taskonomy: 127 * 0.03 codes per 1/m
    assert (curv[on_sphere][:, :2] == round(127 + 3.81 / radius)).all()  # k1 = k2 = 1 / r, convex > 0
    assert (curv[~on_sphere][:, :2] == 127).all() and (curv[..., 2] == 0).all()  # the room is planar

    # the euclidean depth puts every sphere pixel on the sphere, and the stored normal is the radial direction
    dist = _read(tmp_path, "depth_euclidean", "b", 0, 0).astype(np.float64) / 512
    xc, yc = _camera_rays(48, syn.FOV_DEG)
    rays = np.stack([xc, yc, -np.ones_like(xc)], -1)
    rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
    pts = rays * dist[..., None]  # camera frame
    c_cam = np.array([0.0, 0.0, -2.0])  # the camera looks at the centre from 2 m
    assert np.abs(np.linalg.norm(pts - c_cam, axis=-1)[on_sphere] - radius).max() < 0.01
    stored = _to_renderer(_decode_normal(_read(tmp_path, "normal", "b", 0, 0)))
    assert np.percentile(_angles_deg(stored[on_sphere], (pts - c_cam)[on_sphere]), 95) < 4.0

    edges = _read(tmp_path, "edge_occlusion", "b", 0, 0).astype(np.float64)
    below, above = np.pad(on_sphere, 1)[2:, 1:-1], np.pad(on_sphere, 1)[:-2, 1:-1]
    near = on_sphere & (~below | ~above)  # the sphere's pixels at its top and bottom silhouette
    far = ~on_sphere & (below | above)  # the wall's pixels across it
    assert (edges[near] > 0).all() and edges[near].mean() > 2 * edges[far].mean()  # the ridge is on the near side
    obj = _read(tmp_path, "class_object", "b", 0, 0)
    assert int(np.argmax(obj)) == syn.OBJECTS[6].imagenet and obj.max() < 0.8


def test_cylinder_curvature(tmp_path: Path) -> None:
    radius = 0.3
    scene = _single_object_scene(Cylinder((3.0, 0.0, 2.5), radius, 1.0, Material((0.2, 0.6, 0.2)), category=9))
    view = render_view(scene, Camera((3.0, 1.4, 4.5), (3.0, 0.6, 2.5), syn.FOV_DEG), 48)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=0))
    k = (_read(tmp_path, "principal_curvature", "b", 0, 0)[..., :2].astype(np.float64) - 127) / syn.CURVATURE_SCALE
    n_cam = view.normal
    side = (view.surface == NUM_ROOM_FACES) & (np.abs(n_cam[..., 1]) < 0.5)  # not the top cap (y down or up)
    top = (view.surface == NUM_ROOM_FACES) & (np.abs(n_cam[..., 1]) > 0.5)
    assert side.sum() > 50 and top.sum() > 10
    assert np.abs(k[side][:, 0] - 1 / radius).max() <= 0.5 / syn.CURVATURE_SCALE + 1e-9
    assert np.abs(k[side][:, 1]).max() == 0 and np.abs(k[top]).max() == 0


def test_window_has_no_geometry(tmp_path: Path) -> None:
    window = Opening(face=4, lo=(2.0, 1.0), hi=(4.0, 2.2))  # wall z = 0
    scene = _single_object_scene(Sphere((1.0, 0.5, 4.0), 0.3, Material((0.5, 0.5, 0.9))), window)
    view = render_view(scene, Camera((3.0, 1.6, 4.0), (3.0, 1.6, 0.0), syn.FOV_DEG), 32)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=2))
    depth = _read(tmp_path, "depth_euclidean", "b", 0, 0)
    hole = depth == 65535
    assert 50 < hole.sum() < 32 * 32 - 50
    assert (_read(tmp_path, "depth_zbuffer", "b", 0, 0)[hole] == 65535).all()
    assert (_read(tmp_path, "normal", "b", 0, 0)[hole] == 128).all()
    edges = _read(tmp_path, "edge_occlusion", "b", 0, 0)
    rim = ndimage.binary_dilation(hole, np.ones((3, 3), bool)) & ~hole
    assert (edges[hole] == 0).all() and (edges[rim] == 0).all()  # masked as Taskonomy's Sobel with a mask does
    obj = _read(tmp_path, "class_object", "b", 0, 0)  # no object in view: the kitchen's likeliest object leads
    kitchen = [syn.OBJECTS[syn._OBJECT_BY_NAME[n]].imagenet for n in syn.ROOM_TYPES[2].objects]
    assert abs(obj.sum() - 1) < 1e-5 and int(np.argmax(obj)) == kitchen[0]


def test_bad_arguments_and_overwrite(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n must be"):
        syn.render_dataset(tmp_path / "a", 2, 16, 0)
    with pytest.raises(ValueError, match="buildings"):
        syn.render_dataset(tmp_path / "a", 4, 16, 0, buildings=5)
    with pytest.raises(ValueError, match="buildings must be >= 3"):
        syn.render_dataset(tmp_path / "a", 4, 16, 0, buildings=2)
    root = tmp_path / "b"
    syn.render_dataset(root, 9, 16, 0, buildings=3, workers=1)
    with pytest.raises(FileExistsError, match="not empty"):
        syn.render_dataset(root, 3, 16, 0, buildings=3, workers=1)
    syn.render_dataset(root, 3, 16, 0, buildings=3, workers=1, overwrite=True)
    assert len(_images(root)) == 3  # the earlier, larger render is gone
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="no synthetic.json"):
        syn.render_dataset(tmp_path / "c", 3, 16, 0, overwrite=True)


def test_normal_file_frame_on_a_wall_and_a_floor(tmp_path: Path) -> None:
    """Taskonomy's frame: x right, y down, z into the scene: a wall facing the camera is blue ~0, a floor seen
    from 30 degrees above has green ~ 127.5 * (1 - cos 30) and blue ~ 127.5 * (1 - sin 30)."""
    grey = Material((0.6, 0.6, 0.6))
    scene = Scene(Room((6.0, 3.0, 6.0), grey, grey, grey), (), light=(3.0, 2.8, 3.0))
    wall = syn.encode_view(render_view(scene, Camera((3.0, 1.5, 4.0), (3.0, 1.5, 0.0)), 16), 0)["normal"]
    assert (np.abs(wall[8, 8].astype(int) - [128, 128, 0]) <= 1).all()
    tilt = np.radians(30)
    floor = syn.encode_view(render_view(scene, Camera((3.0, 1.5, 4.0), (3.0, 0.0, 4.0 - 1.5 / np.tan(tilt))), 16), 0)
    expected = np.round((np.array([0.0, -np.cos(tilt), -np.sin(tilt)]) + 1) * 127.5)
    assert (np.abs(floor["normal"][8, 8].astype(int) - expected) <= 1).all()
    decoded = floor["normal"][12:, :].reshape(-1, 3) / 127.5 - 1  # the lower image: all floor
    assert decoded[:, 1].mean() < -0.8 and decoded[:, 2].mean() < -0.3


def test_rounded_creases_are_convex_on_boxes_and_concave_in_room_corners() -> None:
    bevel = 0.05
    box = Box((3.0, 0.5, 3.0), (0.5, 0.5, 0.5), 0.0, Material((0.7, 0.7, 0.7)), category=0, bevel=bevel)
    scene = _single_object_scene(box, bevel=bevel)
    view = render_view(scene, Camera((4.6, 1.6, 4.6), (3.0, 0.5, 3.0)), 96)
    k1 = view.curvature[..., 0]
    on_box = view.surface == NUM_ROOM_FACES
    on_room = (view.surface >= 0) & (view.surface < NUM_ROOM_FACES)
    assert np.isclose(k1[on_box], 1 / bevel).sum() > 20  # rounded box edges bend away from the normal: convex > 0
    assert np.isclose(k1[on_room], -1 / bevel).sum() > 5  # the room's creases, seen from inside: concave < 0
    assert set(np.unique(np.round(k1[view.surface >= 0] * bevel, 6))) <= {-1.0, 0.0, 1.0}
    flat = on_box & (k1 == 0)
    assert flat.sum() > 50 and (np.abs(view.curvature[..., 1][flat]) == 0).all()
    # in the band the normal turns toward the neighbouring face: it is no longer one of the box's face normals
    band = on_box & (k1 > 0)
    assert (np.abs(view.normal[band]).max(-1) < 0.999).mean() > 0.9


def test_fills_vary_where_taskonomy_fills_vary(dataset: Path) -> None:
    fills = []
    for b, p, v in _images(dataset):
        invalid = _read(dataset, "depth_zbuffer", b, p, v) == 65535
        fills.append(_read(dataset, "reshading", b, p, v)[..., 0][invalid])
    fills = np.concatenate(fills)
    assert len(fills) > 20 and len(np.unique(fills)) > 1 and fills.min() >= 8 and fills.max() <= 13


def test_annotators_on_known_images() -> None:
    ramp = np.tile(np.arange(16.0) * 0.01, (16, 1))  # grey level rises 0.01 per pixel to the right
    assert annotate.sobel_magnitude(ramp)[4:-4, 4:-4] == pytest.approx(np.sqrt(2) * 0.01)
    assert (annotate.edge_texture(np.full((16, 16), 0.4)) == 0).all()
    flat = np.full((32, 32), 1536.0)  # a wall facing the camera at 3 m: constant z-buffer
    assert (annotate.edge_occlusion(flat) == 0).all()
    step = flat.copy()
    step[:, 16:] = 2048.0  # 3 m -> 4 m: the near side carries the ridge, scaled to the image size
    occ = annotate.edge_occlusion(step)
    ridge = np.sqrt(0.5) * (np.sqrt(2048 / 65536) - np.sqrt(1536 / 65536)) * np.sqrt(32 / 512)
    assert occ[8, 15] == pytest.approx(max(ridge, occ[8, 16])) and occ[8, 15] > occ[8, 16] > 0
    holes = flat.copy()
    holes[10:14, 10:14] = 65535
    assert (annotate.edge_occlusion(holes)[9:15, 9:15] == 0).all()  # masked like skimage's Sobel with a mask
    blob = np.zeros((64, 64))
    blob[28:36, 28:36] = 1.0
    kp = annotate.keypoints2d(blob)
    peak = np.unravel_index(np.argmax(kp), kp.shape)
    assert kp.min() == 0 and all(28 <= c < 36 for c in peak)  # on the blob (skimage's box layout is off-centre)
    assert kp[:8, :8].max() == 0  # nothing far from it
    ids = annotate.regions(np.array([[0, 0, 1], [2, 0, 1], [2, 2, 1]]), min_size=1)
    assert ids.tolist() == [[0, 0, 1], [2, 0, 1], [2, 2, 1]]
    assert annotate.to_byte_range(ids).tolist() == [[0, 0, 128], [255, 0, 128], [255, 255, 128]]
    merged = annotate.regions(np.array([[0, 0, 0], [0, 1, 0], [0, 0, 0]]), min_size=2)  # a 1-px region merges
    assert (merged == 0).all()


def test_segments_cover_the_real_range(dataset: Path) -> None:
    counts = [len(np.unique(_read(dataset, "segment_unsup25d", b, p, v))) for b, p, v in _images(dataset)]
    counts += [len(np.unique(_read(dataset, "segment_unsup2d", b, p, v))) for b, p, v in _images(dataset)]
    assert 10 <= np.median(counts) <= 65  # real files: 25-65 values per image (at 512 px; this is 40 px)


def test_a_small_render_stays_in_this_process():
    """`default_workers`: a render below `SMALL_RENDER` pixels takes no pool (spawned workers would spend longer
    importing than rendering), a larger one up to 2 processes; the bytes are the same either way (above)."""
    from squad.data.synthetic.jobs import SMALL_RENDER, default_workers

    assert default_workers(32, 32) == 1 and default_workers(63, 64) == 1
    assert SMALL_RENDER == 64 * 64 * 64
    assert default_workers(2000, 64) == min(2, os.cpu_count() or 1)
