"""The Taskonomy PNG-tree reader: layouts, CR-only split CSVs, augmentation, corrupt files, loaders."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

from squad.data import (
    TaskonomyDataset,
    build_dataset,
    build_loader,
    collate,
    find_split_csv,
    read_split_csv,
    set_epoch,
)
from squad.data.offline.random_tree import write_random_tree
from squad.data.transforms import resize_raw
from squad.tasks import TASK_NAMES, get_task


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """12 samples at 32 px in the official layout, 3 buildings, all domains (written once for the module)."""
    return write_random_tree(tmp_path_factory.mktemp("tree") / "taskonomy", n=12, size=32, buildings=3, seed=1)


def write_png(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_split_csv_cr_only(tmp_path):
    (tmp_path / "train_val_test_tiny.csv").write_bytes(b"id,train,val,test\rallensville,1,0,0\rbeechwood,0,1,0\r"
                                                       b"coffeen,0,0,1\rdarden,1,0,0\r")
    table = read_split_csv(tmp_path / "train_val_test_tiny.csv")
    assert table == {"train": ["allensville", "darden"], "val": ["beechwood"], "test": ["coffeen"]}
    assert find_split_csv(tmp_path) == tmp_path / "train_val_test_tiny.csv"
    assert find_split_csv(tmp_path, "tiny") == tmp_path / "train_val_test_tiny.csv"
    (tmp_path / "train_val_test_medium.csv").write_bytes(b"id,train,val,test\r\nx,1,0,0\r\n")
    assert read_split_csv(tmp_path / "train_val_test_medium.csv")["train"] == ["x"]
    with pytest.raises(ValueError, match="several split CSVs"):
        find_split_csv(tmp_path)
    with pytest.raises(FileNotFoundError):
        find_split_csv(tmp_path, "full")
    (tmp_path / "bad.csv").write_bytes(b"id,train,val,test\rx,1,2,0\r")
    with pytest.raises(ValueError, match="bad.csv:2"):
        read_split_csv(tmp_path / "bad.csv")


def test_sample_format_and_splits(tree):
    ds = TaskonomyDataset(tree, "all", split="train")
    assert len(ds) == 12 and ds.tasks == list(TASK_NAMES)
    s = ds[0]
    assert set(s) == {"rgb", "targets", "masks", "id"}
    assert s["rgb"].shape == (3, 32, 32) and s["rgb"].dtype == torch.float32 and 0 <= s["rgb"].min() <= 1
    assert s["id"] == ds.ids[0] and "/point_" in s["id"]
    for name in TASK_NAMES:
        task = get_task(name)
        shape = (task.channels,) if task.head_kind == "class" else (task.channels, 32, 32)
        mshape = (1,) if task.head_kind == "class" else (1, 32, 32)
        assert s["targets"][name].shape == shape and s["masks"][name].shape == mshape
        assert s["masks"][name].dtype == torch.bool
    batch = collate([ds[0], ds[1]])
    assert batch["rgb"].shape == (2, 3, 32, 32) and batch["targets"]["normal"].shape == (2, 3, 32, 32)
    assert batch["masks"]["class_scene"].shape == (2, 1) and batch["id"] == ds.ids[:2]
    two = TaskonomyDataset(tree, ["depth"], buildings=["b0", "b2"])
    assert len(two) == 8 and {i.split("/")[0] for i in two.ids} == {"b0", "b2"}
    with pytest.raises(ValueError, match="no samples"):
        TaskonomyDataset(tree, ["depth"], split="val")


def test_both_layouts_give_identical_samples(tmp_path):
    official = write_random_tree(tmp_path / "a", n=4, size=16, buildings=2, seed=3, layout="official")
    flat = write_random_tree(tmp_path / "b", n=4, size=16, buildings=2, seed=3, layout="flat")
    assert (official / "rgb" / "taskonomy" / "b0").is_dir() and (flat / "rgb" / "b0").is_dir()
    a = TaskonomyDataset(official, "all")
    b = TaskonomyDataset(flat, "all")
    assert a.ids == b.ids
    for i in range(len(a)):
        sa, sb = a[i], b[i]
        assert torch.equal(sa["rgb"], sb["rgb"])
        for name in TASK_NAMES:
            assert torch.equal(sa["targets"][name], sb["targets"][name])


def test_flip_keeps_normals_consistent(tree):
    plain = TaskonomyDataset(tree, ["normal", "depth"])
    aug = TaskonomyDataset(tree, ["normal", "depth"], augment=True, seed=7)
    flipped = unflipped = 0
    for i in range(len(plain)):
        p, a = plain[i], aug[i]
        if torch.equal(a["rgb"], p["rgb"]):
            unflipped += 1
            assert torch.equal(a["targets"]["normal"], p["targets"]["normal"])
            continue
        assert torch.equal(a["rgb"], torch.flip(p["rgb"], dims=(-1,)))
        flipped += 1
        n_p, n_a = p["targets"]["normal"], a["targets"]["normal"]
        assert torch.equal(n_a[0], -torch.flip(n_p[0], dims=(-1,)))
        assert torch.equal(n_a[1:], torch.flip(n_p[1:], dims=(-1,)))
        assert torch.equal(a["masks"]["normal"], torch.flip(p["masks"]["normal"], dims=(-1,)))
        assert torch.equal(a["targets"]["depth_euclidean"], torch.flip(p["targets"]["depth_euclidean"], dims=(-1,)))
    assert flipped and unflipped
    again = TaskonomyDataset(tree, ["normal", "depth"], augment=True, seed=7)
    assert all(torch.equal(again[i]["rgb"], aug[i]["rgb"]) for i in range(len(aug)))
    aug.set_epoch(1)
    assert any(not torch.equal(again[i]["rgb"], aug[i]["rgb"]) for i in range(len(aug)))


def test_resize_and_crop(tree):
    ds = TaskonomyDataset(tree, ["depth", "segment2d"], image_size=12, resize=16, augment=True, seed=0)
    s = ds[0]
    assert s["rgb"].shape == (3, 12, 12) and s["targets"]["depth_euclidean"].shape == (1, 12, 12)
    ids = s["targets"]["segment_unsup2d"]
    original = TaskonomyDataset(tree, ["segment2d"])[0]["targets"]["segment_unsup2d"]
    assert set(ids.unique().tolist()) <= set(original.unique().tolist())  # nearest neighbour: no blended ids
    with pytest.raises(ValueError, match="resize"):
        TaskonomyDataset(tree, ["depth"], image_size=16, resize=8)


def test_mask_aware_resize_keeps_invalid_depth_out():
    code = np.full((8, 8), 1024, np.uint16)  # 2 m everywhere ...
    code[:, :4] = 65535  # ... but the left half has no geometry
    task = get_task("depth")
    small = resize_raw(code, (4, 4), "bilinear", task.raw_valid(code), task.raw_fill)
    value, mask = task.decode(small)
    assert mask[0, :, :2].sum() == 0 and bool(mask[0, :, 2:].all())
    assert torch.allclose(value[0, :, 2:], torch.full((4, 2), 2.0))


def test_geometry_mask_from_zbuffer(tmp_path):
    root = write_random_tree(tmp_path / "t", n=2, size=16, buildings=1, seed=0)
    z = np.full((16, 16), 1000, np.uint16)
    z[:, :5] = 65535
    write_png(root / "depth_zbuffer" / "taskonomy" / "b0" / "point_0_view_0_domain_depth_zbuffer.png", z)
    ds = TaskonomyDataset(root, ["normal", "edge2d"], buildings=["b0"])
    i = ds.ids.index("b0/point_0_view_0")
    s = ds[i]
    assert not s["masks"]["normal"][0, :, :5].any()  # geometric task: masked where there is no geometry
    assert bool(s["masks"]["edge_texture"].all())  # texture edges exist without geometry
    off = TaskonomyDataset(root, ["normal"], buildings=["b0"], geometry_mask=False)[i]
    assert off["masks"]["normal"][0, :, :5].any()


def test_corrupt_png_is_skipped_counted_and_warned_once(tmp_path, caplog):
    root = write_random_tree(tmp_path / "t", n=6, size=16, buildings=1, seed=0)
    ds0 = TaskonomyDataset(root, ["depth", "normal"])
    bad_rgb = ds0.path(1, "rgb")
    bad_rgb.write_bytes(bad_rgb.read_bytes()[:60])  # truncated
    bad_normal = ds0.path(3, "normal")
    bad_normal.write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    ds = TaskonomyDataset(root, ["depth", "normal"])
    with caplog.at_level(logging.WARNING, logger="squad.data.taskonomy"):
        samples = [ds[i] for i in range(len(ds))]
    assert len(samples) == 6  # the epoch goes on at full length
    assert samples[1]["id"] == ds.ids[2] and samples[3]["id"] == ds.ids[4]  # skipped → next sample
    assert ds.num_corrupt == 2
    warnings = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 1 and str(bad_rgb) in warnings[0].getMessage()
    masked = TaskonomyDataset(root, ["depth", "normal"], missing="mask")
    s = masked[3]
    assert s["id"] == masked.ids[3] and not s["masks"]["normal"].any() and s["masks"]["depth_euclidean"].any()


def test_missing_domain_skip_or_mask(tmp_path):
    root = write_random_tree(tmp_path / "t", n=4, size=16, buildings=1, seed=0)
    (root / "keypoints2d" / "taskonomy" / "b0" / "point_1_view_1_domain_keypoints2d.png").unlink()
    assert len(TaskonomyDataset(root, ["keypoints2d"])) == 3
    ds = TaskonomyDataset(root, ["keypoints2d"], missing="mask")
    assert len(ds) == 4
    s = ds[ds.ids.index("b0/point_1_view_1")]
    assert not s["masks"]["keypoints2d"].any() and s["targets"]["keypoints2d"].shape == (1, 16, 16)


def test_missing_root_says_how_to_make_data(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_data.py synthetic --out"):
        build_dataset(tmp_path / "nothing", "all")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="rgb"):
        TaskonomyDataset(tmp_path / "empty", "all", split="all")


def test_distributed_sampler_with_workers_is_deterministic(tree):
    ds = TaskonomyDataset(tree, ["normal", "scene"], augment=True, seed=3)

    def run(rank: int) -> list[torch.Tensor]:
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        loader = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, collate_fn=collate)
        return [(b["id"], b["rgb"], b["targets"]["normal"]) for b in loader]

    r0, r1 = run(0), run(1)
    ids0 = [i for ids, _, _ in r0 for i in ids]
    ids1 = [i for ids, _, _ in r1 for i in ids]
    assert sorted(ids0 + ids1) == sorted(ds.ids)
    again = run(0)
    for (ia, ra, na), (ib, rb, nb) in zip(r0, again, strict=True):
        assert ia == ib and torch.equal(ra, rb) and torch.equal(na, nb)
    single = {ds.ids[i]: ds[i]["rgb"] for i in range(len(ds))}
    for ids, rgb, _ in r0:  # a sample is the same whichever worker or rank loads it
        for k, sid in enumerate(ids):
            assert torch.equal(rgb[k], single[sid])


def test_build_loader_and_set_epoch(tree):
    ds = build_dataset(tree, ["depth"], "train", augment=True)
    loader = build_loader(ds, batch_size=4, num_workers=0, seed=1)
    set_epoch(loader, 0)
    first = [b["id"] for b in loader]
    set_epoch(loader, 0)
    assert [b["id"] for b in loader] == first and len(first) == 3
    set_epoch(loader, 1)
    second = [b["id"] for b in loader]
    assert second != first and ds.epoch == 1
    set_epoch(loader, 1, skip_batches=1)  # a resume one batch into epoch 1 continues its order
    assert [b["id"] for b in loader] == second[1:]
    ranks = [build_loader(ds, batch_size=2, seed=1, rank=r, world=2) for r in (0, 1)]
    for r in ranks:
        set_epoch(r, 0)
    shares = [[i for b in r for i in b["id"]] for r in ranks]
    assert not set(shares[0]) & set(shares[1])  # each rank its own share of the epoch
