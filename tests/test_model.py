"""SquadViT: every paper config at tiny widths, the fused multi-task pass, timm interop, input errors."""

import pytest
import timm
import torch

import squad
from squad.layers.context import RouterStats
from tests.helpers import MODEL_CONFIGS, tiny_config, tiny_model_cfg


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_every_config_forward_backward_finite(path):
    torch.manual_seed(0)
    cfg = tiny_config(path)
    model = squad.build_model(cfg.model)
    images = torch.randn(2, 3, 32, 32)
    out = model(images)
    assert set(out.preds) == set(model.task_names)
    loss = sum(p.float().pow(2).mean() for p in out.preds.values())
    for s in out.stats:
        assert isinstance(s, RouterStats)
        if s.mass is not None:
            loss = loss + 1e-3 * s.mass.sum()
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    trained = [n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert any("blocks" in n for n in trained)
    for task, pred in out.preds.items():
        head = next(h for h in cfg.model.head_configs() if h.name == task)
        shape = (2, head.channels, 32, 32) if head.kind == "dense" else (2, head.channels)
        assert tuple(pred.shape) == shape, task


def _fused_vs_separate(model, images, tasks):
    fused = model(images, tasks)
    for t in tasks:
        alone = model(images, [t])
        assert torch.allclose(fused.preds[t], alone.preds[t], atol=1e-5), t
    return fused


@pytest.mark.parametrize("name", ["modsquad_vit_s", "mod_vit_s", "amod_vit_s", "mone_vit_s", "m3vit_vit_b"])
def test_fused_pass_equals_separate_passes(name):
    torch.manual_seed(0)
    cfg = tiny_config(f"configs/model/{name}.yaml")
    model = squad.build_model(cfg.model).eval()
    images = torch.randn(3, 3, 32, 32)
    _fused_vs_separate(model, images, ["depth_euclidean", "normal", "class_scene", "segment_unsup2d"])


def test_assignment_runs_subsets_and_matches_full():
    torch.manual_seed(0)
    model = squad.build_model(tiny_config("configs/model/modsquad_vit_s.yaml").model).eval()
    images = torch.randn(4, 3, 32, 32)
    tasks = ["depth_euclidean", "normal", "class_object"]
    assign = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    out = model(images, tasks, assignment=assign)
    full = model(images, tasks)
    for j, t in enumerate(tasks):
        idx = assign[:, j].nonzero().flatten()
        assert torch.equal(out.image_index[t], idx)
        assert torch.allclose(out.preds[t], full.preds[t][idx], atol=1e-5)


def test_aliases_and_unknown_task():
    model = squad.build_model(tiny_config("configs/model/mtl_vit_b.yaml").model)
    images = torch.randn(1, 3, 32, 32)
    assert "depth_euclidean" in model(images, ["depth"]).preds
    with pytest.raises(ValueError, match="unknown task 'flow'.*class_object"):
        model(images, ["flow"])


@pytest.mark.parametrize("shape", [(2, 3, 16, 16), (2, 1, 32, 32), (3, 32, 32), (2, 3, 32, 40)])
def test_wrong_image_shape(shape):
    model = squad.build_model(tiny_model_cfg())
    with pytest.raises(ValueError, match=r"images must be \[B, 3, 32, 32\]"):
        model(torch.randn(*shape))


def test_integer_images_rejected():
    model = squad.build_model(tiny_model_cfg())
    with pytest.raises(ValueError, match="floating-point"):
        model(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))


def test_forward_features_needs_task_when_routed():
    model = squad.build_model(tiny_config("configs/model/modsquad_vit_s.yaml").model)
    images = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="task="):
        model.forward_features(images)
    assert model.forward_features(images, task="normal").shape == (1, 17, 64)


@pytest.mark.parametrize("arch", ["vit_tiny_patch16_224", "vit_small_patch16_224"])
def test_from_timm_forward_features_equal(arch):
    torch.manual_seed(0)
    vit = timm.create_model(arch, pretrained=False, img_size=48, patch_size=8, num_classes=7).eval()
    model = squad.from_timm(vit).eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        assert (model.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5
        assert (model(x).preds["timm"] - vit(x)).abs().max() < 1e-5


def test_from_timm_into_mod_plan_keeps_dense_weights():
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8).eval()
    plan = [squad.config.model.BlockSpec(), squad.config.model.BlockSpec(mod="attention")]
    model = squad.from_timm(vit, plan=plan, overrides={"mod": {"capacity": 1.0}}).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():  # capacity 1.0 with attention routing is the dense model
        assert (model.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5


def test_mone_capacity_setting():
    model = squad.build_model(tiny_config("configs/model/mone_vit_s.yaml").model).eval()
    x = torch.randn(1, 3, 32, 32)
    model.set_mone_capacity(0.5)
    a = model(x, ["normal"]).preds["normal"]
    model.set_mone_capacity(1.0)
    b = model(x, ["normal"]).preds["normal"]
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="capacity"):
        model.set_mone_capacity(1.5)


@pytest.mark.parametrize(("chans", "dim", "patch", "h", "w"), [(3, 8, 4, 12, 20), (5, 7, 3, 11, 10), (1, 6, 1, 3, 5)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_patch_conv_is_the_convolution(chans, dim, patch, h, w, channels_last):
    """The patch embedding as one GEMM equals F.conv2d (float64; odd widths, sizes the stride does not divide, a
    channels-last input) in value and in the module's output shape, gradients included."""
    from squad.models.vit import PatchConv

    torch.manual_seed(0)
    conv = PatchConv(chans, dim, kernel_size=patch, stride=patch).double()
    assert conv.tiles()
    x = torch.randn(2, chans, h, w, dtype=torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_(True)
    out = conv(x)
    ref = torch.nn.functional.conv2d(x, conv.weight, conv.bias, stride=patch)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (x, conv.weight, conv.bias))
    refs = torch.autograd.grad(ref.square().sum(), (x, conv.weight, conv.bias))
    for g, r in zip(grads, refs, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    other = PatchConv(chans, dim, kernel_size=patch + 1, stride=patch).double()  # overlapping: the convolution
    assert not other.tiles()
    torch.testing.assert_close(other(x), torch.nn.functional.conv2d(x, other.weight, other.bias, stride=patch))


def test_patch_embed_keeps_its_state_dict():
    """The GEMM path changes no parameter: the keys and shapes timm checkpoints, hub folders and exports name."""
    model = squad.build_model(tiny_model_cfg())
    assert isinstance(model.patch_embed.proj, torch.nn.Conv2d)
    state = model.state_dict()
    d, c, p = model.cfg.embed_dim, model.cfg.in_chans, model.cfg.patch_size
    assert state["patch_embed.proj.weight"].shape == (d, c, p, p)
    assert state["patch_embed.proj.bias"].shape == (d,)
    assert [k for k in state if k.startswith("patch_embed.")] == ["patch_embed.proj.weight", "patch_embed.proj.bias"]
    images = torch.randn(2, c, model.cfg.img_size, model.cfg.img_size)
    conv = torch.nn.functional.conv2d(images, model.patch_embed.proj.weight, model.patch_embed.proj.bias, stride=p)
    torch.testing.assert_close(model.patch_embed(images), conv.flatten(2).transpose(1, 2))
