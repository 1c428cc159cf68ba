"""HDF5 shards: packing a tree, identical samples, lazy per-process files, corrupt files, the factory."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import h5py
import pytest
import torch
from torch.utils.data import DataLoader

from squad.data import INDEX_NAME, ShardDataset, TaskonomyDataset, build_dataset, collate
from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.tasks import TASK_NAMES

REPO = Path(__file__).resolve().parents[1]


def assert_same_sample(a: dict, b: dict) -> None:
    assert a["id"] == b["id"]
    assert torch.equal(a["rgb"], b["rgb"])
    assert list(a["targets"]) == list(b["targets"])
    for name in a["targets"]:
        assert torch.equal(a["targets"][name], b["targets"][name]), name
        assert torch.equal(a["masks"][name], b["masks"][name]), name


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A 32 px tree of 10 samples with a train/val split, packed at 16 px in shards of 4."""
    base = tmp_path_factory.mktemp("h5")
    tree = write_random_tree(base / "tree", n=10, size=32, buildings=2, seed=2)
    (tree / "train_val_test_random.csv").write_bytes(b"id,train,val,test\rb0,1,0,0\rb1,0,1,0\r")
    pack_shards(tree, base / "shards", image_size=16, shard_size=4, workers=0)
    return tree, base / "shards"


def test_index_and_layout(packed):
    _, shards = packed
    index = json.loads((shards / INDEX_NAME).read_text())
    assert index["image_size"] == 16 and index["domains"] == ["rgb", *TASK_NAMES]
    assert [(s["split"], s["n"]) for s in index["shards"]] == [("train", 4), ("train", 1), ("val", 4), ("val", 1)]
    with h5py.File(shards / index["shards"][0]["file"], "r") as f:
        assert f["rgb"].shape == (4, 16, 16, 3) and f["rgb"].chunks == (1, 16, 16, 3)
        assert f["depth_euclidean"].dtype == "uint16" and f["reshading"].shape == (4, 16, 16)  # one channel kept
        assert f["principal_curvature"].shape == (4, 16, 16, 2) and f["class_object"].shape == (4, 1000)
        assert f["present"].shape == (4, 14) and bool(f["present"][...].all())


@pytest.mark.parametrize("split", ["train", "val", "all"])
def test_shard_samples_equal_png_samples(packed, split):
    tree, shards = packed
    png = TaskonomyDataset(tree, "all", split=split, image_size=16)
    h5 = ShardDataset(shards, "all", split=split)
    assert h5.ids == png.ids and len(h5) == (10 if split == "all" else 5)
    for i in range(len(png)):
        assert_same_sample(png[i], h5[i])


def test_shard_samples_equal_with_augmentation_and_crop(packed):
    tree, shards = packed
    png = TaskonomyDataset(tree, ["normal", "depth", "object"], image_size=12, resize=16, augment=True, seed=4)
    h5 = ShardDataset(shards, ["normal", "depth", "object"], image_size=12, resize=16, augment=True, seed=4)
    for epoch in (0, 1):
        png.set_epoch(epoch)
        h5.set_epoch(epoch)
        for i in range(len(png)):
            assert_same_sample(png[i], h5[i])


def test_factory_picks_the_format(packed):
    tree, shards = packed
    assert isinstance(build_dataset(shards, ["depth"], "train", split_csv="ignored"), ShardDataset)
    assert isinstance(build_dataset(tree, ["depth"], "train"), TaskonomyDataset)


def test_lazy_files_and_workers(packed):
    _, shards = packed
    ds = ShardDataset(shards, ["normal", "scene"], split="all")
    ds[0]  # opens handles in this process
    clone = pickle.loads(pickle.dumps(ds))  # handles are not pickled
    assert clone._handles == {}
    assert_same_sample(clone[3], ds[3])
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
    ids = [i for batch in loader for i in batch["id"]]
    assert ids == ds.ids


def test_corrupt_file_when_packing(tmp_path):
    tree = write_random_tree(tmp_path / "tree", n=4, size=16, buildings=1, seed=0)
    ref = TaskonomyDataset(tree, ["edge2d"])
    bad = ref.path(2, "edge_texture")
    bad.write_bytes(bad.read_bytes()[:50])
    pack_shards(tree, tmp_path / "shards", image_size=16, workers=0)
    index = json.loads((tmp_path / "shards" / INDEX_NAME).read_text())
    assert index["corrupt"] == 1
    skip = ShardDataset(tmp_path / "shards", ["edge2d"])
    assert len(skip) == 3 and ref.ids[2] not in skip.ids
    mask = ShardDataset(tmp_path / "shards", ["edge2d", "depth"], missing="mask")
    s = mask[mask.ids.index(ref.ids[2])]
    assert not s["masks"]["edge_texture"].any() and s["masks"]["depth_euclidean"].any()


def test_errors(tmp_path, packed):
    _, shards = packed
    with pytest.raises(FileNotFoundError, match="make_data.py"):
        ShardDataset(tmp_path, ["depth"])
    with pytest.raises(ValueError, match="packed splits"):
        ShardDataset(shards, ["depth"], split="test")


def test_make_data_pack_cli(tmp_path, load_tool, capsys):
    tool = load_tool("tools/make_data.py")
    tree = write_random_tree(tmp_path / "tree", n=3, size=16, buildings=1, seed=0)
    out = tmp_path / "shards"
    assert tool.main(["pack", "--src", str(tree), "--split", "random", "--out", str(out), "--image-size", "8",
                      "--workers", "0"]) == 0
    assert "train" in capsys.readouterr().out
    assert ShardDataset(out, "all")[0]["rgb"].shape == (3, 8, 8)
    assert tool.main(["pack", "--src", str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "make_data.py synthetic" in capsys.readouterr().err
