"""``accelerate launch`` runs tools/train.py: ``--multi_gpu --num_processes 2`` (torchrun underneath) trains on 2
ranks, on CPUs with gloo as on GPUs; a launch where accelerate starts one process although more were asked (its
simple launcher: no ``--multi_gpu`` with fewer than 2 GPUs, or ``--cpu`` without mpirun) is refused, exit 2.

The runs are real subprocesses at the smallest sizes (depth 2, 32 px, 2 steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import squad
from squad.distributed import check_accelerate_launch, free_port
from tests.helpers import ROOT, tool_env, write_run_config

ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TIMEOUT = 300


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.mktemp("synth")
    render_dataset(root, n=16, image_size=32, seed=0, buildings=4)  # 8 training images
    return write_run_config(tmp_path_factory.mktemp("cfg") / "tiny.yaml", root, ["depth_euclidean", "class_scene"],
                            optim={"warmup_steps": 1, "steps": 2}, train={"ckpt_every": 2, "zero_stage": 1})


def _accelerate(config: Path, out: Path, *flags: str, tmp: Path) -> subprocess.CompletedProcess:
    cmd = [ACCELERATE, "launch", *flags, "--main_process_port", str(free_port()), "tools/train.py",
           "--config", str(config), "--out", str(out)]
    env = tool_env(HF_HOME=str(tmp / "hf"))  # no accelerate config file of the user's is read
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)


@pytest.mark.slow
def test_accelerate_multi_gpu_launch_trains_on_two_ranks(config, tmp_path):
    res = _accelerate(config, tmp_path / "run", "--multi_gpu", "--num_processes", "2", tmp=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "2 ranks on" in log, log[:500]
    model = squad.load(tmp_path / "run")
    assert model.meta["extra"]["step"] == 2


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with 2 GPUs accelerate turns --multi_gpu on itself")
def test_accelerate_single_process_fallback_is_refused(config, tmp_path):
    res = _accelerate(config, tmp_path / "run", "--num_processes", "2", tmp=tmp_path)
    assert res.returncode != 0
    assert "accelerate launch started this script once" in res.stderr and "--multi_gpu" in res.stderr
    assert not (tmp_path / "run" / "model.pt").exists()


def test_check_accelerate_launch_reads_the_launcher_variables(monkeypatch):
    for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(k, raising=False)
    check_accelerate_launch()  # plain python
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    check_accelerate_launch()  # accelerate launch --num_processes 1: no MASTER_PORT
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="--multi_gpu --num_processes N"):
        check_accelerate_launch()  # the simple launcher asked for more than one process
    monkeypatch.setenv("RANK", "0")
    check_accelerate_launch()  # torchrun underneath (--multi_gpu, --use_deepspeed)
    assert os.environ["RANK"] == "0"
