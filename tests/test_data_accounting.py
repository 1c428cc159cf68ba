"""Data accounting (issue 10, item 10): every unusable file counted once per file — across re-reads and DataLoader
workers — by kind (corrupt, wrong size, missing); evaluation leaves bad samples out instead of scoring a neighbour
twice; wrong-size files are refused, never stretched; and every run and tool ends with the summary line."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from squad.data import TaskonomyDataset, build_dataset, collate, eval_loader, report
from squad.data.accounting import track
from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.eval.evaluate import evaluate


@pytest.fixture()
def damaged(tmp_path):
    """8 samples at 16 px, 1 building: one truncated rgb, one non-square (16×12) rgb, one depth file deleted."""
    root = write_random_tree(tmp_path / "t", n=8, size=16, buildings=1, seed=0)
    ds = TaskonomyDataset(root, ["depth"])
    ids = ds.ids
    bad = ds.path(1, "rgb")
    bad.write_bytes(bad.read_bytes()[:60])
    skew = ds.path(3, "rgb")
    Image.fromarray(np.asarray(Image.open(skew))[:, :12]).save(skew)  # 16 × 12: would be stretched to a square
    ds.path(5, "depth_euclidean").unlink()
    return root, ids


def test_each_kind_counted_once_per_file(damaged, caplog):
    root, ids = damaged
    with caplog.at_level(logging.WARNING, logger="squad.data"):
        ds = TaskonomyDataset(root, ["depth"], image_size=16)
    assert len(ds) == 7 and ids[5] not in ds.ids  # the sample lacking its depth file is left out ...
    assert ds.missing_files == 1 and ds.unindexed == 1  # ... and counted, with a warning naming it
    assert any("missing" in r.getMessage() and ids[5] in r.getMessage() for r in caplog.records)
    for _ in range(3):  # three epochs: each bad file is still one file
        samples = [ds[i] for i in range(len(ds))]
    assert len(samples) == 7
    assert ds.num_corrupt == 1 and ds.num_wrong_size == 1
    r = report(ds, "train")
    assert (r.samples, r.corrupt, r.wrong_size, r.missing, r.unindexed) == (7, 1, 1, 1, 1)
    line = r.line()
    assert "1 corrupt file" in line and "1 wrong-size file" in line and "1 missing file" in line, line
    masked = TaskonomyDataset(root, ["depth"], image_size=16, missing="mask")
    assert len(masked) == 8 and masked.missing_files == 1 and masked.unindexed == 0


def test_wrong_size_is_refused_not_stretched(damaged):
    root, ids = damaged
    ds = TaskonomyDataset(root, ["depth"], image_size=16).without_substitutes()
    i = ds.ids.index(ids[3])
    assert ds[i] is None and ds.num_wrong_size == 1
    native = TaskonomyDataset(root, ["depth"], buildings=["b0"])  # no size asked: nothing is resized, so allowed?
    assert native.ids.index(ids[3]) >= 0
    # a square file of another size is resized (aspect kept), as documented
    small = TaskonomyDataset(root, ["depth"], image_size=8)
    ok = small[small.ids.index(ids[0])]
    assert ok["rgb"].shape == (3, 8, 8) and small.num_wrong_size == 0


def test_target_of_another_size_is_wrong_size(tmp_path):
    root = write_random_tree(tmp_path / "t", n=2, size=16, buildings=1, seed=0)
    ds = TaskonomyDataset(root, ["depth"], image_size=16)
    path = ds.path(0, "depth_euclidean")
    Image.fromarray(np.asarray(Image.open(path))[:8, :8]).save(path)  # square, but not the rgb's 16 × 16
    assert ds.without_substitutes()[0] is None and ds.num_wrong_size == 1 and ds.num_corrupt == 0
    masked = TaskonomyDataset(root, ["depth"], image_size=16, missing="mask")
    s = masked[0]
    assert not s["masks"]["depth_euclidean"].any() and masked.num_wrong_size == 1


def test_counted_once_across_workers(damaged):
    root, _ = damaged
    ds = TaskonomyDataset(root, ["depth"], image_size=16)
    for _ in range(2):  # two epochs, fresh workers each time
        loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=collate)
        assert sum(len(b["id"]) for b in loader) == len(ds)
    assert ds.num_corrupt == 1 and ds.num_wrong_size == 1  # the workers share the parent's record
    copy = pickle.loads(pickle.dumps(ds))  # plain pickling keeps the record
    assert copy.num_corrupt == 1 and copy.num_wrong_size == 1


def test_evaluation_skips_instead_of_duplicating(damaged):
    root, ids = damaged
    ds = TaskonomyDataset(root, ["depth"], image_size=16)
    for workers in (0, 2):
        loader = eval_loader(ds, batch_size=3, workers=workers)
        seen = [i for b in loader for i in b["id"]]
        assert len(seen) == len(set(seen)) == 5  # 7 indexed, 2 unusable: left out, none scored twice
        assert ids[1] not in seen and ids[3] not in seen
        assert seen == [i for i in ds.ids if i not in (ids[1], ids[3])]  # in order, whatever the workers
    assert ds[ds.ids.index(ids[0]) + 1]["id"] != ids[1]  # training still substitutes (the epoch keeps its length)

    class Mean(torch.nn.Module):
        task_names = ["depth_euclidean"]

        def forward(self, x, tasks):
            from types import SimpleNamespace

            return SimpleNamespace(preds={"depth_euclidean": x[:, :1] * 0}, stats=None)

    counts: dict = {}
    evaluate(Mean(), eval_loader(ds, 3), ["depth_euclidean"], counts=counts)
    assert counts["images"] == 5


def test_shards_count_missing_and_pack_counts_each_kind(damaged, tmp_path):
    root, ids = damaged
    index = json.loads(pack_shards(root, tmp_path / "s", split=None, image_size=16, workers=0,
                                   domains=["rgb", "depth_euclidean"]).read_text())
    assert (index["corrupt"], index["wrong_size"], index["missing"]) == (1, 1, 1)
    assert index["no_target"] == 1  # the sample whose one target (depth) is missing: nothing to learn, left out
    shards = build_dataset(tmp_path / "s", ["depth"], "all")
    assert len(shards) == 5 and shards.unindexed == 0  # the bad rgb files and the sample without a target were
    assert shards.missing_files == 0  # not packed (counted by pack)
    r = report(shards, "all")
    assert r.missing == 0 and r.corrupt == 0


def test_tools_print_the_summary_line(damaged, capsys):
    from squad.cli import run

    root, _ = damaged

    def body(argv):
        ds = build_dataset(root, ["depth"], "all", image_size=16)
        [ds[i] for i in range(len(ds))]
        build_dataset(root, ["depth"], "all", image_size=16)  # never read: not reported
        return 0

    assert run(body, []) == 0
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if x.startswith("[squad] data all")]
    assert len(lines) == 1 and "1 corrupt file" in lines[0] and "1 wrong-size file" in lines[0], err
    with track() as t:
        ds = build_dataset(root, ["depth"], "all", image_size=16)
        ds[0]
        report(ds, "all")  # reported by the tool itself: not again
    assert t.pending() == []


@pytest.mark.slow
def test_training_run_logs_the_summary(tiny_data, tmp_path):
    """The end of a training run: the line in train.log and the scalars in TensorBoard."""
    import shutil

    from tests.helpers import ROOT, run_command, tool_env

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    ds = TaskonomyDataset(data, ["depth"], split="train")
    ds.path(2, "rgb").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "tools/train.py", "--config", "configs/demo.yaml", "--out", str(out),
           "--set", f"data.root={data}", "--set", "data.tasks=[depth]", "--set", "optim.steps=2",
           "--set", "optim.batch_per_rank=4", "--set", "model.img_size=32", "--set", "model.depth=2",
           "--set", "model.embed_dim=64", "--set", "model.num_heads=2", "--set", "data.workers=0",
           "--set", "train.progress=false", "--set", "data.block=1"]  # the order whose 8 samples include index 2
    res = run_command(cmd, ROOT, tool_env(), 600)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (out / "train.log").read_text()
    assert "data: the loader gives" in text and "integer (decoded on the training device) batches" in text
    train_lines = [x for x in text.splitlines() if "data train (" in x]
    assert len(train_lines) == 1 and "1 corrupt file" in train_lines[0], text[-2000:]
    assert any("data val (" in x for x in text.splitlines())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("data/train/corrupt")] == [1.0]


# ---------------------------------------------------------------- issue 22, items 4 and 6: shards and pack accounting
def test_pack_blames_the_odd_rgb_once_and_leaves_out_samples_without_targets(tmp_path):
    """A sample whose rgb is another size than all 13 of its targets is one wrong-size file (the image), not 13; a
    sample whose every target is missing is left out and counted, not packed with nothing to learn."""
    root = write_random_tree(tmp_path / "t", n=6, size=16, buildings=1, seed=0)
    ds = TaskonomyDataset(root, "all")
    odd = ds.path(0, "rgb")
    Image.fromarray(np.zeros((24, 24, 3), np.uint8)).save(odd)  # square, but not the targets' 16 × 16
    for domain in ds.domains:
        if domain != "rgb":
            ds.path(1, domain).unlink()
    index = json.loads(pack_shards(root, tmp_path / "s", split=None, image_size=16, workers=0).read_text())
    assert (index["wrong_size"], index["corrupt"], index["no_target"]) == (1, 0, 1)
    assert index["missing"] == len(ds.domains) - 1  # the second sample's files, counted where they are missing
    packed = build_dataset(tmp_path / "s", ["depth"], "all", missing="mask")
    assert sorted(packed.ids) == sorted(ds.ids[2:])


@pytest.fixture()
def truncated_shards(tmp_path):
    """8 samples packed 4 per shard; the first shard cut short (as a full disk or an interrupted copy leaves it)."""
    root = write_random_tree(tmp_path / "t", n=8, size=16, buildings=2, seed=0)
    out = tmp_path / "s"
    pack_shards(root, out, split=None, image_size=16, shard_size=4, workers=0)
    shard = out / "train_00000.h5"
    shard.write_bytes(shard.read_bytes()[:5000])
    return out, shard


def test_a_truncated_shard_is_named_skipped_and_counted(truncated_shards, caplog, load_tool, capsys):
    out, shard = truncated_shards
    with caplog.at_level(logging.WARNING, logger="squad.data"):
        ds = build_dataset(out, ["depth"], "all")
    assert len(ds) == 4 and ds.unreadable_files == ["train_00000.h5"] and ds.lost_samples == 4
    warned = [r.getMessage() for r in caplog.records if str(shard) in r.getMessage()]
    assert len(warned) == 1 and "its 4 samples are skipped" in warned[0] and "truncated" in warned[0], warned
    [ds[i] for i in range(len(ds))]
    r = report(ds, "all")
    assert (r.corrupt, r.lost, r.samples) == (1, 4, 4)
    assert "1 corrupt file, 4 samples lost in unreadable shard files" in r.line()
    # make_data.py stats: names the file and the samples lost, reads the rest
    assert load_tool("tools/make_data.py").main(["stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"unreadable shard file, skipped: {shard}" in text and "(4 samples lost)" in text
    assert "4 views from" in text and "1 corrupt file (named above)" in text


@pytest.mark.slow
def test_training_on_a_truncated_shard_names_it_and_goes_on(truncated_shards, tmp_path):
    import sys

    from tests.helpers import ROOT, run_command, tool_env

    out, shard = truncated_shards
    cmd = [sys.executable, "tools/train.py", "--config", "configs/demo.yaml", "--out", str(tmp_path / "run"),
           "--set", f"data.root={out}", "--set", "data.val_split=train",
           "--set", "data.tasks=[depth]", "--set", "optim.steps=1", "--set", "optim.batch_per_rank=2",
           "--set", "model.img_size=16", "--set", "model.patch_size=8", "--set", "model.depth=2",
           "--set", "model.embed_dim=32", "--set", "model.num_heads=2", "--set", "data.workers=0",
           "--set", "train.progress=false"]
    res = run_command(cmd, ROOT, tool_env(), 600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and f"unreadable shard file {shard}" in res.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    assert "4 samples lost in unreadable shard files" in log, log[-2000:]


def test_a_tool_reports_pending_data_lines_before_its_last_line(tiny_data):
    """The demo prints the data lines of what it read before its verdict (`report_pending`), so `squad.cli.run` has
    none left to print after it."""
    from squad.data.accounting import report_pending, track

    with track() as tracked:
        ds = build_dataset(tiny_data, ["depth_euclidean"], "val")
        ds[0]
        lines = report_pending()
        assert len(lines) == 1 and lines[0].startswith("data val") and "every file read" in lines[0]
        assert tracked.pending() == [] and report_pending() == []
    assert report_pending() == []
