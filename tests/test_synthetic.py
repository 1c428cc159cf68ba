"""The synthetic Taskonomy: determinism, layout, and physical consistency read back from the written files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from squad.data import synthetic as syn
from squad.data.render import NUM_ROOM_FACES, Camera, Cylinder, Material, Room, Scene, Sphere, Window, render_view

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
            assert seg.shape == (SIZE, SIZE) and seg.max() < 64 and len(np.unique(seg)) > 1
        assert _read(dataset, "rgb", b, p, v).shape == (SIZE, SIZE, 3)


def test_class_vectors_are_distributions(dataset: Path) -> None:
    object_indices = {c.imagenet for c in syn.OBJECTS}
    scene_indices = {r.places for r in syn.ROOM_TYPES}
    for b, p, v in _images(dataset):
        obj, scene = _read(dataset, "class_object", b, p, v), _read(dataset, "class_scene", b, p, v)
        assert obj.shape == (1000,) and scene.shape == (365,)
        assert obj.dtype == scene.dtype == np.float32
        assert abs(obj.sum() - 1) < 1e-5 and abs(scene.sum() - 1) < 1e-5
        assert (obj >= 0).all() and set(np.flatnonzero(obj)) <= object_indices
        assert int(np.argmax(scene)) in scene_indices and scene.max() == pytest.approx(0.9)


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
        assert (e[~invalid] / 512).max() < 12  # inside a room of at most 6.5 m x 6.5 m x 3.2 m
        normal = _read(dataset, "normal", b, p, v)
        assert ((normal == 128).all(-1) == invalid).all()
        assert (_read(dataset, "principal_curvature", b, p, v)[invalid][:, :2] == 127).all()
        assert (_read(dataset, "reshading", b, p, v)[invalid] == 0).all()


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
        same &= (curv[1:-1, 1:-1, :2] == 127).all(-1) & (z[1:-1, 1:-1] < 100)
        stored = _decode_normal(n8[1:-1, 1:-1]) * np.array([-1.0, 1.0, 1.0])  # file stores (-x, y, z)
        errors.append(_angles_deg(n[same], stored[same]))
    err = np.concatenate(errors)
    assert len(err) > 1000
    assert np.median(err) < 2.0 and np.percentile(err, 90) < 6.0


def _single_object_scene(shape: Sphere | Cylinder, window: Window | None = None) -> Scene:
    grey = Material((0.6, 0.6, 0.6))
    return Scene(Room((6.0, 3.0, 6.0), grey, grey, grey, window), (shape,), light=(3.0, 2.8, 4.0))


@pytest.mark.parametrize("radius", [0.25, 0.5])
def test_sphere_curvature_depth_and_normals_match_its_radius(tmp_path: Path, radius: float) -> None:
    center = np.array([3.0, 1.2, 2.5])
    scene = _single_object_scene(Sphere(tuple(center), radius, Material((0.8, 0.2, 0.2)), category=6))
    camera = Camera((3.0, 1.2, 4.5), tuple(center), syn.FOV_DEG)
    view = render_view(scene, camera, 48)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=0))
    on_sphere = view.surface == NUM_ROOM_FACES
    assert on_sphere.sum() > 50

    curv = _read(tmp_path, "principal_curvature", "b", 0, 0).astype(np.float64)
    k = (curv[..., :2] - 127) / syn.CURVATURE_SCALE
    assert np.abs(k[on_sphere] - 1 / radius).max() <= 0.5 / syn.CURVATURE_SCALE + 1e-9
    assert (curv[~on_sphere][:, :2] == 127).all()  # the room is planar

    # the euclidean depth puts every sphere pixel on the sphere, and the stored normal is the radial direction
    dist = _read(tmp_path, "depth_euclidean", "b", 0, 0).astype(np.float64) / 512
    xc, yc = _camera_rays(48, syn.FOV_DEG)
    rays = np.stack([xc, yc, -np.ones_like(xc)], -1)
    rays /= np.linalg.norm(rays, axis=-1, keepdims=True)
    pts = rays * dist[..., None]  # camera frame
    c_cam = np.array([0.0, 0.0, -2.0])  # the camera looks at the centre from 2 m
    assert np.abs(np.linalg.norm(pts - c_cam, axis=-1)[on_sphere] - radius).max() < 0.01
    stored = _decode_normal(_read(tmp_path, "normal", "b", 0, 0)) * np.array([-1.0, 1.0, 1.0])
    assert np.percentile(_angles_deg(stored[on_sphere], (pts - c_cam)[on_sphere]), 95) < 4.0

    edges = _read(tmp_path, "edge_occlusion", "b", 0, 0)
    silhouette = on_sphere & ~np.pad(on_sphere, 1)[2:, 1:-1] | on_sphere & ~np.pad(on_sphere, 1)[:-2, 1:-1]
    assert (edges[silhouette] > 0).mean() > 0.8  # the near side of the silhouette
    assert (edges[~on_sphere] == 0).all()  # the wall behind carries no occlusion edge
    assert _read(tmp_path, "class_object", "b", 0, 0)[syn.OBJECTS[6].imagenet] == pytest.approx(1.0)


def test_cylinder_curvature(tmp_path: Path) -> None:
    radius = 0.3
    scene = _single_object_scene(Cylinder((3.0, 0.0, 2.5), radius, 1.0, Material((0.2, 0.6, 0.2)), category=9))
    view = render_view(scene, Camera((3.0, 1.4, 4.5), (3.0, 0.6, 2.5), syn.FOV_DEG), 48)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=0))
    k = (_read(tmp_path, "principal_curvature", "b", 0, 0)[..., :2].astype(np.float64) - 127) / syn.CURVATURE_SCALE
    n_cam = view.normal
    side = (view.surface == NUM_ROOM_FACES) & (np.abs(n_cam[..., 1]) < 0.5)  # not the top cap
    top = (view.surface == NUM_ROOM_FACES) & (np.abs(n_cam[..., 1]) > 0.5)
    assert side.sum() > 50 and top.sum() > 10
    assert np.abs(k[side][:, 0] - 1 / radius).max() <= 0.5 / syn.CURVATURE_SCALE + 1e-9
    assert np.abs(k[side][:, 1]).max() == 0 and np.abs(k[top]).max() == 0


def test_window_has_no_geometry(tmp_path: Path) -> None:
    window = Window(face=4, lo=(2.0, 1.0), hi=(4.0, 2.2))  # wall z = 0
    scene = _single_object_scene(Sphere((1.0, 0.5, 4.0), 0.3, Material((0.5, 0.5, 0.9))), window)
    view = render_view(scene, Camera((3.0, 1.6, 4.0), (3.0, 1.6, 0.0), syn.FOV_DEG), 32)
    syn.write_view(tmp_path, "b", 0, 0, syn.encode_view(view, room_type=2))
    depth = _read(tmp_path, "depth_euclidean", "b", 0, 0)
    hole = depth == 65535
    assert 50 < hole.sum() < 32 * 32 - 50
    assert (_read(tmp_path, "depth_zbuffer", "b", 0, 0)[hole] == 65535).all()
    assert (_read(tmp_path, "normal", "b", 0, 0)[hole] == 128).all()
    assert (_read(tmp_path, "edge_occlusion", "b", 0, 0)[~hole] > 0).sum() > 10  # the window's rim occludes
    obj = _read(tmp_path, "class_object", "b", 0, 0)  # no object in view: the kitchen's categories share
    assert abs(obj.sum() - 1) < 1e-5 and (obj > 0).sum() == len(syn.ROOM_TYPES[2].objects)


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
