"""`squad.data.offline.stats` and ``tools/make_data.py stats``: accumulators, sampling, real-encoded trees, shards,
and the synthetic renderer held inside the real files' ranges."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from squad.data.offline.stats import (
    REFERENCES,
    VALID,
    CodeHistogram,
    Moments,
    Reference,
    dataset_stats,
    sample_views,
)
from squad.tasks import TASK_NAMES

SIZE = 32
BUILDINGS = ("alpha", "bravo", "charlie")
VIEWS = 4


# ------------------------------------------------------------------------------------------ accumulators
@pytest.mark.parametrize("channels", [1, 3])
def test_moments_match_numpy(channels):
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=5.0, scale=3.0, size=(n, channels)) * (1 + k) for k, n in enumerate([1, 7, 250, 3])]
    m = Moments(channels)
    assert np.isnan(m.mean).all() and np.isnan(m.std).all()
    for b in batches:
        m.update(b if channels > 1 else b[:, 0])
    m.update(np.zeros((0, channels)))  # an empty batch changes nothing
    every = np.concatenate(batches)
    assert m.count == every.shape[0]
    np.testing.assert_allclose(m.mean, every.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(m.std, every.std(axis=0), rtol=1e-10)


def test_moments_keep_precision_on_large_offsets():
    x = 65000.0 + np.arange(10_000, dtype=np.float64) % 7  # codes near the 16-bit top: naive sums lose the std
    m = Moments()
    for chunk in np.array_split(x, 13):
        m.update(chunk)
    assert m.std[0] == pytest.approx(x.std(), rel=1e-9)


@pytest.mark.parametrize("size", [256, 65536])
def test_code_histogram_matches_numpy(size):
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, size, 500), np.zeros(40, dtype=np.int64), rng.integers(0, 30, 300),
             np.full(7, size - 1)]
    h = CodeHistogram(size)
    assert math.isnan(h.mean) and math.isnan(h.quantile(0.5)) and math.isnan(h.min)
    for p in parts:
        h.update(p.reshape(-1, 1))  # any shape
    codes = np.concatenate(parts)
    assert h.count == codes.size
    assert h.mean == pytest.approx(codes.mean(), rel=1e-12)
    assert h.std == pytest.approx(codes.std(), rel=1e-9)
    for q in (0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 1.0):
        assert h.quantile(q) == np.quantile(codes, q, method="inverted_cdf"), q
    assert h.share(0, 0) == pytest.approx((codes == 0).mean())
    assert h.share(100) == pytest.approx((codes >= 100).mean())
    assert h.share(10, 20) == pytest.approx(((codes >= 10) & (codes <= 20)).mean())
    assert (h.min, h.max) == (codes.min(), codes.max())


def test_code_histogram_refuses_codes_out_of_range():
    h = CodeHistogram(256)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        h.update(np.array([3, 256]))
    with pytest.raises(ValueError):
        h.update(np.array([-1]))


def test_reference_tolerance_rule():
    r = Reference(75, 112, "facts")
    assert r.accepted == (75 - 28, 112 + 28)  # 25 % of the larger bound on each side
    assert (r.flag(46.9), r.flag(47), r.flag(140), r.flag(140.1), r.flag(float("nan"))) == ("LOW", "", "", "HIGH",
                                                                                              "n/a")
    assert Reference(0.0, 0.0, "facts", floor=0.1).accepted == (-0.1, 0.1)  # the floor around 0
    assert Reference(3, math.inf, "facts").accepted == (2.25, math.inf)  # a lower bound only


def test_every_reference_names_a_source():
    from squad.data.offline.stats import SOURCES

    for domain, refs in REFERENCES.items():
        for key, r in refs.items():
            assert r.source in SOURCES, (domain, key)
            assert r.lo <= r.hi and r.tolerance > 0, (domain, key)


def test_sample_views_is_even_and_deterministic():
    groups = {f"b{k}": [f"point_{i}_view_0" for i in range(n)] for k, n in enumerate([50, 3, 20, 1])}
    views = sample_views(groups, 12)
    assert views == sample_views(dict(reversed(groups.items())), 12)  # order of the input does not matter
    per = {b: sum(v[0] == b for v in views) for b in groups}
    assert len(views) == 12 and len(set(views)) == 12
    assert per == {"b0": 4, "b1": 3, "b2": 4, "b3": 1}  # small buildings give all they have, the rest share
    assert len(sample_views(groups, None)) == 74
    many = {f"b{k:03d}": ["point_0_view_0", "point_1_view_0", "point_2_view_0"] for k in range(100)}
    few = sample_views(many, 10)
    assert len(few) == 10 and len({b for b, _ in few}) == 10  # one view from each of 10 spread buildings
    assert few[0][0] == "b000" and few[-1][0] == "b099" and all(s == "point_1_view_0" for _, s in few)


# ------------------------------------------------------------------------------- a tree in real encodings
def _population(n: int, parts: list[tuple[float, np.ndarray]], rest: np.ndarray) -> np.ndarray:
    """`n` values: each part takes round(share·n) values spread over its array, the rest the remainder."""
    out = []
    for share, values in parts:
        k = int(round(share * n))
        out.append(values[np.linspace(0, len(values) - 1, k).round().astype(int)] if k else values[:0])
    k = n - sum(len(o) for o in out)
    out.append(rest[np.linspace(0, len(rest) - 1, k).round().astype(int)])
    return np.concatenate(out)


def _spread(values: np.ndarray, valid: np.ndarray, fill, rng: np.random.Generator) -> np.ndarray:
    """An image holding `values` (shuffled) on the valid pixels and `fill` elsewhere."""
    shape = valid.shape + np.shape(values)[1:]
    img = np.empty(shape, dtype=values.dtype)
    img[...] = fill
    img[valid] = values[rng.permutation(len(values))]
    return img


def _real_like_view(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every domain of one view, in Taskonomy's encodings, with statistics like the real files'."""
    valid = np.ones((SIZE, SIZE), dtype=bool)
    r0, c0 = rng.integers(0, SIZE - 9, size=2)
    valid[r0: r0 + 8, c0: c0 + 9] = False  # a window: 72 px = 7 % masked
    nv, n = int(valid.sum()), SIZE * SIZE
    u = (np.arange(nv) + 0.5) / nv
    metres = 0.9 - 2.0 * np.log1p(-u)  # exponential: mean 2.9 m, std 2.0 m
    z = np.sort(rng.standard_normal(4096))
    every = np.ones((SIZE, SIZE), dtype=bool)
    views: dict[str, np.ndarray] = {}
    views["depth_zbuffer"] = _spread(np.round(metres * 512).astype(np.uint16), valid, 65535, rng)
    views["depth_euclidean"] = np.where(valid, np.minimum(views["depth_zbuffer"] * 1.1, 65534), 65535).astype(np.uint16)
    units = np.array([[0, 1, 0]] * 2 + [[0, -1, 0]] + [[0, 0, -1]] * 3 + [[0.8, 0, -0.6]] * 2 + [[-0.8, 0, -0.6]] * 2)
    normals = units[np.arange(nv) % len(units)]
    views["normal"] = _spread(np.clip(np.round((normals + 1) * 127.5), 0, 255).astype(np.uint8), valid, 128, rng)
    curv = np.stack([_population(nv, [], np.clip(np.round(127 + 38 * z), 0, 255)),
                     _population(nv, [], np.clip(np.round(127 + 11 * z), 0, 255))[rng.permutation(nv)],
                     np.zeros(nv)], axis=1).astype(np.uint8)
    views["principal_curvature"] = _spread(curv, valid, 0, rng)
    shade = _population(nv, [], np.arange(2, 201)).astype(np.uint8)
    views["reshading"] = np.repeat(_spread(shade, valid, 10, rng)[..., None], 3, axis=2)
    views["edge_texture"] = _spread(_population(n, [(0.02, np.array([6000]))], np.arange(0, 1797)).astype(np.uint16),
                                    every, 0, rng)
    occ = _population(nv, [(0.03, np.array([0])), (0.015, np.array([1100])), (0.008, np.array([2200]))],
                      np.arange(1, 61))
    views["edge_occlusion"] = _spread(occ.astype(np.uint16), valid, 0, rng)
    kp2 = _population(n, [(0.045, np.array([0])), (0.04, np.linspace(330, 1300, 40).round())], np.arange(1, 104))
    views["keypoints2d"] = _spread(kp2.astype(np.uint16), every, 0, rng)
    views["keypoints3d"] = _spread(_population(nv, [(0.5, np.array([0]))], np.arange(1, 18401)).astype(np.uint16),
                                   valid, 0, rng)
    ids = np.round(np.linspace(0, 255, 40)).astype(np.uint8)
    seg = ids[np.arange(n) * 40 // n].reshape(SIZE, SIZE)
    views["segment_unsup2d"] = seg
    views["segment_unsup25d"] = seg.T.copy()
    views["class_object"] = (np.exp(-np.arange(1000) / 20.0) / np.exp(-np.arange(1000) / 20.0).sum())[
        rng.permutation(1000)].astype(np.float32)
    views["class_scene"] = np.log(np.exp(-np.arange(365) / 8.0) + 1e-6).astype(np.float32)  # logits
    views["rgb"] = rng.integers(0, 256, size=(SIZE, SIZE, 3), dtype=np.uint8)
    return views


def _write(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, arr)
    else:
        Image.fromarray(arr).save(path)


def write_real_like_tree(root: Path, flat: bool = False, csv: bool = True) -> Path:
    """A small Taskonomy tree in the real encodings (either layout, a CR-only split CSV)."""
    rng = np.random.default_rng(7)
    for b in BUILDINGS:
        for p in range(VIEWS):
            for domain, arr in _real_like_view(rng).items():
                ext = ".npy" if domain.startswith("class") else ".png"
                folder = root / domain / b if flat else root / domain / "taskonomy" / b
                _write(folder / f"point_{p}_view_0_domain_{domain}{ext}", arr)
    if csv:
        rows = ["id,train,val,test", "alpha,1,0,0", "bravo,1,0,0", "charlie,0,1,0", "delta,0,0,1"]  # no delta
        (root / "train_val_test_tiny.csv").write_bytes("\r".join(rows).encode())
    return root


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory) -> Path:
    return write_real_like_tree(tmp_path_factory.mktemp("real_tree"))


def test_real_like_tree_is_inside_every_range(real_tree):
    result = dataset_stats(real_tree, max_images=None)
    assert result.views == len(BUILDINGS) * VIEWS and result.buildings == len(BUILDINGS)
    assert not result.absent and not result.corrupt
    assert not result.outside, result.table()
    assert set(result.domains) == {"rgb", VALID, *TASK_NAMES}
    assert result.domains["rgb"].files == len(BUILDINGS) * VIEWS  # every image opened (issue 22, item 6)
    referenced = [s for ds in result.domains.values() for s in ds.stats if s.reference is not None]
    assert len(referenced) == sum(len(r) for r in REFERENCES.values())  # every reference was measured
    assert result.domains[VALID].get("masked_pct_mean") == pytest.approx(100 * 72 / 1024)
    assert result.domains["depth_zbuffer"].get("mean_m") == pytest.approx(2.9, abs=0.05)
    assert result.domains["segment_unsup2d"].get("ids_per_image_mean") == 40
    assert result.domains["class_scene"].get("logits_pct") == 100
    assert result.domains["class_object"].get("sums_to_1_pct") == 100


def test_a_planted_domain_is_flagged_and_strict_exits_1(tmp_path, load_tool, capsys):
    root = write_real_like_tree(tmp_path / "tree")
    for f in (root / "keypoints2d").rglob("*.png"):  # keypoints 20× too strong, as the renderer once drew them
        arr = np.asarray(Image.open(f)).astype(np.int64)
        Image.fromarray(np.minimum(arr * 20, 65535).astype(np.uint16)).save(f)
    result = dataset_stats(root, max_images=None)
    flagged = {(d, s.key, s.flag) for d, s in result.outside}
    assert ("keypoints2d", "code_mean", "HIGH") in flagged and ("keypoints2d", "view_max_median", "HIGH") in flagged
    assert {d for d, _, _ in flagged} == {"keypoints2d"}
    tool = load_tool("tools/make_data.py")
    out = tmp_path / "stats.json"
    assert tool.main(["stats", str(root), "--json", str(out)]) == 0  # flags alone are reported, not failures
    text = capsys.readouterr().out
    assert "== keypoints2d" in text and "HIGH" in text and "outside the real ranges: keypoints2d code_mean" in text
    saved = json.loads(out.read_text())
    assert "keypoints2d: code_mean" in saved["outside"]
    row = next(s for s in saved["domains"]["keypoints2d"]["stats"] if s["key"] == "code_mean")
    assert row["flag"] == "HIGH" and row["real"] == [71, 92] and row["source"]
    assert tool.main(["stats", str(root), "--strict"]) == 1
    assert tool.main(["stats", str(root), "--strict", "--domains", "depth", "normal"]) == 0


def test_missing_domains_and_corrupt_files_are_reported(tmp_path, load_tool, capsys):
    root = write_real_like_tree(tmp_path / "tree", flat=True)
    import shutil

    shutil.rmtree(root / "edge_texture")
    bad = root / "reshading" / "bravo" / "point_1_view_0_domain_reshading.png"
    bad.write_bytes(bad.read_bytes()[:60])  # truncated
    result = dataset_stats(root, max_images=None)
    assert result.absent == ["edge_texture"]
    assert result.domains["reshading"].files == len(BUILDINGS) * VIEWS - 1
    assert len(result.corrupt) == 1 and str(bad) in result.corrupt[0]
    assert "{domain}/{building}" in result.source
    tool = load_tool("tools/make_data.py")
    assert tool.main(["stats", str(root), "--max-images", "5"]) == 0
    text = capsys.readouterr().out
    assert "absent domains (not in this dataset): edge_texture" in text
    assert "5 views from 3 buildings" in text
    assert tool.main(["stats", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert tool.main(["stats", str(root), "--domains", "nonsense"]) == 2


def test_splits_and_both_layouts_agree(real_tree, tmp_path):
    flat = write_real_like_tree(tmp_path / "flat", flat=True)  # the same bytes in the other layout
    a, b = dataset_stats(real_tree, max_images=None), dataset_stats(flat, max_images=None)
    assert "{domain}/taskonomy/{building}" in a.source and "{domain}/{building}" in b.source
    assert a.to_dict()["domains"] == b.to_dict()["domains"]
    val = dataset_stats(real_tree, max_images=None, split="val")
    assert (val.views, val.buildings) == (VIEWS, 1) and "train_val_test_tiny.csv" in val.split
    every = dataset_stats(real_tree, max_images=None, split="all")
    assert every.views == len(BUILDINGS) * VIEWS and every.buildings_not_found == ["delta"]
    assert "1 buildings of the split have no files here: delta" in every.table()
    tiny = dataset_stats(real_tree, max_images=None, split="tiny", partitions=["train"])
    assert (tiny.views, tiny.buildings) == (2 * VIEWS, 2) and not tiny.buildings_not_found
    with pytest.raises(ValueError, match="no views to read .* not here: delta"):
        dataset_stats(real_tree, split="test")  # its one building has no files
    with pytest.raises(ValueError, match="no split CSV"):
        dataset_stats(write_real_like_tree(tmp_path / "nocsv", csv=False), split="train")


def test_stats_on_packed_shards_equal_the_tree(real_tree, tmp_path, load_tool, capsys):
    tool = load_tool("tools/make_data.py")
    shards = tmp_path / "shards"
    assert tool.main(["pack", "--src", str(real_tree), "--out", str(shards), "--image-size", "0",
                      "--workers", "0"]) == 0
    capsys.readouterr()
    packed = dataset_stats(shards, max_images=None)
    tree = dataset_stats(real_tree, max_images=None, split="all")
    assert "HDF5 shards" in packed.source and packed.views == tree.views
    assert packed.to_dict()["domains"] == tree.to_dict()["domains"]  # the stored arrays are the files' own
    assert not packed.outside
    val = dataset_stats(shards, max_images=None, split="val")
    assert val.views == VIEWS
    with pytest.raises(ValueError, match="split when packed"):
        dataset_stats(shards, split="tiny")
    assert tool.main(["stats", str(shards), "--strict", "--max-images", "4"]) == 0
    assert "4 views from" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- the acceptance test
@pytest.mark.slow
def test_synthetic_renderer_is_inside_the_real_ranges(tmp_path):
    """The issue's acceptance test: every domain of the synthetic Taskonomy inside the real files' ranges."""
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path / "synthetic"
    render_dataset(root, n=80, image_size=64, seed=0, workers=1)
    result = dataset_stats(root, max_images=None)
    assert result.views == 80 and not result.corrupt and not result.absent
    assert not result.outside, "synthetic statistics outside the real ranges:\n" + result.table()


def test_stats_open_every_rgb_image(tmp_path, load_tool, capsys):
    """A truncated or empty rgb image is named (issue 22, item 6): the reader and pack would refuse it."""
    root = write_real_like_tree(tmp_path / "tree", flat=True)
    cut = root / "rgb" / "alpha" / "point_0_view_0_domain_rgb.png"
    cut.write_bytes(cut.read_bytes()[:60])
    empty = root / "rgb" / "bravo" / "point_1_view_0_domain_rgb.png"
    empty.write_bytes(b"")
    result = dataset_stats(root, max_images=None)
    rgb = result.domains["rgb"]
    assert rgb.files == len(BUILDINGS) * VIEWS - 2 and len(rgb.corrupt) == 2
    assert str(cut) in rgb.corrupt[0] and str(empty) in rgb.corrupt[1]
    assert load_tool("tools/make_data.py").main(["stats", str(root), "--max-images", "0"]) == 0
    text = capsys.readouterr().out
    assert "== rgb (10 files, 2 corrupt)" in text and f"corrupt: {cut}" in text and f"corrupt: {empty}" in text
