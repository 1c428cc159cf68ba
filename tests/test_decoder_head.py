"""The light decoder option of dense heads (``decoder: light``): shapes, its MACs in `squad.profile` against PyTorch's
FLOP counter and a hand count, config validation, and that a model with it saves, loads and extracts."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import squad
from squad.analysis.flops import count_params
from squad.config.base import ConfigError
from squad.layers.heads import DenseHead, LightDecoder
from squad.posttrain.extract import collect_usage, extract
from tests.helpers import tiny_model, tiny_model_cfg
from tests.test_profile import _counted_macs  # noqa: F401  (registers the FLOP formulas of SDPA on CPU, grouped mm)

LIGHT = {"name": "a", "kind": "dense", "channels": 3, "decoder": "light", "decoder_width": 24}
LINEAR = {"name": "b", "kind": "dense", "channels": 2}


def _counted(model: squad.SquadViT, task: str, size: int) -> int:
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, size, size), [task])
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("patch", [8, 16, 6, 1])
def test_light_decoder_shape_and_macs_match_flop_counter(patch):
    """Any patch size (powers of two or not) lands on g·p pixels; profile's MACs are what the forward pass does."""
    size = 4 * patch
    model = squad.build_model(tiny_model_cfg(img_size=size, patch_size=patch, heads=[LIGHT, LINEAR])).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, size, size), ["a", "b"]).preds
    assert out["a"].shape == (2, 3, size, size) and out["b"].shape == (2, 2, size, size)
    prof = squad.profile(model)
    for task in ("a", "b"):
        assert prof["tasks"][task]["macs"] == _counted(model, task, size), task
    head = model.heads["a"]
    assert isinstance(head, DenseHead) and isinstance(head.decoder_net, LightDecoder)
    assert prof["tasks"]["a"]["macs"] - prof["backbone_macs"] == head.macs(model.cfg.grid ** 2)


def test_light_decoder_hand_count():
    """D=64, C=3, p=8, g=4, width 24: convs 64→24 at 4², 24→16 at 8², 16→16 at 16² and 32², then 1×1 16→3 at 32²."""
    model = squad.build_model(tiny_model_cfg(heads=[LIGHT, LINEAR]))
    head = model.heads["a"]
    assert [c.out_channels for c in head.decoder_net.convs] == [24, 16, 16, 16]
    assert head.decoder_net.sizes == [4, 8, 16, 32]
    macs = 4**2 * 64 * 24 * 9 + 8**2 * 24 * 16 * 9 + 16**2 * 16 * 16 * 9 + 32**2 * 16 * 16 * 9 + 32**2 * 16 * 3
    assert head.macs(16) == macs == 3_440_640
    params = (64 * 24 * 9 + 24) + (24 * 16 * 9 + 16) + 2 * (16 * 16 * 9 + 16) + 2 * (24 + 16 + 16 + 16) + (16 * 3 + 3)
    assert count_params(head) == params == 22_155
    # the task's active parameters count its own head, whichever decoder it has
    linear = squad.build_model(tiny_model_cfg(heads=[{**LIGHT, "decoder": "linear"}, LINEAR]))
    gap = squad.profile(model)["tasks"]["a"]["active_params"] - squad.profile(linear)["tasks"]["a"]["active_params"]
    assert gap == params - count_params(linear.heads["a"])


@pytest.mark.parametrize("head, needle", [
    ({"name": "c", "kind": "class", "channels": 4, "decoder": "light"}, "heads[0].decoder=light needs kind=dense"),
    ({**LIGHT, "decoder_width": 0}, "heads[0].decoder_width must be >= 1"),
    ({**LIGHT, "decoder": "heavy"}, "heads[0].decoder must be one of linear, light, got 'heavy'"),
])
def test_decoder_config_is_checked(head, needle):
    with pytest.raises(ConfigError) as e:
        squad.model_config({"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2,
                            "heads": [head]})
    assert needle in str(e.value), str(e.value)


def test_light_decoder_saves_loads_and_extracts(tmp_path):
    """A Mod-Squad with a light-decoder head: model.pt round trip; the extracted task keeps its decoder and predicts
    what the full model predicts (θ = 0 keeps every expert the calibration images used; exact routing)."""
    model = tiny_model([LIGHT, LINEAR], seed=1)
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        full = model(images, ["a", "b"]).preds
    squad.io.export_model(tmp_path / "model.pt", model, None)
    loaded = squad.load(tmp_path / "model.pt")
    assert loaded.cfg.head_configs()[0].decoder == "light" and loaded.cfg.head_configs()[0].decoder_width == 24
    with torch.no_grad():
        torch.testing.assert_close(loaded(images, ["a"]).preds["a"], full["a"])

    usage = collect_usage(model, "a", [images])
    ext = extract(model, "a", usage, theta=0.0)
    squad.io.save_extracted(tmp_path / "a.pt", ext)
    single = squad.load(tmp_path / "a.pt")
    assert list(single.model.heads) == ["a"] and isinstance(single.model.heads["a"].decoder_net, LightDecoder)
    with torch.no_grad():
        torch.testing.assert_close(single(images), full["a"])
    prof = squad.profile(single.model)
    assert prof["tasks"]["a"]["macs"] - prof["backbone_macs"] == model.heads["a"].macs(16)
