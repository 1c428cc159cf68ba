"""The public API a timm user expects: named models from any directory, every `build_model` input, config roots,
overrides with or without ``model.``, task names as strings, `from_timm` heads as names, routers' initial state."""

import os
import subprocess
import sys

import pytest
import timm
import torch
import yaml

import squad
from squad.config.base import ConfigError, config_root, to_dict
from squad.config.model import RouterConfig
from tests.helpers import MODEL_CONFIGS, ROOT, tiny_config

TINY_FIELDS = dict(img_size=32, patch_size=8, embed_dim=64, num_heads=4, depth=2, head_dim=None,
                   moa={"head_dim": 16, "num_experts": 6, "top_k": 3}, moe={"num_experts": 4, "top_k": 2})


def test_list_models_names_the_paper_configs():
    names = squad.list_models()
    assert names == sorted(p.stem for p in MODEL_CONFIGS)
    assert "modsquad_vit_s" in names and not any(n.startswith("_") for n in names)
    assert squad.list_models("*vit_s") == ["amod_vit_s", "mod_vit_s", "modsquad_vit_s", "mone_vit_s"]
    assert squad.list_models("modsquad_*") == ["modsquad_vit_b", "modsquad_vit_l", "modsquad_vit_s",
                                               "modsquad_vit_s_nyud", "modsquad_vit_s_pascal"]
    assert squad.list_models("nothing*") == []


def test_create_model_from_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = squad.create_model("modsquad_vit_s", depth=4, img_size=64)
    assert isinstance(model, squad.SquadViT)
    assert model.cfg.depth == 4 and model.cfg.img_size == 64 and model.cfg.name == "modsquad_vit_s"
    assert model.cfg.embed_dim == 384 and len(model.task_names) == 13  # from _vit_s.yaml / _taskonomy13.yaml bases


@pytest.mark.slow
def test_create_model_in_a_fresh_interpreter_elsewhere(tmp_path):
    code = ("import squad; m = squad.create_model('mtl_vit_b', depth=1, embed_dim=48, num_heads=3, img_size=32); "
            "print(m.cfg.depth, len(m.task_names))")
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["1", "13"]


def test_create_model_fields_merge_and_validate_like_yaml():
    model = squad.create_model("modsquad_vit_s", **TINY_FIELDS, heads=["depth", "normal"])
    cfg = model.cfg
    assert cfg.moe.num_experts == 4 and cfg.moe.top_k == 2
    assert cfg.moe.router.noise is False  # nested mappings merge into the file's, key by key
    assert cfg.task_names == ["depth_euclidean", "normal"]
    out = model(torch.randn(1, 3, 32, 32))
    assert set(out.preds) == {"depth_euclidean", "normal"}
    with pytest.raises(ConfigError, match=r"unknown config key model\.dept "):
        squad.create_model("modsquad_vit_s", dept=3)
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k=20"):
        squad.create_model("modsquad_vit_s", moe={"top_k": 20})
    with pytest.raises(ConfigError, match=r"model\.depth: expected an integer"):
        squad.create_model("modsquad_vit_s", depth="three")
    with pytest.raises(ConfigError, match="unknown model 'modsquad_vit_xl'.*modsquad_vit_s"):
        squad.create_model("modsquad_vit_xl")
    with pytest.raises(ValueError, match="no pretrained weights"):
        squad.create_model("modsquad_vit_s", pretrained=True)


def test_create_model_from_a_path():
    model = squad.create_model(ROOT / "configs" / "demo.yaml", depth=2)  # a run config: its model section
    assert model.cfg.name == "demo_modsquad" and model.cfg.depth == 2


def test_packaged_configs_and_base_lookup(tmp_path, monkeypatch):
    assert (config_root() / "model" / "modsquad_vit_s.yaml").is_file()
    monkeypatch.chdir(tmp_path)
    # a user's file anywhere can build on squad's configs by path inside them or by name
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"base": "model/mod_vit_s.yaml", "model": {"depth": 2}}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"base": "mone_vit_s", "model": {"depth": 3}}))
    a, b = squad.load_config("a.yaml"), squad.load_config("b.yaml")
    assert (a.model.name, a.model.depth, a.model.embed_dim) == ("mod_vit_s", 2, 384)
    assert (b.model.name, b.model.depth) == ("mone_vit_s", 3)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"base": "nowhere.yaml"}))
    with pytest.raises(ConfigError, match="base 'nowhere.yaml' not found"):
        squad.load_config("c.yaml")


@pytest.mark.parametrize("path", ["demo.yaml", "taskonomy/modsquad_vit_b.yaml", "taskonomy/mtl_vit_b.yaml"])
def test_run_configs_bases_resolve_from_anywhere(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = squad.load_config(config_root() / path)
    assert isinstance(cfg, squad.RunConfig) and len(cfg.train_tasks()) == 13


def test_build_model_accepts_every_input_kind(tmp_path, monkeypatch):
    torch.manual_seed(0)
    squad_cfg = tiny_config(ROOT / "configs" / "model" / "mtl_vit_b.yaml")
    run_cfg = squad.load_config(ROOT / "configs" / "demo.yaml")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": {**to_dict(squad_cfg.model), "plan": [{}], "heads": ["normal"]}}))
    built = {
        "ModelConfig": squad.build_model(squad_cfg.model),
        "SquadConfig": squad.build_model(squad_cfg),
        "RunConfig": squad.build_model(run_cfg),
        "path": squad.build_model(path),
        "path str": squad.build_model(str(path)),
    }
    for kind, model in built.items():
        assert isinstance(model, squad.SquadViT), kind
    assert built["SquadConfig"].cfg == squad_cfg.model
    assert built["RunConfig"].cfg == run_cfg.model
    assert built["path"].task_names == ["normal"]
    monkeypatch.chdir(tmp_path)
    torch.set_default_device("meta")  # a ViT-S by name: shapes only
    try:
        by_name = squad.build_model("mone_vit_s")
    finally:
        torch.set_default_device("cpu")
    assert by_name.cfg.name == "mone_vit_s"
    with pytest.raises(TypeError, match="build_model takes"):
        squad.build_model({"depth": 2})


def test_load_config_picks_the_root():
    assert type(squad.load_config("modsquad_vit_s")) is squad.SquadConfig
    assert type(squad.load_config(ROOT / "configs" / "model" / "mtl_vit_b.yaml")) is squad.SquadConfig
    assert type(squad.load_config(ROOT / "configs" / "demo.yaml")) is squad.RunConfig
    assert type(squad.load_config(ROOT / "configs" / "taskonomy" / "mtl_vit_b.yaml")) is squad.RunConfig
    with pytest.raises(ConfigError, match="run config.*cls=RunConfig"):
        squad.load_config(ROOT / "configs" / "demo.yaml", cls=squad.SquadConfig)


def test_model_config_overrides_with_or_without_prefix():
    plain = squad.model_config("modsquad_vit_s", ["depth=4", "moe.top_k=2", "heads=[normal]"])
    prefixed = squad.model_config("modsquad_vit_s", ["model.depth=4", "model.moe.top_k=2", "model.heads=[normal]"])
    assert plain == prefixed
    assert (plain.depth, plain.moe.top_k, plain.task_names) == (4, 2, ["normal"])
    from_run = squad.model_config(ROOT / "configs" / "demo.yaml", ["depth=2"])
    assert from_run.name == "demo_modsquad" and from_run.depth == 2
    with pytest.raises(ConfigError, match=r"model\.dept"):
        squad.model_config("modsquad_vit_s", ["dept=4"])


def test_config_package_reexports():
    import squad.config as c

    for name in ("ConfigError", "ModelConfig", "SquadConfig", "RunConfig", "load_config", "model_config"):
        assert hasattr(c, name), name
    for name in ("create_model", "list_models", "RunConfig", "build_model", "from_timm", "load", "load_model"):
        assert name in squad.__all__ and hasattr(squad, name), name


def test_single_task_string_and_duplicate_aliases():
    torch.manual_seed(0)
    model = squad.build_model(tiny_config(ROOT / "configs" / "model" / "modsquad_vit_s.yaml").model).eval()
    x = torch.randn(2, 3, 32, 32)
    one = model(x, "depth")
    assert list(one.preds) == ["depth_euclidean"]
    assert torch.equal(one.preds["depth_euclidean"], model(x, ["depth"]).preds["depth_euclidean"])
    assert list(model(x, "normal", assignment=torch.ones(2, 1, dtype=torch.bool)).preds) == ["normal"]
    with pytest.raises(ValueError, match="'depth' and 'depth_euclidean' are both task 'depth_euclidean'"):
        model(x, ["depth", "depth_euclidean"])
    with pytest.raises(ValueError, match="'normal' and 'normal' are both task 'normal'"):
        model(x, ["normal", "normal"])


def test_from_timm_heads_as_task_names_and_mappings():
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8).eval()
    model = squad.from_timm(vit, heads=["depth_euclidean", {"name": "objects", "kind": "class", "channels": 5}],
                            plan=[{"attn": "dense", "mlp": "dense"}]).eval()
    assert model.task_names == ["depth_euclidean", "objects"]
    out = model(torch.randn(2, 3, 32, 32))
    assert out.preds["depth_euclidean"].shape == (2, 1, 32, 32) and out.preds["objects"].shape == (2, 5)
    assert squad.from_timm(vit, heads="normal").task_names == ["normal"]
    with torch.no_grad():  # the backbone is timm's whatever the heads
        x = torch.randn(1, 3, 32, 32)
        assert (model.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5
    with pytest.raises(ConfigError, match=r"model\.heads.*no_such_task"):
        squad.from_timm(vit, heads=["no_such_task"])
    with pytest.raises(ConfigError, match=r"model\.heads\[0\]\.channels"):
        squad.from_timm(vit, heads=[{"name": "x", "channels": 0}])


def _step0_choices(zero_init: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    router = {"noise": False, "zero_init": zero_init}
    fields = {**TINY_FIELDS, "depth": 4, "moa": {**TINY_FIELDS["moa"], "router": router},
              "moe": {**TINY_FIELDS["moe"], "router": router}}
    model = squad.create_model("modsquad_vit_s", **fields)
    model.record_routing = True
    out = model(torch.randn(2, 3, 32, 32), ["depth", "normal"])
    return [s.experts for s in out.stats if s.experts is not None]


def test_routers_start_untied_like_the_authors():
    assert RouterConfig().zero_init is False
    choices = _step0_choices(zero_init=False)
    assert len(choices) == 4  # two MoE-attention and two MoE-MLP layers
    for experts in choices:  # trunc-normal(0.02) routers: tokens spread over the experts from step 0
        assert len({tuple(sorted(row.tolist())) for row in experts}) > 1
    for experts in _step0_choices(zero_init=True):  # the opt-in zero init ties every token to the same k experts
        assert len({tuple(sorted(row.tolist())) for row in experts}) == 1
