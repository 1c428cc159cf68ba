"""A-MoD adaptation of a dense ViT with no training (tools/adapt_pretrained.py)."""

import subprocess
import sys

import pytest
import timm
import torch

import squad
from squad.posttrain.adapt import fidelity, to_mod
from tests.helpers import ROOT


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


def test_tool_on_a_timm_file(vit_file, tiny_data, tmp_path):
    path, _ = vit_file
    out = tmp_path / "amod.pt"
    res = subprocess.run([sys.executable, "tools/adapt_pretrained.py", "--checkpoint", str(path), "--capacity", "0.5",
                          "--data", str(tiny_data), "--split", "train", "--batches", "1", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "attention" in res.stdout and "learned" in res.stdout
    model = squad.load_model(out)
    assert any(b.__class__.__name__ == "MoDBlock" for b in model.blocks)
    bad = subprocess.run([sys.executable, "tools/adapt_pretrained.py", "--checkpoint", str(tmp_path / "nope.pth"),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stderr
