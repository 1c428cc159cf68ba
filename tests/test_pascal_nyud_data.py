"""PASCAL-Context (PASCAL_MT layout) and NYUD-v2 (MTI-Net layout) readers on small trees written here in the public
encodings: raw forms, masks, edges from the context labels, non-square images, flip consistency, corrupt files,
split lists, packing to shards and reading back, and the dataset key."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

sio = pytest.importorskip("scipy.io")

from squad.config.loading import load_config  # noqa: E402
from squad.config.model import ConfigError  # noqa: E402
from squad.data import (  # noqa: E402
    BenchmarkShardDataset,
    DatasetTaskError,
    NYUDDataset,
    PascalContextDataset,
    build_dataset,
    detect_dataset,
    report,
)
from squad.data.benchmark import label_edges, thin  # noqa: E402
from squad.data.offline.pack import pack_shards  # noqa: E402
from squad.data.pascal import NORMALS_VALID_CLASSES, PART_IDS  # noqa: E402

WALL, SKY, PERSON_CTX = 440, 360, 284  # context ids: wall and person are NYU-mappable, sky is not
assert WALL in NORMALS_VALID_CLASSES and PERSON_CTX in NORMALS_VALID_CLASSES and SKY not in NORMALS_VALID_CLASSES


# --------------------------------------------------------------------------------------------- tree writers
def _struct(rows: list[dict], fields: list[str]) -> np.ndarray:
    """A MATLAB 1×n struct array for savemat."""
    arr = np.zeros((1, len(rows)), dtype=[(f, object) for f in fields])
    for j, r in enumerate(rows):
        for f in fields:
            arr[0, j][f] = r[f]
    return arr


def _parts_mat(path, shape, persons: list[dict[str, np.ndarray]], others: int = 1) -> None:
    """A PASCAL-Part file: `persons` (part name → mask) as class 15 objects, plus `others` cat objects."""
    objects = []
    for parts in persons:
        inst = np.zeros(shape, np.uint8)
        for m in parts.values():
            inst |= m.astype(np.uint8)
        objects.append({"class": "person", "class_ind": 15, "mask": inst,
                        "parts": _struct([{"part_name": k, "mask": v.astype(np.uint8)} for k, v in parts.items()],
                                         ["part_name", "mask"])})
    for _ in range(others):
        m = np.zeros(shape, np.uint8)
        m[:2, :2] = 1
        objects.append({"class": "cat", "class_ind": 8, "mask": m, "parts": np.zeros((0, 0))})
    anno = {"imname": "x", "objects": _struct(objects, ["class", "class_ind", "mask", "parts"])}
    sio.savemat(str(path), {"anno": anno})


def _jpeg(path, h, w, seed) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, quality=95)


PASCAL_IDS = {"2008_000001": (30, 40), "2008_000002": (37, 25), "2008_000003": (20, 20), "2008_000004": (24, 32)}


@pytest.fixture(scope="module")
def pascal(tmp_path_factory):
    """A PASCAL_MT tree: 000001 has a person, 000002 none, 000003's JPEG is truncated; 000004 is val."""
    root = tmp_path_factory.mktemp("PASCAL_MT")
    for d in ("JPEGImages", "semseg/pascal-context", "human_parts", "sal_distill", "normals_distill",
              "pascal-context/trainval", "ImageSets/Context"):
        (root / d).mkdir(parents=True)
    truth = {}
    for k, (sid, (h, w)) in enumerate(PASCAL_IDS.items()):
        _jpeg(root / "JPEGImages" / f"{sid}.jpg", h, w, k)
        ctx = np.full((h, w), SKY, np.uint16)
        ctx[h // 2:, :] = WALL
        ctx[h // 4: h // 2 + 4, w // 3: w // 3 + 6] = PERSON_CTX
        sio.savemat(str(root / "pascal-context/trainval" / f"{sid}.mat"), {"LabelMap": ctx})
        sem = np.zeros((h, w), np.uint8)
        sem[ctx == PERSON_CTX] = 15
        sem[:3, :3] = 255  # ignore (one pixel after the 2.5× downscale)
        Image.fromarray(sem).save(root / "semseg/pascal-context" / f"{sid}.png")
        sal = np.zeros((h, w), np.uint8)
        sal[ctx == PERSON_CTX] = 200
        sal[0, :] = 127  # just below 0.5
        Image.fromarray(sal).save(root / "sal_distill" / f"{sid}.png")
        nrm = np.zeros((h, w, 3), np.uint8)
        nrm[..., 0] = 40  # every surface faces left (x < 0): a mirrored sample faces right
        nrm[..., 1], nrm[..., 2] = 128, 200
        Image.fromarray(nrm).save(root / "normals_distill" / f"{sid}.png")
        persons = []
        if sid != "2008_000002":
            head = np.zeros((h, w), bool)
            head[h // 4: h // 4 + 3, w // 3: w // 3 + 6] = True
            arm = np.zeros((h, w), bool)
            arm[h // 4 + 3: h // 2 + 4, w // 3: w // 3 + 2] = True
            hand = arm & (np.arange(h)[:, None] >= h // 2 + 2)
            persons.append({"hair": head, "luarm": arm, "lhand": hand})
        _parts_mat(root / "human_parts" / f"{sid}.mat", (h, w), persons)
        truth[sid] = {"sem": sem, "sal": sal, "nrm": nrm, "ctx": ctx, "persons": persons}
    raw = (root / "JPEGImages" / "2008_000003.jpg").read_bytes()
    (root / "JPEGImages" / "2008_000003.jpg").write_bytes(raw[: len(raw) // 3])  # truncated
    (root / "ImageSets/Context/train.txt").write_text("2008_000001\n2008_000002\n2008_000003\n")
    (root / "ImageSets/Context/val.txt").write_text("2008_000004\n")
    return root, truth


NYUD_IDS = {"0001": "train", "0002": "train", "0003": "val"}


def _nyud(root, variant: str):
    """An NYUD tree in the MTI-Net (.npy) or ATRC (.png) variant; images 12 × 18."""
    h, w = 12, 18
    for d in ("images", "segmentation", "depth", "normals", "edge", "gt_sets"):
        (root / d).mkdir(parents=True)
    truth = {}
    for k, sid in enumerate(NYUD_IDS):
        ext = ".jpg" if variant == "npy" else ".png"
        rgb = np.random.default_rng(k).integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(root / "images" / f"{sid}{ext}", **({"quality": 95} if ext == ".jpg" else {}))
        seg = (np.arange(h * w).reshape(h, w) % 41).astype(np.uint8)  # 0 = unlabelled, 1..40
        Image.fromarray(seg).save(root / "segmentation" / f"{sid}.png")
        depth = np.linspace(0.5, 9.5, h * w, dtype=np.float32).reshape(h, w)
        depth[0, :3] = 0  # no measurement
        np.save(root / "depth" / f"{sid}.npy", depth)
        n = np.zeros((h, w, 3), np.float32)
        n[..., 0] = np.where(np.arange(w) < w // 2, -0.6, 0.6)[None, :]
        n[..., 2] = 0.8
        n[1, 1] = 0  # invalid
        edge = np.zeros((h, w), np.float32)
        edge[:, w // 2] = 1
        if variant == "npy":
            np.save(root / "normals" / f"{sid}.npy", n)
            np.save(root / "edge" / f"{sid}.npy", edge)
        else:
            code = np.clip(np.rint((n + 1) * 127.5), 0, 255).astype(np.uint8)
            Image.fromarray(code).save(root / "normals" / f"{sid}.png")
            Image.fromarray((edge * 255).astype(np.uint8)).save(root / "edge" / f"{sid}.png")
        truth[sid] = {"seg": seg, "depth": depth, "n": n, "edge": edge}
    for split in ("train", "val"):
        (root / "gt_sets" / f"{split}.txt").write_text("".join(f"{s}\n" for s, p in NYUD_IDS.items() if p == split))
    return truth


@pytest.fixture(scope="module", params=["npy", "png"])
def nyud(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"NYUD_{request.param}")
    return root, _nyud(root, request.param), request.param


# ------------------------------------------------------------------------------------------------- edges
def test_thin_known_answer():
    """scikit-image's own thinning test case (a 5 × 5 block with a hole) and its published answer."""
    image = np.array([[0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5, 0], [0, 1, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0],
                      [0, 6, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0]])
    expected = np.array([[0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(thin(image), expected)
    line = np.zeros((5, 9), bool)
    line[2, 1:8] = True
    np.testing.assert_array_equal(thin(line), line)  # already one pixel wide: unchanged
    from squad.tasks.edges import thin as eval_thin  # the evaluation's thinning is the same algorithm

    rng = np.random.default_rng(0)
    for _ in range(10):
        m = rng.random((15, 18)) < rng.uniform(0.2, 0.8)
        np.testing.assert_array_equal(thin(m), np.asarray(eval_thin(m)).astype(bool))


def test_label_edges_by_hand():
    labels = np.zeros((6, 8), int)
    labels[:, 4:] = 7  # a vertical boundary between columns 3 and 4
    lap = np.zeros((6, 8), bool)
    lap[:, 3:5] = True  # the 4-neighbour Laplacian is nonzero on both sides
    edges = label_edges(labels)
    assert edges.dtype == np.uint8 and set(np.unique(edges)) <= {0, 1}
    assert not (edges.astype(bool) & ~lap).any()  # only where the Laplacian is nonzero
    assert (edges.sum(axis=1) <= 1).all()  # thinned to one pixel per row (a line end may erode)
    assert (edges[1:-1].sum(axis=1) == 1).all()
    assert not label_edges(np.full((5, 5), 3)).any()  # no boundary, no edge
    # borders are reflected (OpenCV's reflect-101): a label on the border column makes no edge at the border itself
    one = np.zeros((5, 5), int)
    one[2, 2] = 1
    np.testing.assert_array_equal(label_edges(one), thin(np.array(
        [[0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]])).astype(np.uint8))


# ----------------------------------------------------------------------------------------------- PASCAL
def test_pascal_raw_forms(pascal):
    root, truth = pascal
    ds = PascalContextDataset(root, "all", split="train")
    assert ds.tasks == ["semseg", "human_parts", "saliency", "normals", "edge"]
    assert ds.ids == ["2008_000001", "2008_000002", "2008_000003"]  # indexed; the corrupt JPEG shows when read
    i = ds.ids.index("2008_000001")
    t = truth["2008_000001"]
    np.testing.assert_array_equal(ds._read(i, "semseg"), t["sem"])
    np.testing.assert_array_equal(ds._read(i, "saliency"), t["sal"])
    parts = ds._read(i, "human_parts")
    assert parts.dtype == np.uint8 and parts.shape == t["sem"].shape
    p = t["persons"][0]
    assert PART_IDS["hair"] == 1 and (parts[p["hair"]] == 1).all()
    assert (parts[p["luarm"] & ~p["lhand"]] == 3).all() and (parts[p["lhand"]] == 4).all()
    assert (parts[~(p["hair"] | p["luarm"])] == 0).all()
    np.testing.assert_array_equal(ds._read(ds.ids.index("2008_000002"), "human_parts"), 255)  # no person
    nrm = ds._read(i, "normals")
    valid = np.isin(t["ctx"], list(NORMALS_VALID_CLASSES))
    np.testing.assert_array_equal(nrm[valid], t["nrm"][valid])
    assert (nrm[~valid] == 128).all() and (~valid).any()
    np.testing.assert_array_equal(ds._read(i, "edge"), label_edges(t["ctx"]))


def test_pascal_samples_masks_and_padding(pascal):
    root, truth = pascal
    ds = PascalContextDataset(root, "all", split="train", image_size=16).without_substitutes()
    s = ds[0]  # 30 × 40 → 12 × 16, padded by 2 rows above and below
    assert s["rgb"].shape == (3, 16, 16) and s["id"] == "2008_000001"
    assert (s["rgb"][:, :2] == 0).all() and (s["rgb"][:, 14:] == 0).all() and s["rgb"][:, 2:14].abs().sum() > 0
    for name, m in s["masks"].items():
        assert m.shape == (1, 16, 16) and m.dtype == torch.bool, name
        assert not m[:, :2].any() and not m[:, 14:].any(), name  # padding is never scored
    assert s["masks"]["semseg"][:, 2:14].sum() == 12 * 16 - 1  # all but the ignore pixel (at the corner)
    assert s["masks"]["human_parts"].any()
    assert not ds[1]["masks"]["human_parts"].any()  # the image without a person has no parts target
    assert ds[1]["masks"]["semseg"].any()
    ctx = truth["2008_000001"]["ctx"]
    assert s["masks"]["normals"][:, 2:14].sum() < 12 * 16  # sky is not NYU-mappable: masked
    assert s["masks"]["normals"].sum() > 0 and ctx.shape == (30, 40)
    assert ds[2] is None  # the truncated JPEG: left out in evaluation ...
    assert ds.num_corrupt == 1
    train = PascalContextDataset(root, "all", split="train", image_size=16)
    assert train[2]["id"] == "2008_000001"  # ... and substituted by the next sample in training
    assert train[2]["id"] == "2008_000001"
    assert train.num_corrupt == 1 and report(train, "train").corrupt == 1  # counted once


def test_pascal_flip_is_consistent(pascal):
    """Random scale, crop and flip move rgb and every target together; the normals (all facing left in the files)
    face right exactly when the sample was mirrored."""
    root, _ = pascal
    ds = PascalContextDataset(root, ["semseg", "normals"], split="train", image_size=16, augment=True,
                              scale_range=(1.0, 1.0), seed=3)
    plain = PascalContextDataset(root, ["semseg", "normals"], split="train", image_size=16)[0]
    seen = set()
    for epoch in range(12):
        ds.set_epoch(epoch)
        s = ds[0]
        # at scale 1 the 12 × 16 fit is only shifted vertically, so each row is the plain row or its mirror
        rows = [r for r in range(16) if s["masks"]["semseg"][0, r].any()]
        src = [r for r in range(16) if plain["masks"]["semseg"][0, r].any()]
        assert len(rows) == len(src) == 12
        a, b = s["rgb"][:, rows], plain["rgb"][:, src]
        flipped = bool(torch.equal(a, torch.flip(b, dims=(-1,))))
        assert flipped or torch.equal(a, b)
        seen.add(flipped)
        for name in ("semseg", "normals"):
            v, pv = s["targets"][name][:, rows], plain["targets"][name][:, src]
            m, pm = s["masks"][name][:, rows], plain["masks"][name][:, src]
            if flipped:
                pv, pm = torch.flip(pv, dims=(-1,)), torch.flip(pm, dims=(-1,))
                if name == "normals":
                    pv = torch.cat([-pv[:1], pv[1:]])
            assert torch.equal(m, pm), name
            assert torch.allclose(v * m, pv * pm, atol=1e-6), name
        x = s["targets"]["normals"][0][s["masks"]["normals"][0]]
        assert len(x) and ((x > 0).all() if flipped else (x < 0).all())
    assert seen == {True, False}


def test_pascal_splits_and_errors(pascal):
    root, _ = pascal
    assert PascalContextDataset(root, ["semseg"], split="val").ids == ["2008_000004"]
    assert len(PascalContextDataset(root, ["semseg"], split="all")) == 4
    with pytest.raises(ValueError, match="unknown split"):
        PascalContextDataset(root, ["semseg"], split="test")
    with pytest.raises(DatasetTaskError, match=re.escape("semseg, human_parts, saliency, normals, edge")):
        build_dataset(root, ["depth_euclidean"], "train")
    with pytest.raises(DatasetTaskError, match="nyud_depth"):
        build_dataset(root, ["nyud_depth"], "train", dataset="pascal_context")
    with pytest.raises(ValueError, match="pascal_context"):
        build_dataset(root, ["semseg"], "train", dataset="nyud")
    assert detect_dataset(root) == "pascal_context"
    assert isinstance(build_dataset(root, "all", "val", image_size=8), PascalContextDataset)


def test_pascal_missing_file(pascal, tmp_path):
    import shutil

    root = tmp_path / "p"
    shutil.copytree(pascal[0], root)
    (root / "sal_distill" / "2008_000002.png").unlink()
    skip = PascalContextDataset(root, ["saliency"], split="train")
    assert "2008_000002" not in skip.ids and skip.missing_files == 1
    mask = PascalContextDataset(root, ["saliency"], split="train", missing="mask", image_size=8)
    i = mask.ids.index("2008_000002")
    assert not mask.without_substitutes()[i]["masks"]["saliency"].any()


def test_pascal_pack_roundtrip(pascal, tmp_path):
    root, _ = pascal
    index = pack_shards(root, tmp_path / "shards", image_size=16, workers=0)  # the layout is detected
    info = json.loads(index.read_text())
    assert info["dataset"] == "pascal_context" and info["tasks"] == ["semseg", "human_parts", "saliency",
                                                                     "normals", "edge"]
    assert info["corrupt"] == 1  # the truncated JPEG
    shards = build_dataset(tmp_path / "shards", "all", "train", image_size=16)
    assert isinstance(shards, BenchmarkShardDataset) and shards.dataset == "pascal_context"
    tree = PascalContextDataset(root, "all", split="train", image_size=16).without_substitutes()
    assert shards.ids == ["2008_000001", "2008_000002"]
    for k, sid in enumerate(shards.ids):
        a, b = shards[k], tree[tree.ids.index(sid)]
        assert torch.equal(a["rgb"], b["rgb"])
        for t in tree.tasks:
            assert torch.equal(a["masks"][t], b["masks"][t]), t
            assert torch.equal(a["targets"][t], b["targets"][t]), t
    with pytest.raises(ValueError, match="pascal_context"):
        build_dataset(tmp_path / "shards", "all", "train", dataset="taskonomy")
    augmented = build_dataset(tmp_path / "shards", ["semseg"], "train", image_size=16, augment=True)
    assert augmented[0]["rgb"].shape == (3, 16, 16)


# ------------------------------------------------------------------------------------------------- NYUD
def test_nyud_raw_forms_and_samples(nyud):
    root, truth, variant = nyud
    ds = NYUDDataset(root, "all", split="train")
    assert ds.tasks == ["nyud_semseg", "nyud_depth", "normals", "edge"] and ds.ids == ["0001", "0002"]
    t = truth["0001"]
    np.testing.assert_array_equal(ds._read(0, "nyud_semseg"), t["seg"])
    depth = ds._read(0, "nyud_depth")
    assert depth.dtype == np.float32
    np.testing.assert_array_equal(depth, t["depth"])
    nrm = ds._read(0, "normals")
    assert nrm.dtype == np.uint8 and nrm.shape == (12, 18, 3)
    expect = np.clip(np.rint((t["n"] + 1) * 127.5), 0, 255).astype(np.uint8)
    if variant == "npy":
        expect[1, 1] = 128  # the zero vector → the fill
    np.testing.assert_array_equal(nrm, expect)
    np.testing.assert_array_equal(ds._read(0, "edge"), t["edge"].astype(np.uint8))
    s = NYUDDataset(root, "all", split="val", image_size=9).without_substitutes()[0]  # 12 × 18 → 6 × 9, padded
    assert s["rgb"].shape == (3, 9, 9)
    assert not s["masks"]["nyud_depth"][:, :1].any() and not s["masks"]["nyud_depth"][:, 7:].any()
    assert s["masks"]["nyud_depth"][:, 1:7].sum() >= 6 * 9 - 2  # only the unmeasured corner is masked
    d = s["targets"]["nyud_depth"][0, 1:7][s["masks"]["nyud_depth"][0, 1:7]]
    assert 0.5 <= float(d.min()) and float(d.max()) <= 9.5  # metres; 0 never blended in
    assert detect_dataset(root) == "nyud"


def test_nyud_pack_roundtrip(nyud, tmp_path):
    root, _, _ = nyud
    index = pack_shards(root, tmp_path / "s", image_size=9, dataset="nyud", partitions=("train", "val", "test"),
                        workers=0)
    info = json.loads(index.read_text())
    assert info["dataset"] == "nyud" and info["tasks"] == ["nyud_semseg", "nyud_depth", "normals", "edge"]
    assert sorted({s["split"] for s in info["shards"]}) == ["train", "val"]
    tree = NYUDDataset(root, "all", split="all", image_size=9)
    shards = build_dataset(tmp_path / "s", "all", "all", image_size=9, dataset="nyud")
    assert sorted(shards.ids) == sorted(tree.ids)
    for k, sid in enumerate(shards.ids):
        a, b = shards[k], tree[tree.ids.index(sid)]
        assert torch.equal(a["rgb"], b["rgb"])
        for t in tree.tasks:
            assert torch.equal(a["masks"][t], b["masks"][t]) and torch.equal(a["targets"][t], b["targets"][t]), t


# ----------------------------------------------------------------------------------------------- config
def test_dataset_key():
    from squad.config.run import RunConfig

    cfg = load_config("configs/demo.yaml", ["data.dataset=pascal_context"], cls=RunConfig)
    assert cfg.data.dataset == "pascal_context"
    assert load_config("configs/demo.yaml", cls=RunConfig).data.dataset == "taskonomy"
    with pytest.raises(ConfigError, match=r"^data\.dataset"):
        load_config("configs/demo.yaml", ["data.dataset=coco"], cls=RunConfig)


def test_taskonomy_refuses_benchmark_tasks(tiny_data):
    with pytest.raises(DatasetTaskError, match="taskonomy"):
        build_dataset(tiny_data, ["semseg"], "train")


# ------------------------------------------------------------------------------------- unusable data (issue 37)
@pytest.mark.slow
def test_nan_in_every_nyud_depth_file_is_bad_input(nyud, tmp_path):
    """Every depth file holds NaN: the reader names the file, and training stops with one ``error:`` line naming
    the problem, exit 2 (not a traceback, exit 1)."""
    import shutil

    from squad.data.samples import UnusableDataError
    from tests.helpers import PY, ROOT, TINY, run_command, tool_env

    root, _, variant = nyud
    if variant != "npy":
        pytest.skip("one variant is enough")
    bad = tmp_path / "nyud"
    shutil.copytree(root, bad)
    for f in (bad / "depth").glob("*.npy"):
        np.save(f, np.full_like(np.load(f), np.nan))
    with pytest.raises(UnusableDataError, match=r"every one of the 2 samples is unusable .*non-finite depths"):
        NYUDDataset(bad, "all", split="train", image_size=9)[0]
    sets = [*TINY, "model.head_dim=null", "data.dataset=nyud", f"data.root={bad}", "data.workers=0",
            "data.val_batches=1", "data.val_split=train", "optim.steps=1", "optim.batch_per_rank=2",
            "train.progress=false"]
    res = run_command([PY, "tools/train.py", "--config", str(ROOT / "configs/model/modsquad_vit_s_nyud.yaml"),
                       "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]], ROOT, tool_env(), 300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "error: " in res.stderr and "non-finite depths" in res.stderr and "unusable" in res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
