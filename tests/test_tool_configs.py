"""The tools' options as configs (squad.config.tools): each tool builds its config from its arguments in one place and
takes its defaults from it, the configs check their values naming the option, and the module needs no torch."""

import ast
import dataclasses
import sys

import pytest

from squad.cli import adapt_pretrained, evaluate, extract, finetune_router, make_data, predict, upcycle, visualize
from squad.config.base import ConfigError
from squad.config.tools import (
    AdaptConfig,
    EvaluateConfig,
    ExtractConfig,
    FinetuneConfig,
    InferenceOptions,
    PackConfig,
    PredictConfig,
    UpcycleConfig,
    VisualizeConfig,
    defaults,
    from_namespace,
)
from tests.helpers import ROOT

TOOLS = {  # tool → (its config, the arguments it requires)
    extract: (ExtractConfig, ["--checkpoint", "c", "--task", "depth"]),
    finetune_router: (FinetuneConfig, ["--checkpoint", "c", "--task", "depth", "--data", "d"]),
    evaluate: (EvaluateConfig, ["--checkpoint", "c", "--data", "d"]),
    predict: (PredictConfig, ["--checkpoint", "c", "--images", "i", "--out", "o"]),
    visualize: (VisualizeConfig, ["--checkpoint", "c"]),
    make_data: (PackConfig, ["pack", "--src", "s", "--out", "o"]),
    upcycle: (UpcycleConfig, ["--from", "f", "--config", "c", "--out", "o"]),
    adapt_pretrained: (AdaptConfig, ["--checkpoint", "c", "--out", "o"]),
}


@pytest.mark.parametrize("tool", list(TOOLS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_tool_without_options_runs_its_configs_defaults_and_every_field_is_an_argument(tool):
    cls, required = TOOLS[tool]
    args = tool.build_parser().parse_args(required)
    assert from_namespace(cls, args) == cls()
    missing = [name for name in defaults(cls) if not hasattr(args, name)]
    assert missing == []  # every option of the config is an argument of the tool (the same name)


def test_arguments_reach_the_config_nested_options_included():
    args = extract.build_parser().parse_args(["--checkpoint", "c", "--task", "depth", "--keep-top", "0.4",
                                              "--eval-split", "none", "--mod-inference", "threshold"])
    cfg = from_namespace(ExtractConfig, args)
    assert (cfg.keep_top, cfg.eval_split, cfg.inference) == (0.4, None, InferenceOptions(mod_inference="threshold"))
    args = finetune_router.build_parser().parse_args(["--checkpoint", "c", "--task", "scene", "--data", "d",
                                                      "--holdout", "0.2", "--lrs", "1e-4,1e-3", "--evals", "3"])
    cfg = from_namespace(FinetuneConfig, args)
    assert (cfg.holdout, cfg.lrs, cfg.evals, cfg.selects) == (0.2, (1e-4, 1e-3), 3, True)


@pytest.mark.parametrize("cls, values, message", [
    (ExtractConfig, {"theta": 1.0}, "theta must be in [0, 1)"),
    (ExtractConfig, {"theta": None}, "give theta"),
    (ExtractConfig, {"batch_size": 0}, "--batch-size must be >= 1"),
    (PredictConfig, {"encode": "png"}, "--encode must be npy or taskonomy"),
    (EvaluateConfig, {"inference": InferenceOptions(mone_capacity=0.0)}, "--mone-capacity must be in (0, 1]"),
    (VisualizeConfig, {"images": -1}, "--images must be >= 0"),
    (FinetuneConfig, {"holdout": 1.0}, "--holdout must be in [0, 1)"),
    (FinetuneConfig, {"evals": 3}, "give --holdout"),
    (FinetuneConfig, {"lrs": (1e-3, -1.0), "holdout": 0.2}, "--lr must be > 0"),
    (PackConfig, {"shard_size": 0}, "--shard-size must be >= 1"),
    (PackConfig, {"compression": "zstd"}, "--compression must be lzf or gzip"),
    (PackConfig, {"partitions": ()}, "--partitions names no partition"),
    (UpcycleConfig, {"kv": "last"}, "--kv must be one of mean, first"),
    (UpcycleConfig, {"images": -1}, "--images must be >= 0"),
    (AdaptConfig, {"capacity": 0.0}, "--capacity must be in (0, 1]"),
    (AdaptConfig, {"every": 0}, "--every must be >= 1"),
])
def test_configs_refuse_bad_values_naming_the_option(cls, values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        dataclasses.replace(cls(), **values).check()


def test_pack_options_reach_the_packer_as_a_config():
    """``make_data.py pack --image-size 0`` keeps the file size (None), as the packer's ``image_size=None`` does."""
    args = make_data.build_parser().parse_args(["pack", "--src", "s", "--out", "o", "--image-size", "0",
                                                "--partitions", "train"])
    assert from_namespace(PackConfig, args) == PackConfig(image_size=None, partitions=("train",))


def test_the_configs_module_imports_no_torch():
    """A tool can check its options before torch is imported: the module reads the standard library and the config
    errors only."""
    tree = ast.parse((ROOT / "squad" / "config" / "tools.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    outside = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert outside == {"squad.config.base"}
    base = ast.parse((ROOT / "squad" / "config" / "base.py").read_text())
    assert not {a.name for n in ast.walk(base) if isinstance(n, ast.Import) for a in n.names} & {"torch", "numpy"}
