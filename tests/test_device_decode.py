"""Integer training batches (`squad.data.device`): the targets every task sees equal the per-sample pipeline's, domain
by domain with augmentation on (PNG tree with a resize, shards without, missing files); the read-sized epoch order
(`squad.data.samplers.block_order`) covers every sample once over ranks and resumes mid-epoch; the loader's workers."""

from __future__ import annotations

import pytest
import torch

from squad.data import ShardDataset, TaskonomyDataset, build_loader, collate, set_epoch
from squad.data.device import collate_integers, decode_batch, is_integer_batch, unpack
from squad.data.loaders import MAX_AUTO_WORKERS, loader_workers
from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.data.samplers import ResumableSampler, block_order
from squad.tasks import TASK_NAMES

OPTS = {"split": "all", "image_size": 24, "resize": 32, "augment": True, "seed": 3}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A 40 px tree of 12 samples (depth holes: the geometry masks matter), shards packed from it at 32 px, and a
    copy of the tree lacking a normal and a class_scene file."""
    base = tmp_path_factory.mktemp("device")
    tree = write_random_tree(base / "tree", n=12, size=40, seed=5)
    pack_shards(tree, base / "shards", image_size=32, partitions=("train",), workers=0)
    holes = write_random_tree(base / "holes", n=12, size=40, seed=5)
    for domain in ("normal", "class_scene"):
        next(iter(sorted((holes / domain).rglob("*.*")))).unlink()
    return {"tree": tree, "shards": base / "shards", "holes": holes}


def datasets(data):
    yield "tree, resized", TaskonomyDataset(data["tree"], "all", **OPTS)
    yield "shards, stored size", ShardDataset(data["shards"], "all", **OPTS)
    yield "shards, resized", ShardDataset(data["shards"], "all", **{**OPTS, "resize": 28})
    yield "tree, missing files", TaskonomyDataset(data["holes"], "all", missing="mask", **OPTS)


def test_integer_batches_decode_to_the_per_sample_targets(data):
    for what, ds in datasets(data):
        for epoch in (0, 1):
            ds.set_epoch(epoch)
            idx = list(range(len(ds)))
            ref = collate([ds[i] for i in idx])  # the per-sample pipeline, the reference
            ds.integer_batches = True
            batch = collate_integers(ds.__getitems__(idx))
            ds.integer_batches = False
            flips = unpack(batch)["flip"]
            assert is_integer_batch(batch) and flips.any() and not flips.all(), what
            rgb, targets, masks = decode_batch(batch, ds.pipeline)
            assert batch["id"] == ref["id"]
            torch.testing.assert_close(rgb, ref["rgb"], rtol=0, atol=0)
            assert list(targets) == list(ref["targets"]) == list(TASK_NAMES), what
            for t in TASK_NAMES:
                assert targets[t].dtype == ref["targets"][t].dtype and masks[t].dtype == torch.bool
                torch.testing.assert_close(targets[t], ref["targets"][t], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, t=t, what=what: f"{what}, {t}: {m}")
                assert torch.equal(masks[t], ref["masks"][t]), f"{what}, {t}: masks differ"
        geometric = ref["masks"]["depth_zbuffer"]
        assert not geometric.all() and geometric.any(), "the data must have holes in its geometry"
        if what.endswith("missing files"):
            assert not ref["masks"]["class_scene"].all() and not ref["masks"]["normal"].flatten(1).any(1).all()


def test_block_order_is_a_permutation_of_shuffled_blocks():
    order = block_order(1000, 64, 4, seed=7)
    assert sorted(order.tolist()) == list(range(1000))
    starts = [0]
    while starts[-1] < 1000:  # each window holds 4 whole blocks: a batch reads a few contiguous runs
        blocks = set()
        for i in order[starts[-1]:].tolist():
            if len(blocks | {i // 64}) > 4:
                break
            blocks.add(i // 64)
        size = sum(min(64, 1000 - 64 * k) for k in blocks)
        assert set((order[starts[-1]:starts[-1] + size] // 64).tolist()) == blocks
        starts.append(starts[-1] + size)
    assert len(starts) == 5
    assert not torch.equal(order, block_order(1000, 64, 4, seed=8))
    assert torch.equal(order, block_order(1000, 64, 4, seed=7))


def test_block_order_covers_each_sample_once_over_ranks_and_resumes():
    n, b = 500, 8
    one = ResumableSampler(n, b, 1, 0, grad_accum=2, seed=1, block=16, buffer=4)
    ranks = [ResumableSampler(n, b, 2, r, seed=1, block=16, buffer=4) for r in range(2)]
    for epoch in (0, 3):
        for s in (one, *ranks):
            s.set_epoch(epoch)
        seen = [list(r) for r in ranks]
        assert not set(seen[0]) & set(seen[1])  # exactly once over the ranks
        assert len(seen[0]) + len(seen[1]) == n // (2 * b) * 2 * b
        # one rank with two micro-batches sees the same global batches as two ranks with one each
        single = list(one)
        for j in range(len(seen[0]) // b):
            assert sorted(single[2 * j * b:(2 * j + 2) * b]) == sorted(seen[0][j * b:(j + 1) * b]
                                                                        + seen[1][j * b:(j + 1) * b])
        ranks[1].skip = 5  # a resume mid-epoch continues exactly where the run stopped
        assert list(ranks[1]) == seen[1][5 * b:]


def test_loader_workers():
    assert loader_workers(3) == 3 and loader_workers(0) == 0
    auto = loader_workers(None)
    assert 1 <= auto <= MAX_AUTO_WORKERS
    assert loader_workers(None, ranks_per_node=10_000) == 1


def test_training_loader_yields_integer_batches_from_a_worker(data):
    ds = ShardDataset(data["shards"], "all", **OPTS)
    loader = build_loader(ds, 4, seed=0, num_workers=1, block=4, buffer=2)
    assert loader.persistent_workers and loader.prefetch_factor == 4
    set_epoch(loader, 1)
    batches = list(loader)
    assert len(batches) == 3 and all(is_integer_batch(b) for b in batches)
    assert sorted(i for b in batches for i in b["id"]) == sorted(ds.ids)
    assert all(b["cpu_s"] > 0 for b in batches)
    ds.integer_batches = False
    first = batches[0]
    ref = collate([ds[ds.ids.index(i)] for i in first["id"]])
    rgb, targets, masks = decode_batch(first, ds.pipeline)
    torch.testing.assert_close(rgb, ref["rgb"])
    for t in TASK_NAMES:
        torch.testing.assert_close(targets[t], ref["targets"][t], rtol=1e-5, atol=1e-6)
        assert torch.equal(masks[t], ref["masks"][t])
    set_epoch(loader, 2)  # the persistent worker draws epoch 2's crops and flips, not those it started with
    later = {i: (c.tolist(), f.item()) for b in loader
             for i, c, f in zip(b["id"], unpack(b)["crop"], unpack(b)["flip"], strict=True)}
    fresh = ShardDataset(data["shards"], "all", **OPTS)
    fresh.set_epoch(2)
    fresh.integer_batches = True
    want = {s["id"]: (list(s["crop"]), s["flip"]) for s in fresh.__getitems__(list(range(len(fresh))))}
    assert later == want
    plain = build_loader(ds, 4, device_decode=False)
    assert not is_integer_batch(next(iter(plain)))
