"""The synthetic PASCAL-Context (PASCAL_MT layout) and NYUD-v2 (MTI-Net layout) generators: layout, file types,
label ranges, people and parts, edges, normals, depth, determinism, the CLI, and the real readers loading them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from squad.data import detect_dataset
from squad.data.synthetic.dense import PARTS_6, label_boundaries
from squad.data.synthetic.nyud import CLASS_ID, render_nyud
from squad.data.synthetic.pascal import CONTEXT_LABELS, VOC_CLASSES, VOC_OF_CONTEXT, render_pascal

PASCAL_N, NYUD_N, SIZE = 24, 12, 48


@pytest.fixture(scope="module")
def pascal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pascal")
    t0 = time.perf_counter()
    render_pascal(root, PASCAL_N, SIZE, seed=3, workers=1)
    print(f"synthetic PASCAL: {PASCAL_N / (time.perf_counter() - t0):.1f} images/s at {SIZE} px, 1 process")
    return root


@pytest.fixture(scope="module")
def nyud(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nyud")
    t0 = time.perf_counter()
    render_nyud(root, NYUD_N, SIZE, seed=3, workers=1)
    print(f"synthetic NYUD: {NYUD_N / (time.perf_counter() - t0):.1f} images/s at {SIZE} px, 1 process")
    return root


def _ids(root: Path, folder: str) -> dict[str, list[str]]:
    return {s: (root / folder / f"{s}.txt").read_text().splitlines() for s in ("train", "val")}


def _anno_objects(path: Path) -> list[tuple[int, np.ndarray, list[tuple[str, np.ndarray]]]]:
    """(class_ind, mask, [(part_name, mask)]) per object, read positionally as ASTMT's loader does."""
    objects = scipy.io.loadmat(path)["anno"][0][0][1][0]
    out = []
    for obj in objects:
        parts = [(str(p[0][0]), p[1].astype(bool)) for p in obj[3][0]] if len(obj[3]) else []
        out.append((int(obj[1][0][0]), obj[2].astype(bool), parts))
    return out


def test_pascal_layout_and_file_types(pascal: Path) -> None:
    splits = _ids(pascal, "ImageSets/Context")
    ids = splits["train"] + splits["val"]
    assert len(ids) == PASCAL_N and not set(splits["train"]) & set(splits["val"]) and all(splits.values())
    manifest = json.loads((pascal / "synthetic.json").read_text())
    assert manifest["dataset"] == "pascal_context" and manifest["n"] == PASCAL_N
    shapes = set()
    for i in ids:
        with Image.open(pascal / "JPEGImages" / f"{i}.jpg") as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            w, h = im.size
        assert max(w, h) == SIZE
        shapes.add((w, h))
        for folder, mode in (("semseg/pascal-context", "L"), ("sal_distill", "L"), ("normals_distill", "RGB")):
            with Image.open(pascal / folder / f"{i}.png") as im:
                assert im.format == "PNG" and im.mode == mode and im.size == (w, h), (folder, i)
        lab = scipy.io.loadmat(pascal / "pascal-context" / "trainval" / f"{i}.mat")["LabelMap"]
        assert lab.dtype == np.uint16 and lab.shape == (h, w)
        assert set(np.unique(lab).tolist()) <= set(CONTEXT_LABELS.values()) | {0}
        semseg = np.array(Image.open(pascal / "semseg/pascal-context" / f"{i}.png"))
        assert set(np.unique(semseg).tolist()) <= set(range(len(VOC_CLASSES))) | {255}
        lut = np.zeros(460, np.uint8)
        for c, v in VOC_OF_CONTEXT.items():
            lut[c] = v
        np.testing.assert_array_equal(semseg, np.where(lab == 0, 255, lut[lab]))  # semseg = VOC view of LabelMap
        assert (semseg > 0).any() or (semseg == 255).any()  # every image shows a VOC object
    assert any(w != h for w, h in shapes) and len(shapes) > 1  # non-square, varying aspect
    cache = json.loads((pascal / "ImageSets/Parts/train.txt").read_text())
    assert sorted(cache) == sorted(splits["train"])


def test_pascal_people_and_parts(pascal: Path) -> None:
    ids = sorted(p.stem for p in (pascal / "JPEGImages").glob("*.jpg"))
    with_person = 0
    for i in ids:
        objects = _anno_objects(pascal / "human_parts" / f"{i}.mat")
        assert objects, f"{i}: every PASCAL-Part file lists objects"
        semseg = np.array(Image.open(pascal / "semseg/pascal-context" / f"{i}.png"))
        people = [o for o in objects if o[0] == 15]
        person_pixels = np.zeros(semseg.shape, bool)
        for ind, mask, _parts in objects:
            assert 1 <= ind <= 20 and mask.shape == semseg.shape and mask.any()
            assert (semseg[mask] == ind).all()  # an object's mask carries its class in semseg
        for _, mask, parts in people:
            person_pixels |= mask
            assert parts, f"{i}: a labelled person has parts"
            covered = np.zeros_like(mask)
            for name, pm in parts:
                assert name in PARTS_6 and pm.any()
                assert not (pm & ~mask).any(), f"{i}: part {name} outside its person"
                assert not (pm & covered).any(), f"{i}: parts overlap"
                covered |= pm
            np.testing.assert_array_equal(covered, mask)  # every person pixel belongs to one part
        np.testing.assert_array_equal(person_pixels, semseg == 15)
        with_person += bool(people)
    assert 0 < with_person < len(ids)  # people in some images only
    groups = set()
    for i in ids:
        for _ind, _, parts in _anno_objects(pascal / "human_parts" / f"{i}.mat"):
            groups |= {PARTS_6[name] for name, _ in parts}
    assert groups == {1, 2, 3, 4, 5, 6}


def test_pascal_saliency_and_normals(pascal: Path) -> None:
    floor_up: list[float] = []
    window_dots: list[float] = []
    for i in sorted(p.stem for p in (pascal / "JPEGImages").glob("*.jpg")):
        sal = np.array(Image.open(pascal / "sal_distill" / f"{i}.png"))
        semseg = np.array(Image.open(pascal / "semseg/pascal-context" / f"{i}.png"))
        salient = sal > 127
        assert salient.any() and 0 < (sal[(sal > 0) & (sal < 255)]).size  # soft outlines, a salient region
        assert (semseg[salient] != 0).mean() > 0.8  # saliency sits on VOC objects
        n = np.array(Image.open(pascal / "normals_distill" / f"{i}.png")).astype(np.float64) * 2 / 255 - 1
        assert np.abs(np.linalg.norm(n, axis=2) - 1).max() < 0.03  # unit vectors (8-bit)
        lab = scipy.io.loadmat(pascal / "pascal-context" / "trainval" / f"{i}.mat")["LabelMap"]
        floor = lab == CONTEXT_LABELS["floor"]
        if floor.any():
            floor_up.append(np.median(n[floor][:, 1]))
        win, wall = lab == CONTEXT_LABELS["window"], lab == CONTEXT_LABELS["wall"]
        beside = win[:, :-1] & wall[:, 1:]  # a window pixel left of a wall pixel: same plane, same normal
        window_dots.extend((n[:, :-1][beside] * n[:, 1:][beside]).sum(axis=1).tolist())
    assert floor_up and min(floor_up) > 0.9  # y up: the floor's normal points up
    assert window_dots and min(window_dots) > 0.95  # windows (openings) carry their wall's normal


def test_pascal_real_reader_functions(pascal: Path) -> None:
    """P2's reader functions (squad.data.pascal / benchmark) decode these files: parts, label map, edges."""
    import squad.data.benchmark as bench
    import squad.data.pascal as pas

    assert detect_dataset(pascal) == "pascal_context"
    for i in sorted(p.stem for p in (pascal / "JPEGImages").glob("*.jpg")):
        parts = pas.human_parts_map(bench.read_mat(pascal / "human_parts" / f"{i}.mat"))
        semseg = np.array(Image.open(pascal / "semseg/pascal-context" / f"{i}.png"))
        if (semseg == 15).any():
            assert ((parts > 0) == (semseg == 15)).all() and set(np.unique(parts)) <= set(range(7))
        else:
            assert (parts == 255).all()  # no person: no target
        labels = pas.label_map(bench.read_mat(pascal / "pascal-context" / "trainval" / f"{i}.mat"))
        edges = bench.label_edges(labels).astype(bool)
        change = label_boundaries(labels)
        near = change.copy()  # pixels on either side of a label change
        near[:, 1:] |= change[:, :-1]
        near[1:, :] |= change[:-1, :]
        assert edges.any() == change.any() and not (edges & ~near).any()  # edges only at label boundaries


def test_nyud_layout_labels_depth_normals_edges(nyud: Path) -> None:
    splits = _ids(nyud, "gt_sets")
    ids = splits["train"] + splits["val"]
    assert len(ids) == NYUD_N and all(splits.values()) and not set(splits["train"]) & set(splits["val"])
    assert json.loads((nyud / "synthetic.json").read_text())["dataset"] == "nyud"
    h, w = round(SIZE * 3 / 4), SIZE
    invalid_seen = False
    for i in ids:
        with Image.open(nyud / "images" / f"{i}.jpg") as im:
            assert im.format == "JPEG" and im.mode == "RGB" and im.size == (w, h)
        with Image.open(nyud / "segmentation" / f"{i}.png") as im:
            assert im.mode == "L"
            seg = np.array(im)
        assert seg.shape == (h, w) and seg.max() <= 40
        depth = np.load(nyud / "depth" / f"{i}.npy")
        normals = np.load(nyud / "normals" / f"{i}.npy")
        edge = np.load(nyud / "edge" / f"{i}.npy")
        assert depth.dtype == np.float32 and depth.shape == (h, w)
        assert normals.dtype == np.float32 and normals.shape == (h, w, 3)
        assert edge.dtype == np.float32 and edge.shape == (h, w) and set(np.unique(edge)) <= {0.0, 1.0}
        valid = depth > 0
        assert (depth >= 0).all() and valid.mean() > 0.5 and np.isfinite(depth).all()
        norm = np.linalg.norm(normals, axis=2)
        np.testing.assert_allclose(norm[valid], 1.0, atol=1e-4)
        assert (norm[~valid] == 0).all() and ((seg == 0) == ~valid).all()  # one invalid code for all three
        invalid_seen |= bool((~valid).any())
        floor = seg == CLASS_ID["floor"]
        if floor.any():
            assert np.median(normals[floor][:, 1]) > 0.9 and (np.abs(normals[..., 2][valid]) <= 1).all()
        assert (edge[label_boundaries(seg)] == 1).all()  # every class boundary is an edge
        assert 0 < edge.mean() < 0.25  # thin
    assert set(CLASS_ID.values()) >= {1, 2, 22}


def test_nyud_real_reader_detects(nyud: Path) -> None:

    assert detect_dataset(nyud) == "nyud"


@pytest.mark.parametrize("dataset", ["pascal_context", "nyud"])
def test_readers_load_the_synthetic_trees(dataset: str, pascal: Path, nyud: Path) -> None:
    """The real readers (build_dataset) load every task of both splits."""
    from squad.data import build_dataset

    root = pascal if dataset == "pascal_context" else nyud
    for split in ("train", "val"):
        ds = build_dataset(root, "all", split, dataset=dataset, image_size=32)
        assert len(ds) == len(_ids(root, "ImageSets/Context" if dataset == "pascal_context" else "gt_sets")[split])
        sample = ds[0]
        assert tuple(sample["rgb"].shape[-2:]) == (32, 32) and sample["targets"]


@pytest.mark.slow
def test_determinism_and_workers(tmp_path: Path) -> None:
    """Same arguments, same bytes, whether rendered in 1 or 2 processes."""
    for render in (render_pascal, render_nyud):
        a, b = tmp_path / f"{render.__name__}_a", tmp_path / f"{render.__name__}_b"
        render(a, 5, 32, seed=11, workers=1)
        render(b, 5, 32, seed=11, workers=2)
        files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        for rel in files_a:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
        c = tmp_path / f"{render.__name__}_c"
        render(c, 5, 32, seed=12, workers=1)
        assert any((a / rel).read_bytes() != (c / rel).read_bytes() for rel in files_a if rel.suffix == ".jpg")


def test_overwrite_rules(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing"):
        render_pascal(foreign, 2, 24, overwrite=True, workers=1)
    assert (foreign / "keep.txt").read_text() == "mine"
    own = tmp_path / "own"
    render_nyud(own, 3, 24, workers=1)
    with pytest.raises(FileExistsError, match="not empty"):
        render_nyud(own, 3, 24, workers=1)
    with pytest.raises(FileExistsError, match="refusing"):  # a NYUD render is not a PASCAL one
        render_pascal(own, 2, 24, overwrite=True, workers=1)
    render_nyud(own, 2, 24, seed=1, overwrite=True, workers=1)
    assert len(list((own / "images").iterdir())) == 2


def test_cli_synthetic_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from squad.cli import make_data

    out = tmp_path / "nyud"
    assert make_data.main(["synthetic", "--dataset", "nyud", "--out", str(out), "--n", "3", "--image-size", "24"]) == 0
    assert "images/s" in capsys.readouterr().out
    assert len((out / "gt_sets" / "train.txt").read_text().split()) + len(
        (out / "gt_sets" / "val.txt").read_text().split()) == 3  # fmt: skip
    bad = ["synthetic", "--dataset", "pascal_context", "--out", str(tmp_path / "p"), "--n", "2", "--buildings", "3"]
    assert make_data.main(bad) == 2
