import re

import pytest
import yaml

import squad
from squad.config.base import write_yaml
from squad.config.loading import load_config
from squad.config.model import ConfigError
from tests.helpers import MODEL_CONFIGS


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_paper_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.name == path.stem
    assert len(cfg.model.blocks()) == cfg.model.depth


def test_overrides_and_roundtrip(tmp_path):
    cfg = load_config(MODEL_CONFIGS[0], ["model.depth=6", "model.mod.capacity=0.25", "loss.w_mi=0.01"])
    assert cfg.model.depth == 6 and cfg.model.mod.capacity == 0.25 and cfg.loss.w_mi == 0.01
    out = tmp_path / "resolved.yaml"
    write_yaml(cfg, out)
    again = load_config(out)
    assert again == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        (["model.dept=3"], "model.dept"),
        (["model.moe.topk=2"], "model.moe.topk"),
        (["model.depth=three"], "model.depth"),
        (["model.moe.top_k=20"], "model.moe.top_k"),
        (["model.moa.top_k=30"], "model.moa.top_k"),
        (["model.mod.capacity=1.5"], "model.mod.capacity"),
        (["model.mod.capacity=0"], "model.mod.capacity"),
        (["model.mone.capacity=1.2"], "model.mone.capacity"),
        (["model.task_embed=sometimes"], "model.task_embed"),
        (["model.img_size=30"], "model.img_size"),
        (["model.heads=[nonexistent_task]"], "nonexistent_task"),
        (["model.qkv_bias=3"], "model.qkv_bias"),
    ],
)
def test_bad_config_names_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_config(MODEL_CONFIGS[0], override)


def test_attention_routing_needs_previous_attention():
    with pytest.raises(ConfigError, match="block 0"):
        squad.model_config({"plan": [{"mod": "attention"}], "heads": ["depth"]})


def test_base_inheritance(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"model": {"depth": 3, "heads": ["normal"]}}))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump({"base": "a.yaml", "model": {"embed_dim": 96, "num_heads": 3}}))
    cfg = load_config(tmp_path / "b.yaml")
    assert cfg.model.depth == 3 and cfg.model.embed_dim == 96 and cfg.model.task_names == ["normal"]


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/model/does_not_exist.yaml")


@pytest.mark.parametrize("path", ["configs/demo.yaml", "configs/taskonomy/modsquad_vit_b.yaml",
                                  "configs/taskonomy/mtl_vit_b.yaml"])
def test_run_configs_load(path):
    from squad.config.run import RunConfig, deepspeed_config

    cfg = load_config(path, cls=RunConfig)
    assert len(cfg.train_tasks()) == 13
    ds = deepspeed_config(cfg, cuda=False)
    assert ds["train_micro_batch_size_per_gpu"] == cfg.optim.batch_per_rank and not ds["bf16"]["enabled"]


@pytest.mark.parametrize("override, needle", [
    (["optim.steps=0", "optim.epochs=0"], "optim.steps"),
    (["train.zero_stage=4"], "train.zero_stage"),
    (["train.tasks_per_image=20"], "train.tasks_per_image"),
    (["data.tasks=[depth, flow]"], "data.tasks"),
    (["data.image_size=32"], "data.image_size"),
    # non-finite and out-of-range numbers, each named by its key (NaN clipping used to switch clipping off)
    (["optim.lr=.nan"], "optim.lr"),
    (["optim.lr=.inf"], "optim.lr"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.eps=-1"], "optim.eps"),
    (["optim.eps=0"], "optim.eps"),
    (["optim.clip=.nan"], "optim.clip"),
    (["optim.clip=-1"], "optim.clip"),
    (["optim.betas=[0.9, .nan]"], r"optim.betas[1]"),
    (["optim.epochs=-1"], "optim.epochs"),
    (["optim.steps=-5"], "optim.steps"),
    (["optim.min_lr=1"], "optim.min_lr"),
    (["optim.grad_accum=0"], "optim.grad_accum"),
    (["optim.weight_decay=-.inf"], "optim.weight_decay"),
    (["data.split=foo"], "data.split"),
    (["data.val_split=validation"], "data.val_split"),
    (["data.resize=16"], "data.resize"),
    (["data.workers=-1"], "data.workers"),
    (["train.seed=-1"], "train.seed"),
    (["loss.w_mi=.nan"], "loss.w_mi"),
    (["model.mod.capacity=.nan"], "model.mod.capacity"),
    (["model.mlp_ratio=.inf"], "model.mlp_ratio"),
])
def test_bad_run_config(override, needle):
    from squad.config.run import RunConfig

    with pytest.raises(ConfigError, match="^" + re.escape(needle)):  # the message starts with the key
        load_config("configs/demo.yaml", override, cls=RunConfig)


def test_scientific_notation_without_dot():
    from squad.config.run import RunConfig

    cfg = load_config("configs/demo.yaml", ["optim.lr=1e-4", "optim.min_lr=2E-7"], cls=RunConfig)
    assert cfg.optim.lr == 1e-4 and cfg.optim.min_lr == 2e-7
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config("configs/demo.yaml", ["optim.lr=fast"], cls=RunConfig)


def test_yaml_syntax_errors_name_the_file_or_the_override(tmp_path):
    from squad.config.base import ConfigError, apply_overrides, read_yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  depth: [2\n")
    with pytest.raises(ConfigError, match=rf"{bad}: not valid YAML") as e:
        read_yaml(bad)
    assert f"in {bad}, line 2" in str(e.value) and "<unicode string>" not in str(e.value)
    with pytest.raises(ConfigError, match=r"override data.tasks: value '\[depth' is not valid YAML") as e:
        apply_overrides({}, ["data.tasks=[depth"])
    assert "at line 1, column" in str(e.value) and "<unicode string>" not in str(e.value)
