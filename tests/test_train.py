"""Training end to end on the CPU: 2 DeepSpeed ranks, exact resume, multi-node on loopback, bad input.

Each run is a real subprocess (`tools/train.py` under python or the deepspeed launcher) over a tiny synthetic
Taskonomy the tests render themselves.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

import squad
from squad.distributed import free_port
from squad.io.checkpoints import find_resume_tag
from squad.train import checkpointer as ckpt
from squad.train import tags as ckpt_tags
from tests.helpers import DEEPSPEED, PY, ROOT, logged_losses, run_command, tool_env, write_run_config

pytestmark = pytest.mark.slow  # every test here runs tools/train.py (subprocesses, launchers)

TASKS = ["depth_euclidean", "normal", "class_scene", "edge_texture"]



@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.mktemp("synth")
    render_dataset(root, n=16, image_size=32, seed=0, buildings=4)  # 8 training images: one fixed batch
    return root


@pytest.fixture(scope="module")
def run_config(tmp_path_factory, data_root):
    return write_run_config(tmp_path_factory.mktemp("cfg") / "tiny.yaml", data_root, TASKS)


def _run(cmd, timeout=600):
    res = run_command(cmd, ROOT, tool_env(), timeout)
    return res


def _losses(run_dir: Path) -> list[float]:
    return list(logged_losses(run_dir).values())


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, run_config):
    out = tmp_path_factory.mktemp("runs") / "two_rank"
    res = _run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "tools/train.py",
                "--config", str(run_config), "--out", str(out)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def test_two_rank_deepspeed_overfits_and_exports(two_rank_run):
    losses = _losses(two_rank_run)
    assert len(losses) == 12
    assert losses[-1] < losses[0] / 3, losses
    assert find_resume_tag(two_rank_run / "checkpoints") == "step00000060"
    assert (two_rank_run / "config.yaml").is_file() and (two_rank_run / "ds_config.json").is_file()
    payload = torch.load(two_rank_run / "model.pt", weights_only=True)
    assert payload["tasks"] == TASKS
    model = squad.load_model(two_rank_run)
    usage = model.usage
    out = model(torch.randn(2, 3, 32, 32))
    assert set(out.preds) == set(TASKS)
    assert usage is not None and usage.counts  # statistics of both ranks' tokens
    total = next(iter(usage.tokens.values())).sum()
    assert total == 60 * 2 * 4 * len(TASKS) * 17  # steps × ranks × images × tasks × tokens
    metrics = [json.loads(line) for line in (two_rank_run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and metrics[-1]["step"] == 60


def test_multi_node_loopback_matches_one_node(tmp_path, run_config, two_rank_run):
    hosts = tmp_path / "hostfile"
    hosts.write_text("node0 slots=1\nnode1 slots=1\n")
    out = tmp_path / "two_nodes"
    port = str(free_port())
    cmds = [[DEEPSPEED, "--hostfile", str(hosts), "--num_nodes", "2", "--num_gpus", "1", "--no_ssh",
             "--node_rank", str(r), "--master_addr", "127.0.0.1", "--master_port", port, "tools/train.py",
             "--config", str(run_config), "--out", str(out)] for r in (0, 1)]
    procs = [subprocess.Popen(c, env=tool_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    a = torch.load(two_rank_run / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    for k in a:  # gloo over TCP sums in another order than shared memory: equal to float rounding
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_resume_reaches_the_same_weights(tmp_path, run_config):
    base = ["tools/train.py", "--config", str(run_config), "--set", "optim.steps=6", "--set", "train.ckpt_every=0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for cmd in ([PY, *base, "--out", str(straight)],
                [PY, *base, "--out", str(resumed), "--set", "train.stop_at=3"],
                [PY, *base, "--out", str(resumed)]):
        res = _run(cmd)
        assert res.returncode == 0, res.stderr[-3000:]
    assert not (straight / "checkpoints" / "step00000003").exists()
    a = torch.load(straight / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "resumed from" in (resumed / "train.log").read_text()


def test_missing_data_folder(tmp_path, run_config):
    res = _run([PY, "tools/train.py", "--config", str(run_config), "--out", str(tmp_path / "r"),
                "--set", f"data.root={tmp_path / 'nowhere'}"])
    assert res.returncode == 2
    assert str(tmp_path / "nowhere") in res.stderr and "make_data.py synthetic" in res.stderr


def test_bad_config_key(tmp_path, run_config):
    res = _run([PY, "tools/train.py", "--config", str(run_config), "--set", "optim.learning_rate=1"])
    assert res.returncode == 2 and "optim.learning_rate" in res.stderr


def test_unwritable_run_folder(tmp_path, run_config):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = _run([PY, "tools/train.py", "--config", str(run_config), "--out", str(blocker / "run")])
    assert res.returncode == 2 and "not writable" in res.stderr and str(blocker / "run") in res.stderr
    res = _run([PY, "tools/train.py", "--config", str(run_config), "--out", str(blocker)])
    assert res.returncode == 2 and f"--out {blocker} is a file, not a folder" in res.stderr, res.stderr[-2000:]


def test_incomplete_checkpoint_is_never_resumed(tmp_path):
    d = tmp_path / "checkpoints"
    (d / ckpt.SAVING / "step00000003").mkdir(parents=True)
    ckpt_tags.commit_tag(d, "step00000003", {"step": 3}, keep=5)
    (d / "step00000006").mkdir()  # a save an older version left half-written in the tag folder itself
    (d / "latest").write_text("step00000006")
    (d / ckpt.SAVING / "step00000009").mkdir(parents=True)  # one killed while writing: never a tag
    assert find_resume_tag(d) == "step00000003" and ckpt_tags.complete_tags(d) == ["step00000003"]
    (d / ckpt.SAVING / "step00000006").mkdir()
    ckpt_tags.commit_tag(d, "step00000006", {"step": 6}, keep=1)  # replaces the half-written folder
    assert find_resume_tag(d) == "step00000006" and not (d / "step00000003").exists()
    assert sorted(p.name for p in (d / "step00000006").iterdir()) == ["COMPLETE"]


def test_non_finite_losses_skip_then_stop(tmp_path, run_config):
    # an absurd learning rate blows the weights up after the first step: every later loss is non-finite
    out = tmp_path / "nan"
    res = _run([PY, "tools/train.py", "--config", str(run_config), "--out", str(out), "--set", "optim.lr=1e30",
                "--set", "optim.warmup_steps=0", "--set", "optim.clip=0", "--set", "train.max_nonfinite=3"])
    assert res.returncode == 3, res.stderr[-2000:]
    assert "3 non-finite losses in a row" in res.stderr
    assert "requires_grad=True to a scalar" not in res.stderr  # the skipped losses are logged detached
    assert "non-finite loss" in (out / "train.log").read_text()
    assert not (out / "model.pt").exists() and find_resume_tag(out / "checkpoints") is None


def test_two_runs_in_one_process_log_to_their_own_folders(tmp_path, tiny_data):
    """`squad.train.engine.train` removes its train.log handler at the end, so a second run in the same process
    (a notebook, a sweep) does not write into the first run's log."""
    from squad.train.engine import train

    tiny = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
            "model.head_dim=null", "model.moa.head_dim=8", "model.moa.num_experts=4", "model.moa.top_k=2",
            "model.moe.num_experts=4", "model.moe.top_k=2", f"data.root={tiny_data}", "optim.steps=1",
            "optim.batch_per_rank=4", "data.tasks=[depth_euclidean]"]
    for name in ("a", "b"):
        train(squad.load_config(ROOT / "configs" / "demo.yaml", tiny), tmp_path / name, resume="none")
    first = (tmp_path / "a" / "train.log").read_text()
    assert "exported" in first and str(tmp_path / "b") not in first
    assert str(tmp_path / "b") in (tmp_path / "b" / "train.log").read_text()
