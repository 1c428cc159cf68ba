"""Exit codes and messages (issue 10, item 12): a device the machine lacks, an unreadable file to adapt_pretrained,
and a run folder under a file under a 2-rank launch each end in a clean exit 2 with a message, no traceback."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers import ROOT, run_command, tool_env

DEVICE_TOOLS = ["tools/evaluate.py", "tools/extract.py", "tools/visualize.py", "tools/finetune_router.py"]


@pytest.mark.parametrize("script", DEVICE_TOOLS)
@pytest.mark.parametrize("device, needle", [("cuda:99", "cuda:99"), ("gpu", "not a device name")])
def test_device_the_machine_lacks_is_exit_2(script, device, needle, load_tool, capsys):
    # cuda:99: "no CUDA GPU" on a CPU machine, "has N GPU(s)" on a GPU machine; both before anything is loaded
    with pytest.raises(SystemExit) as exc:
        load_tool(script).main(["--checkpoint", "nowhere", "--data", "nowhere", "--device", device])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --device" in err and needle in err and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_on_a_cpu_machine(load_tool, capsys):
    with pytest.raises(SystemExit) as exc:
        load_tool("tools/evaluate.py").main(["--checkpoint", "x", "--data", "y", "--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_bad_files_to_adapt_pretrained_are_exit_2(tmp_path, load_tool, capsys):
    garbage = b"garbage, not a model\n"
    files = {"bad.pth": garbage, "bad.pt": garbage, "bad.safetensors": garbage}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    torch.save({"a": torch.zeros(2)}, tmp_path / "other.pth")
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    torch.save({"patch_embed.proj.weight": torch.zeros(8, 3, 4), "pos_embed": torch.zeros(1, 5, 8),
                "blocks.0.mlp.fc1.weight": torch.zeros(32, 8)}, tmp_path / "shapes.pth")
    tool = load_tool("tools/adapt_pretrained.py")
    for name in [*files, "other.pth", "tensor.pth", "shapes.pth", "missing.pth"]:
        path = tmp_path / name
        assert tool.main(["--checkpoint", str(path), "--out", str(tmp_path / "o.pt")]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and str(path) in err and "Traceback" not in err, (name, err)


@pytest.mark.slow
def test_run_folder_under_a_file_two_ranks_is_exit_2(tmp_path, tiny_data):
    """Both ranks report the bad folder and leave with 2 (no rank aborting in teardown: the launcher's 250)."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(__import__("squad.distributed", fromlist=["free_port"]).free_port()), "tools/train.py",
           "--config", "configs/demo.yaml", "--out", str(blocker / "run"), "--set", f"data.root={tiny_data}",
           "--set", "optim.steps=1", "--set", "model.img_size=32", "--set", "model.depth=2"]
    res = run_command(cmd, ROOT, tool_env(), 300)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert "not writable" in out and "terminate called" not in out and "Traceback" not in out, out[-3000:]
