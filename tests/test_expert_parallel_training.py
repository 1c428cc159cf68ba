"""Expert-parallel and ZeRO-3 training runs under the deepspeed launcher (CPU, gloo), against one reference run.

One module fixture launches the runs once (each test reads them):

- ``ref``: expert_parallel 1, ZeRO 0, 2 ranks, 20 steps, a checkpoint at step 10 — the uninterrupted run;
- ``ep2``: expert_parallel 2 (MoE MLP and MoE attention) at ZeRO-1, otherwise the same;
- ``ep2_to_1`` / ``ep1_to_2``: ``ep2`` resumed at step 10 with expert_parallel 1 (ZeRO-1: the tag becomes a universal
  checkpoint the experts join), ``ref`` resumed with 2 (ZeRO 0: the experts leave DeepSpeed's model states and
  optimizer for shard files);
- ``z3``: expert_parallel 2 at ZeRO-3, stopped at step 10 (``train.stop_at``) and resumed by the same command;
- ``ep4``: ``ep2``'s step 10 on 4 ranks with expert_parallel 4 (experts re-sharded, another data-parallel size: a
  universal checkpoint for DeepSpeed's ZeRO-1 state), with ``optim.steps=10``: nothing is trained, the loaded weights
  are exported.

Every run of the same data reaches the reference's losses and weights to float32 tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import squad
from tests.helpers import ROOT, launcher, logged_losses, run_command, tool_env, write_run_config

pytestmark = pytest.mark.slow
HEADS = ["depth_euclidean", "class_scene"]
TIMEOUT = 600
TOL = 2e-5  # float32: the runs sum the same gradients in other orders


def _config(path: Path, data: Path, ep: int, zero: int = 0, **train) -> Path:
    write_run_config(path, data, HEADS, optim={"steps": 20, "warmup_steps": 2, "weight_decay": 0.05, "clip": 0.5},
                     train={"log_every": 1, "ckpt_every": 10, "zero_stage": zero, **train})
    cfg = yaml.safe_load(path.read_text())
    cfg["model"]["moe"]["expert_parallel"] = ep
    cfg["model"]["moa"]["expert_parallel"] = ep
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, out: Path, ranks: int = 2, *args: str) -> None:
    cmd = launcher(ranks) + ["tools/train.py", "--config", str(config), "--out", str(out), *args]
    res = run_command(cmd, ROOT, tool_env(), TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ep_runs")
    out = {name: base / name for name in ("ref", "ep2", "ep2_to_1", "ep1_to_2", "z3", "ep4")}
    _train(_config(base / "ref.yaml", tiny_data, 1), out["ref"])
    _train(_config(base / "ep2.yaml", tiny_data, 2, zero=1), out["ep2"])
    _train(_config(base / "ep1z1.yaml", tiny_data, 1, zero=1), out["ep2_to_1"], 2, "--resume",
           str(out["ep2"] / "checkpoints" / "step00000010"))
    _train(_config(base / "ep2z0.yaml", tiny_data, 2), out["ep1_to_2"], 2, "--resume",
           str(out["ref"] / "checkpoints" / "step00000010"))
    z3 = _config(base / "z3.yaml", tiny_data, 2, zero=3, stop_at=10)
    _train(z3, out["z3"])
    _train(z3, out["z3"])  # resumes from its step-10 checkpoint
    _train(_config(base / "ep4.yaml", tiny_data, 4, zero=1), out["ep4"], 4, "--resume",
           str(out["ep2"] / "checkpoints" / "step00000010"), "--allow-world-size-change", "--set", "optim.steps=10")
    return out


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)["state_dict"]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("name", ["ep2", "ep2_to_1", "ep1_to_2", "z3"])
def test_runs_reach_the_reference_losses_and_weights(runs, name):
    """EP 2 trains as EP 1 (every step's loss, the final weights), and so do the runs resumed across layouts and the
    ZeRO-3 run stopped and resumed."""
    ref, run = logged_losses(runs["ref"]), logged_losses(runs[name])
    assert sorted(ref) == list(range(1, 21)) and set(run) <= set(ref) and max(run) == 20
    for step, loss in run.items():
        assert abs(loss - ref[step]) <= TOL * max(1.0, abs(ref[step])), (name, step, loss, ref[step])
    assert ref[20] < ref[1]  # it trained
    assert _close(_weights(runs[name]), _weights(runs["ref"])) < TOL


def test_expert_shards_are_files_of_their_own(runs):
    """An EP tag: DeepSpeed's module weights lack the experts, one shard file per rank of the group holds them by
    global expert, and squad.load puts the whole model back together (so does a ZeRO-3 tag's)."""
    from squad.io.checkpoints import load_checkpoint_file

    tag = runs["ep2"] / "checkpoints" / "step00000020"
    module = load_checkpoint_file(tag / "mp_rank_00_model_states.pt")["module"]
    assert not [k for k in module if ".experts." in k or k.endswith((".q", ".o"))]
    files = sorted(p.name for p in tag.glob("expert_shards_rank*.pt"))
    assert files == ["expert_shards_rank00000.pt", "expert_shards_rank00001.pt"]
    shard = load_checkpoint_file(tag / files[1])["shards"]["blocks.0.mlp.experts.w1"]
    assert shard["first"] == 2 and shard["num_experts"] == 4 and shard["weight"].shape[0] == 2
    assert shard["exp_avg"] is not None and shard["step"] == 20
    for run in ("ep2", "z3"):
        loaded = squad.load(runs[run] / "checkpoints").state_dict()
        assert _close(loaded, _weights(runs[run])) == 0.0, run


def test_ep2_checkpoint_loads_at_ep4_on_four_ranks(runs):
    """Re-sharded to 4 ranks of 1 expert each (and 4 data-parallel ranks), the step-10 weights are those saved."""
    saved = squad.load(runs["ep2"] / "checkpoints" / "step00000010").state_dict()
    assert _close(_weights(runs["ep4"]), saved) == 0.0
    history = [json.loads(line) for line in (runs["ep4"] / "run_history.jsonl").read_text().splitlines()]
    assert history[-1]["world_size"] == 4


@pytest.fixture
def tools_env(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_every_tool_opens_an_expert_parallel_tag(runs, tiny_data, load_tool, tmp_path, capsys, tools_env):
    """evaluate, extract, export and finetune_router take the ZeRO-3 expert-parallel run's last tag as one
    single-process model."""
    tag = str(runs["z3"] / "checkpoints" / "step00000020")
    data = ["--data", str(tiny_data)]
    calls = {
        "evaluate": ["--checkpoint", tag, *data, "--split", "val", "--batches", "1", "--out", str(tmp_path / "e.json")],
        "extract": ["--checkpoint", tag, "--task", "depth_euclidean", "--theta", "0.01", *data, "--calib-batches", "1",
                    "--eval-batches", "1", "--batch-size", "4", "--out", str(tmp_path / "depth.pt")],
        "export": ["--checkpoint", tag, "--format", "model.pt", "--out", str(tmp_path / "whole.pt")],
        "finetune_router": ["--checkpoint", tag, "--task", "normal", *data, "--fractions", "0.5", "--mode", "router",
                            "--steps", "1", "--batch-size", "4", "--eval-batches", "1", "--out",
                            str(tmp_path / "ft.json")],
    }
    for tool, argv in calls.items():
        rc = load_tool(f"tools/{tool}.py").main(argv)
        assert rc == 0, (tool, capsys.readouterr().err[-2000:])
    assert set(json.loads((tmp_path / "e.json").read_text())["metrics"]) == set(HEADS)
    assert _close(squad.load(tmp_path / "whole.pt").state_dict(), _weights(runs["z3"])) == 0.0
    assert squad.load(tmp_path / "depth.pt").task == "depth_euclidean"
    assert json.loads((tmp_path / "ft.json").read_text())["task"] == "normal"
