"""The tools' options as configs: one dataclass per tool that has many (extract, finetune_router, evaluate, predict,
visualize, make_data pack, upcycle, adapt_pretrained), and `InferenceOptions`, how a loaded model runs, which every
tool that runs one shares.

A tool builds its config from its arguments in one place (`from_namespace`: each field from the argument of the
same name, a nested options dataclass from the same arguments) and takes its defaults from the config
(`defaults`: ``parser.set_defaults(**defaults(ExtractConfig))``), so an option is declared once here — name, type,
default, what it means — and once as an argument (flag and help). The library function takes the config; `check`
rejects a bad value naming the option as the tool spells it. Adding an option is one field here and one argument
there (``precision``, the dtype evaluate / predict / extract run a model in, is one field of each of their configs
and one shared argument, ``squad.cli.evaluate.add_precision_argument``); an option of how a loaded model routes is
one field of `InferenceOptions` (the keywords of `squad.models.inference.set_inference`) and one argument of
``squad.cli.evaluate.add_inference_arguments``.

This module imports nothing but the standard library (and `squad.config.base`'s error type), so a tool can check
its options before torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any, Literal, TypeVar

from squad.config.base import ConfigError

C = TypeVar("C")
INITS = ("mean", "zero", "random")  # where a new task's router rows and task embedding start (router fine-tuning)
PRECISIONS = ("bf16", "fp32")  # the dtypes a model runs in at inference (`squad.models.precision`)
Precision = Literal["bf16", "fp32"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(cfg: Any, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < minimum:
            raise ConfigError(f"{_flag(name)} must be >= {minimum}, got {value}")


def _check_precision(precision: str | None) -> None:
    if precision not in (None, *PRECISIONS):
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def check_theta(theta: float | None) -> None:
    """Raises ValueError unless θ (an extraction's usage threshold) is None or in [0, 1)."""
    if theta is not None and not (0.0 <= theta < 1.0 and math.isfinite(theta)):
        raise ConfigError(f"theta must be in [0, 1) (a share of the task's tokens), got {theta}")


def check_keep_top(keep_top: float | None) -> None:
    """Raises ValueError unless H (an extraction's share of experts kept per layer) is None or in (0, 1]."""
    if keep_top is not None and not (0.0 < keep_top <= 1.0):
        raise ConfigError(f"keep_top must be in (0, 1] (a share of each layer's experts), got {keep_top}")


@dataclasses.dataclass
class InferenceOptions:
    """How a loaded model runs (`squad.models.inference.set_inference` takes these as keywords); None leaves the
    model as it was saved."""

    mone_capacity: float | None = None  # MoNE effective capacity e_c in [1/2^(E-1), 1] (MoNE models)
    mod_inference: Literal["topk", "threshold"] | None = None  # MoD: top-k tokens, or a learned router's yes

    def check(self) -> None:
        """Raises ConfigError for a value no model takes (the model's own limits are checked when it is set)."""
        if self.mod_inference not in (None, "topk", "threshold"):
            raise ConfigError(f"--mod-inference must be topk or threshold, got {self.mod_inference!r}")
        if self.mone_capacity is not None and not 0.0 < self.mone_capacity <= 1.0:
            raise ConfigError(f"--mone-capacity must be in (0, 1], got {self.mone_capacity}")


@dataclasses.dataclass
class ExtractConfig:
    """tools/extract.py's options (`squad.posttrain.extract.extract_to_file`)."""

    theta: float | None = 0.01  # remove experts used by at most this share of the task's tokens, in [0, 1)
    keep_top: float | None = None  # instead keep the top H share of experts per layer, H in (0, 1]
    renormalize: bool = False  # the paper's pruned router (softmax over the kept experts) instead of exact routing
    data: str | None = None  # dataset root for the calibration pass and the held-out metrics
    calib_split: str = "train"
    calib_batches: int = 8  # 0: the whole split
    eval_split: str | None = "val"  # held-out split for the metrics before / after (None: no metrics)
    eval_batches: int = 0  # 0: the whole split
    batch_size: int = 8
    saved_usage: bool = False  # the usage statistics saved with the model even when data is given
    device: str = "cpu"
    workers: int = 0  # data loader workers
    precision: Precision | None = None  # the calibration pass's and the metrics' dtype (None: bf16 on CUDA, else fp32)
    inference: InferenceOptions = dataclasses.field(default_factory=InferenceOptions)

    def check(self) -> None:
        """Raises ConfigError for an out-of-range value (θ, H, counts) or neither criterion."""
        check_theta(self.theta if self.keep_top is None else None)
        check_keep_top(self.keep_top)
        if self.keep_top is None and self.theta is None:
            raise ConfigError("give theta (a usage threshold) or keep_top (a share of experts per layer)")
        _at_least(self, 1, "batch_size")
        _at_least(self, 0, "calib_batches", "eval_batches", "workers")
        _check_precision(self.precision)
        self.inference.check()


@dataclasses.dataclass
class FinetuneConfig:
    """Router fine-tuning's settings, shared by every (mode, subset) run (`squad.posttrain.finetune`).

    Every mode trains with AdamW for ``steps`` steps of ``batch_size`` images. Without held-out selection
    (``holdout`` 0) each run uses ``lr`` and keeps its last weights. With it, a seeded ``holdout`` share of each
    subset's images is set aside: each run is tried at every lr of ``lrs`` (default: ``lr`` alone), the held-out
    metric is measured ``evals`` times along it, and the best evaluation's lr and weights are kept.
    """

    steps: int = 200  # AdamW steps per run (every mode: the linear probe's too)
    batch_size: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = ()  # held-out selection: the lrs to pick from (empty: lr alone)
    holdout: float = 0.0  # share of a subset's images held out to pick the lr and the stopping step (0: none)
    evals: int = 1  # held-out evaluations along each run (the best is kept)
    init: Literal["mean", "zero", "random"] = "mean"  # new router rows / embedding: mean of the tasks', 0, random
    seed: int = 0
    eval_batches: int = 0  # 0: the whole evaluation split
    device: str = "cpu"
    workers: int = 0
    verify_frozen: bool = True  # compare every frozen parameter bitwise after training

    def check(self) -> None:
        """Raises ConfigError for an out-of-range value or held-out options without a held-out share."""
        _at_least(self, 1, "steps", "batch_size", "evals")
        _at_least(self, 0, "eval_batches", "workers")
        if not all(v > 0 and math.isfinite(v) for v in (self.lr, *self.lrs)):
            raise ConfigError(f"--lr must be > 0, got {', '.join(f'{v:g}' for v in (self.lr, *self.lrs))}")
        if self.init not in INITS:
            raise ConfigError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        if not 0.0 <= self.holdout < 1.0:
            raise ConfigError(f"--holdout must be in [0, 1) (a share of each subset's images), got {self.holdout}")
        if not self.holdout and (self.lrs or self.evals > 1):
            raise ConfigError("--lrs and --evals pick an lr and a stopping step on held-out images: give --holdout")

    @property
    def selects(self) -> bool:
        """Whether runs are chosen on held-out images (``holdout`` > 0)."""
        return self.holdout > 0.0

    def lr_grid(self) -> tuple[float, ...]:
        """The lrs each run is tried at."""
        return self.lrs or (self.lr,)


@dataclasses.dataclass
class EvaluateConfig:
    """tools/evaluate.py's options for one model (`squad.eval.evaluate.evaluate_run`)."""

    split: str = "val"  # train, val, test or all
    tasks: list[str] | None = None  # default: every task of the model
    batches: int = 0  # 0: the whole split
    batch_size: int = 8
    device: str = "cpu"
    workers: int = 0
    compile: bool = False  # torch.compile the model first
    precision: Precision | None = None  # the dtype the model is cast to (None: bf16 on CUDA, else fp32)
    inference: InferenceOptions = dataclasses.field(default_factory=InferenceOptions)

    def check(self) -> None:
        """Raises ConfigError for an out-of-range count or an unknown precision."""
        _at_least(self, 1, "batch_size")
        _at_least(self, 0, "batches", "workers")
        _check_precision(self.precision)
        self.inference.check()


@dataclasses.dataclass
class PredictConfig:
    """tools/predict.py's options (`squad.deploy.predict.predict`)."""

    tasks: list[str] | None = None  # default: every task of the model
    batch_size: int = 8  # images per forward pass
    device: str | None = None  # default: cuda when available, else cpu
    encode: Literal["npy", "taskonomy"] = "npy"  # raw values in task units, or as Taskonomy's PNG encodings
    compile: bool = False
    precision: Precision | None = None  # the dtype the model is cast to (None: bf16 on CUDA, else fp32)
    inference: InferenceOptions = dataclasses.field(default_factory=InferenceOptions)

    def check(self) -> None:
        """Raises ConfigError for an out-of-range value."""
        _at_least(self, 1, "batch_size")
        if self.encode not in ("npy", "taskonomy"):
            raise ConfigError(f"--encode must be npy or taskonomy, got {self.encode!r}")
        _check_precision(self.precision)
        self.inference.check()


@dataclasses.dataclass
class VisualizeConfig:
    """tools/visualize.py's options (`squad.analysis.figures.draw_figures`)."""

    data: str | None = None  # dataset root for a calibration pass (relations, routing pictures)
    split: str = "val"
    batches: int = 4  # calibration batches (0: the whole split)
    batch_size: int = 8
    images: int = 4  # validation images the routing pictures show (MoD / A-MoD / MoNE models; 0: none)
    device: str = "cpu"
    workers: int = 0
    inference: InferenceOptions = dataclasses.field(default_factory=InferenceOptions)

    def check(self) -> None:
        """Raises ConfigError for an out-of-range count."""
        _at_least(self, 1, "batch_size")
        _at_least(self, 0, "batches", "images", "workers")
        self.inference.check()


@dataclasses.dataclass
class PackConfig:
    """``tools/make_data.py pack``'s options (`squad.data.offline.pack.pack_shards`)."""

    dataset: Literal["taskonomy", "pascal_context", "nyud"] | None = None  # None: detected from the source's layout
    split: str | None = None  # split CSV: a path or a name (tiny, medium, full, ...); None: the one in the source
    partitions: tuple[str, ...] = ("train", "val", "test")  # which partitions to pack
    image_size: int | None = 256  # stored size; None (0 on the command line) keeps the file size
    shard_size: int = 1024  # samples per shard file
    domains: list[str] | None = None  # default: rgb and every task domain present
    compression: Literal["lzf", "gzip"] | None = None  # h5py compression; None reads fastest
    workers: int = 2  # reader processes (0: read in this process)

    def __post_init__(self) -> None:
        self.image_size = self.image_size or None

    def check(self) -> None:
        """Raises ConfigError for an out-of-range count or an unknown dataset or compression."""
        _at_least(self, 1, "shard_size")
        _at_least(self, 0, "workers")
        if self.image_size is not None and self.image_size < 0:
            raise ConfigError(f"--image-size must be >= 0 (0 keeps the file size), got {self.image_size}")
        if self.dataset not in (None, "taskonomy", "pascal_context", "nyud"):
            raise ConfigError(f"--dataset must be taskonomy, pascal_context or nyud, got {self.dataset!r}")
        if self.compression not in (None, "lzf", "gzip"):
            raise ConfigError(f"--compression must be lzf or gzip, got {self.compression!r}")
        if not self.partitions:
            raise ConfigError("--partitions names no partition")


@dataclasses.dataclass
class UpcycleConfig:
    """``tools/upcycle.py``'s schemes and measurement (`squad.models.transfer.transfer`, `squad.posttrain.upcycle`)."""

    moe_scheme: Literal["auto", "copy", "partition"] = "auto"  # MoE-MLP experts: copies or slices of the dense MLP
    kv: Literal["mean", "first"] = "mean"  # MoE attention's shared key/value head: the dense heads' mean, or head 0's
    task_embed: Literal["zero", "fresh"] = "zero"  # task embeddings the dense model lacks (zero keeps step 0 exact)
    seed: int = 0  # seed of the fresh parts (routers, new heads) and of the drift images
    images: int = 8  # random images the step-0 drift is measured on (0: none)

    def check(self) -> None:
        """Raises ConfigError for an unknown scheme or a negative image count."""
        for name, allowed in (("moe_scheme", ("auto", "copy", "partition")), ("kv", ("mean", "first")),
                              ("task_embed", ("zero", "fresh"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        _at_least(self, 0, "images")


@dataclasses.dataclass
class AdaptConfig:
    """``tools/adapt_pretrained.py``'s options: a dense model turned into MoD without training
    (`squad.posttrain.adapt.to_mod`), and the evaluation of both routings."""

    capacity: float = 0.5  # share of tokens each MoD block processes, in (0, 1]
    routing: Literal["attention", "learned"] = "attention"  # the routing of the model written (both are evaluated)
    every: int = 2  # MoD on every N-th block
    data: str | None = None  # Taskonomy-format data to evaluate on (None: no metrics)
    split: str = "val"
    batches: int = 8  # evaluation batches (0: the whole split)
    batch_size: int = 16
    num_heads: int | None = None  # attention heads of a timm file (when the file does not record them)

    def check(self) -> None:
        """Raises ConfigError for an out-of-range capacity, count or an unknown routing."""
        if not 0.0 < self.capacity <= 1.0:
            raise ConfigError(f"--capacity must be in (0, 1], got {self.capacity}")
        if self.routing not in ("attention", "learned"):
            raise ConfigError(f"--routing must be attention or learned, got {self.routing!r}")
        _at_least(self, 1, "every", "batch_size")
        _at_least(self, 0, "batches")
        if self.num_heads is not None:
            _at_least(self, 1, "num_heads")


def _nested(cls: type) -> dict[str, type]:
    """Field name → dataclass type, for the fields of ``cls`` that are option dataclasses themselves."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def defaults(cls: type) -> dict[str, Any]:
    """Argument name → default of every option of ``cls`` (nested option dataclasses flattened), for
    ``parser.set_defaults``."""
    nested = _nested(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            out.update(defaults(nested[f.name]))
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _build(cls: type[C], values: dict[str, Any]) -> C:
    nested = _nested(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in nested:
            kwargs[f.name] = _build(nested[f.name], values)
        elif f.name in values:
            value = values[f.name]
            kwargs[f.name] = tuple(value) if isinstance(f.default, tuple) and value is not None else value
    return cls(**kwargs)


def from_namespace(cls: type[C], args: argparse.Namespace | dict[str, Any]) -> C:
    """The config ``cls`` from parsed arguments (each field from the argument of its name; a nested option
    dataclass from the same arguments; an argument the tool does not have keeps the field's default), checked.

    Raises:
        ConfigError: a value the config's ``check`` refuses.
    """
    cfg = _build(cls, vars(args) if isinstance(args, argparse.Namespace) else dict(args))
    cfg.check()
    return cfg
