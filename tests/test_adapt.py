"""A-MoD adaptation of a dense ViT with no training (tools/adapt_pretrained.py)."""

import sys

import pytest
import timm
import torch

import squad
from squad.posttrain.adapt import fidelity, to_mod
from tests.helpers import ROOT, run_command, tool_env


@pytest.fixture(scope="module")
def vit_file(tmp_path_factory):
    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10)
    path = tmp_path_factory.mktemp("timm") / "vit.pth"
    torch.save(vit.state_dict(), path)
    return path, vit.eval()


def test_full_capacity_attention_routing_is_the_dense_model(vit_file):
    _, vit = vit_file
    dense = squad.from_timm(vit).eval()
    amod = to_mod(dense, capacity=1.0, routing="attention").eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(amod.forward_features(x, "timm"), vit.forward_features(x), atol=1e-5)


@pytest.mark.slow
def test_attention_routing_keeps_more_of_the_dense_model(vit_file):
    _, vit = vit_file
    dense = squad.from_timm(vit).eval()
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, 32)
    att = fidelity(to_mod(dense, 0.5, "attention").eval(), dense, x, "timm")
    learned = fidelity(to_mod(dense, 0.5, "learned").eval(), dense, x, "timm")
    assert att.feature_cosine > learned.feature_cosine
    assert att.top1_agreement >= learned.top1_agreement


def test_to_mod_rejects_routed_models():
    cfg = squad.model_config({"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                              "plan": [{"attn": "moa"}], "moa": {"num_experts": 4, "top_k": 2, "head_dim": 8},
                              "heads": ["depth"]})
    with pytest.raises(ValueError, match="dense model"):
        to_mod(squad.build_model(cfg), 0.5, "attention")


@pytest.mark.slow
def test_tool_on_a_timm_file(vit_file, tiny_data, tmp_path):
    path, _ = vit_file
    out = tmp_path / "amod.pt"
    res = run_command([sys.executable, "tools/adapt_pretrained.py", "--checkpoint", str(path), "--num-heads", "6",
                       "--capacity", "0.5", "--data", str(tiny_data), "--split", "train", "--batches", "1",
                       "--out", str(out)], ROOT, tool_env(), 300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "attention" in res.stdout and "learned" in res.stdout
    assert "nan" not in res.stdout  # a measure that does not apply is "-" (the dense row: no agreement with itself)
    dense_row = next(line for line in res.stdout.splitlines() if line.startswith("dense"))
    assert dense_row.split()[-2:] == ["-", "-"], res.stdout
    model = squad.load_model(out)
    assert any(b.__class__.__name__ == "MoDBlock" for b in model.blocks)
    bad = run_command([sys.executable, "tools/adapt_pretrained.py", "--checkpoint", str(tmp_path / "nope.pth"),
                       "--out", str(out)], ROOT, tool_env(), 120)
    assert bad.returncode == 2 and "not found" in bad.stderr


# ------------------------------------------------------------- issue 22, item 2: the head count of a timm file
def _vit96(tmp_path, **kwargs):
    """A 96-wide timm ViT with 3 heads of 32 (96 is not a multiple of 64), saved as a plain state dict."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=96,
                            depth=2, num_heads=3, num_classes=10, **kwargs).eval()
    path = tmp_path / "vit96.pth"
    torch.save(vit.state_dict(), path)
    return path, vit


def test_a_timm_file_without_its_head_count_is_refused_naming_the_flag(tmp_path, load_tool, capsys):
    """The weights' shapes do not tell the head count: never guessed (the old width/64 made this ViT one head)."""
    path, _ = _vit96(tmp_path)
    out = tmp_path / "amod.pt"
    tool = load_tool("tools/adapt_pretrained.py")
    assert tool.main(["--checkpoint", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "number of attention heads cannot be read from this file" in err and "--num-heads" in err
    assert not out.exists()
    assert tool.main(["--checkpoint", str(path), "--num-heads", "5", "--out", str(out)]) == 2  # 96 % 5
    assert "--num-heads 5 does not divide the width 96" in capsys.readouterr().err


def test_the_head_count_is_read_from_the_file_when_it_records_it(tmp_path, load_tool, capsys):
    """From a config.json beside the weights (timm's model-hub layout) or a checkpoint's own entries (num_heads, or a
    timm architecture name): the model is then exactly timm's."""
    import json

    from squad.cli.adapt_pretrained import load_dense

    path, vit = _vit96(tmp_path)
    x = torch.randn(2, 3, 32, 32)
    (tmp_path / "config.json").write_text(json.dumps({"architecture": "vit_custom", "model_args": {"num_heads": 3}}))
    dense = load_dense(str(path), None)
    assert dense.cfg.num_heads == 3
    with torch.no_grad():
        assert (dense.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5
    tool = load_tool("tools/adapt_pretrained.py")
    assert tool.main(["--checkpoint", str(path), "--num-heads", "6", "--out", str(tmp_path / "a.pt")]) == 2
    assert "--num-heads 6 disagrees with" in capsys.readouterr().err and not (tmp_path / "a.pt").exists()
    assert tool.main(["--checkpoint", str(path), "--num-heads", "3", "--capacity", "1.0",
                      "--out", str(tmp_path / "a.pt")]) == 0
    (tmp_path / "config.json").unlink()

    # a training checkpoint naming its timm architecture (timm's train.py saves ``arch``)
    torch.manual_seed(0)
    tiny = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10).eval()
    ckpt = tmp_path / "checkpoint.pth.tar"
    torch.save({"arch": "vit_tiny_patch16_224", "epoch": 3, "state_dict": tiny.state_dict()}, ckpt)
    dense = load_dense(str(ckpt), None)
    assert dense.cfg.num_heads == 3 and dense.cfg.embed_dim == 192
    with torch.no_grad():
        assert (dense.forward_features(x) - tiny.forward_features(x)).abs().max() < 1e-5
    torch.save({"arch": "vit_small_patch16_224", "state_dict": tiny.state_dict()}, ckpt)  # an arch of another width
    with pytest.raises(ValueError, match="384.*192 wide; pass --num-heads"):
        load_dense(str(ckpt), None)
