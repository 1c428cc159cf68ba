"""Issue 22, item 9: a warm-up longer than the run is warned about; errors and the final "model:" line print once
per launch, not once per rank (a rank that fails alone still says so); the bench's extraction row reads runs/demo
and its data from the current folder, not from the install tree."""

from __future__ import annotations

import socket
import subprocess

import pytest
import yaml

from squad.cli import _run
from squad.config.base import ConfigError
from squad.distributed import free_port, on_every_rank
from squad.train.optim import warmup_note
from tests.helpers import PY, ROOT, launcher, run_command, tiny_model, tool_env, write_run_config


def test_warmup_note():
    assert warmup_note(2, 2, 1e-3) is None and warmup_note(0, 5, 1e-3) is None
    note = warmup_note(100, 4, 1e-3)
    assert "optim.warmup_steps=100" in note and "4 steps" in note and "peaks at 4e-05 instead of optim.lr=0.001" in note


def _errors(capsys, error: BaseException) -> list[str]:
    def body(argv):
        raise error

    assert _run(body, [], ()) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_other_ranks_print_only_their_own_errors(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert _errors(capsys, ValueError("bad")) == ["error: bad"]
    monkeypatch.setenv("RANK", "1")
    assert _errors(capsys, ValueError("bad")) == []  # before the process group: every rank had the same input
    monkeypatch.setattr("squad.cli._group_started", lambda: True)
    assert _errors(capsys, ConfigError("optim.lr: bad")) == []  # every rank reads the same config
    assert _errors(capsys, on_every_rank(PermissionError("run folder x is not writable"))) == []  # broadcast
    assert _errors(capsys, ValueError("shard y is odd")) == ["error (rank 1): shard y is odd"]  # its own


@pytest.mark.slow
def test_two_ranks_print_the_warning_the_error_and_the_model_line_once(tiny_data, tmp_path):
    config = write_run_config(tmp_path / "tiny.yaml", tiny_data, ["depth_euclidean"],
                              optim={"warmup_steps": 50, "steps": 2}, train={"ckpt_every": 2})
    cmd = [*launcher(2), "tools/train.py", "--config", str(config), "--out", str(tmp_path / "run")]
    res = run_command(cmd, ROOT, tool_env(), 600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert out.count("model: ") == 1, out[-3000:]
    assert out.count("optim.warmup_steps=50 (or warmup_epochs) exceeds the run's 2 steps") == 1, out[-3000:]
    assert "exceeds the run's 2 steps" in (tmp_path / "run" / "train.log").read_text()
    # a resume with a changed lr: refused on every rank alike, said once
    res = run_command([*launcher(2), *cmd[6:], "--set", "optim.lr=0.1"], ROOT, tool_env(), 600)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert out.count("error: cannot resume") == 1 and "error (rank" not in out, out[-3000:]


@pytest.mark.slow
def test_bench_extraction_reads_runs_demo_of_the_current_folder(tiny_data, tmp_path, monkeypatch):
    """The README's commands write runs/demo and data/synthetic where they run: the bench takes them from there."""
    from squad.bench.extract import bench_extraction
    from squad.io import export_model

    run = tmp_path / "runs" / "demo"
    export_model(run / "model.pt", tiny_model(["depth_euclidean", "normal"]), usage=None)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"root": "data/synthetic"}}))  # relative, as trained
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "synthetic").symlink_to(tiny_data)
    monkeypatch.chdir(tmp_path)
    params, forward = bench_extraction(quick=True)
    assert params.details["model"] == str(run / "model.pt")
    assert params.details["usage"] == f"calibration on {tmp_path / 'data' / 'synthetic'}"
    assert forward.unit != "error"


def test_bench_extraction_trains_its_own_run_with_the_packaged_config(tmp_path, monkeypatch):
    """Without runs/demo here, the fallback run starts `python -m squad.cli.train` on squad's own demo.yaml (a
    wheel has no tools/ folder), in a temporary folder."""
    import squad.bench.extract as bx

    seen = {}

    def fake_run(cmd, cwd, env, capture_output, text):
        seen.update(cmd=cmd, cwd=cwd)
        return subprocess.CompletedProcess(cmd, 1, "", "stopped here")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bx, "render_dataset", lambda *a, **k: None)
    monkeypatch.setattr(bx.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="stopped here"):
        bx.bench_extraction(quick=True)
    from squad.config.base import config_root

    assert seen["cmd"][:5] == [PY, "-m", "squad.cli.train", "--config", str(config_root() / "demo.yaml")]
    assert "squad_bench_extract_" in str(seen["cwd"])  # its temporary folder, not the install tree


# ------------------------------------------------------------------------------------- issue 28's small things
def test_load_gives_eval_mode_and_names_an_export(tmp_path):
    """`squad.load` returns every kind of model in eval mode, and a torch.export program is named as one, with how to
    load it, instead of "not a loadable squad model file"."""
    import torch

    import squad
    from squad.io import save_extracted
    from squad.posttrain.extract import collect_usage, extract

    model = tiny_model([{"name": "depth_euclidean", "kind": "dense", "channels": 1}])
    ext = extract(model, "depth_euclidean", collect_usage(model, "depth_euclidean", [torch.randn(2, 3, 32, 32)]),
                  theta=0.0)
    path = save_extracted(tmp_path / "depth.pt", ext.train())
    loaded = squad.load(path)
    assert not loaded.training and not any(m.training for m in loaded.modules())
    import zipfile

    with zipfile.ZipFile(tmp_path / "depth.pt2", "w") as z:  # the layout torch.export.save writes
        z.writestr("depth/archive_format", "pt2")
        z.writestr("depth/models/model.json", "{}")
    with pytest.raises(ValueError, match=r"is a torch.export program .* torch.export.load\(path\).module\(\)"):
        squad.load(tmp_path / "depth.pt2")


def test_a_one_process_run_whose_port_is_taken_picks_another(tmp_path):
    """A one-process run picks its rendezvous port itself; when another process takes it before the run listens
    (EADDRINUSE), it picks another instead of failing (parallel test workers met this)."""
    script = tmp_path / "taken.py"
    script.write_text(
        "import os, socket\n"
        "import squad.distributed as D\n"
        "for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):\n"
        "    os.environ.pop(k, None)\n"
        "busy = socket.socket(); busy.bind(('127.0.0.1', 0)); busy.listen(1)\n"
        "ports = iter([busy.getsockname()[1]])\n"
        "real = D.free_port\n"
        "D.free_port = lambda: next(ports, None) or real()\n"
        "rank, world, device = D.init_distributed()\n"
        "print('ok', rank, world, os.environ['MASTER_PORT'] != str(busy.getsockname()[1]))\n")
    res = subprocess.run([PY, str(script)], cwd=ROOT, env=tool_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-4:] == ["ok", "0", "1", "True"], res.stdout[-2000:]


@pytest.mark.slow
def test_a_one_rank_run_that_inherits_a_busy_port_moves_and_says_so(tmp_path):
    """A one-rank run that inherits MASTER_PORT (exported in a shell, or from a parent that trains in-process and
    still listens on it) moves to a free port with one line on stderr; a run of several ranks would not (its other
    ranks look for the port it was given)."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    code = ("import os, squad.distributed as D; rank, world, _ = D.init_distributed(); "
            "print('ok', rank, world, os.environ['MASTER_PORT'])")
    env = {**tool_env(), "MASTER_PORT": port}
    try:
        res = subprocess.run([PY, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        busy.close()
    assert res.returncode == 0, res.stderr[-3000:]
    ok, rank, world, moved = res.stdout.split()[-4:]
    assert (ok, rank, world) == ("ok", "0", "1") and moved != port, res.stdout[-2000:]
    assert f"MASTER_PORT {port} is in use" in res.stderr


def test_a_gpu_run_gives_cpu_tensors_a_backend_beside_nccl(monkeypatch):
    """On GPUs the process group is made with gloo for CPU tensors beside nccl: the step's flags, the logged sums and
    the expert-usage tables are all-reduced as CPU tensors, which a group of nccl alone refuses on 2+ GPUs."""
    import deepspeed

    import squad.distributed as D

    seen = {}

    def fake_init(dist_backend, verbose):
        seen["backend"] = dist_backend
        raise RuntimeError("stop here")

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)  # as a launcher would set them (nothing left behind in this worker)
    monkeypatch.setattr(D, "cuda_available", lambda: True)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(deepspeed, "init_distributed", fake_init)
    with pytest.raises(RuntimeError, match="stop here"):
        D.init_distributed()
    assert seen["backend"] == "cpu:gloo,cuda:nccl" == D.process_group_backend(True)
    assert D.process_group_backend(False) == "gloo"


def test_default_outputs_of_a_tag_go_to_its_run_folder(tmp_path):
    """A tool's default output for a checkpoint tag (or a file in one, or the checkpoints folder) goes into the run
    folder: the run removes a pruned tag whole, with whatever was written into it (an extracted model did so)."""
    import json

    from squad.cli import beside

    run = tmp_path / "run"
    tag = run / "checkpoints" / "step00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text(json.dumps({"step": 4}))
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (run / "model.pt").write_bytes(b"")
    assert beside(str(tag)) == run and beside(str(tag / "mp_rank_00_model_states.pt")) == run
    assert beside(str(run / "checkpoints")) == run and beside(str(run)) == run
    assert beside(str(run / "model.pt")) == run and beside(str(tmp_path / "depth.pt")) == tmp_path
    half = run / "checkpoints" / "step00000006"  # not a tag (no COMPLETE): a folder like any
    half.mkdir()
    assert beside(str(half)) == half
    assert str(beside("hf-hub:org/name")) == "."


def test_make_data_synthetic_overwrites_an_earlier_render_only_when_asked(tmp_path, load_tool, capsys):
    tool = load_tool("tools/make_data.py")
    args = ["synthetic", "--out", str(tmp_path / "d"), "--n", "8", "--image-size", "16"]
    assert tool.main(args) == 0
    assert tool.main(args) == 2
    assert "replace an earlier render with --overwrite" in capsys.readouterr().err
    assert tool.main([*args, "--overwrite"]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("not a render")
    assert tool.main(["synthetic", "--out", str(tmp_path / "other"), "--n", "8", "--image-size", "16",
                      "--overwrite"]) == 2
    assert "holds no synthetic.json" in capsys.readouterr().err and (tmp_path / "other" / "mine.txt").is_file()
