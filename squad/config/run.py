"""Run configuration for training: data, optimisation, the training loop — on top of the model and loss configs.

A run config is YAML with ``base:`` pointing at a model config (configs/model/*.yaml), plus ``data``, ``optim`` and
``train`` sections; `tools/train.py --set key=value` overrides any key. The DeepSpeed JSON is derived from it
(`deepspeed_config`) and written into the run folder beside the resolved YAML.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from squad.config.model import ConfigError, LossConfig, ModelConfig
from squad.tasks import resolve_task_names

SPLIT_NAMES = ("train", "val", "test", "all")  # what data.split / data.val_split may name (`squad.data`)
DATASET_NAMES = ("taskonomy", "pascal_context", "nyud")  # data.dataset (`squad.data.benchmark.DATASETS`)


@dataclasses.dataclass
class DataConfig:
    """Where the images come from and how they are read."""

    root: str = "data/synthetic"  # a Taskonomy tree (either layout), a PASCAL_MT / NYUD folder, or packed shards
    dataset: str = "taskonomy"  # taskonomy | pascal_context | nyud (squad.data.build_dataset)
    split: str = "train"  # the training split: train | val | test | all
    val_split: str = "val"  # the split validated on
    split_csv: str | None = None  # default: the split CSV found in root
    tasks: list[str] | str = "all"  # tasks to train ("all" = the model's heads)
    image_size: int | None = None  # default: model.img_size
    resize: int | None = None  # resize before the random crop (default: no resize for synthetic data)
    augment: bool = True  # random crop and flip (PASCAL-Context, NYUD-v2: also a random scale)
    missing: Literal["skip", "mask"] = "skip"  # a sample lacking a task's file: left out, or kept with it masked
    workers: int | None = None  # loader workers per rank; null: the cores per GPU (per rank) less one, at most 8
    prefetch: int = 4  # batches each loader worker keeps ready
    block: int = 64  # samples read as one contiguous block (the epoch order shuffles blocks, then within a buffer)
    shuffle_buffer: int = 4  # blocks shuffled together (block 1: a plain random permutation)
    device_decode: bool = True  # workers hand over integer crops; the training device decodes them (squad.data.device)
    val_batches: int = 0  # validation batches per evaluation (0 = the whole split)

    def check(self, path: str) -> None:
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"{path}.dataset must be one of {', '.join(DATASET_NAMES)}, got {self.dataset!r}")
        for key in ("split", "val_split"):
            value = getattr(self, key)
            if value not in SPLIT_NAMES:
                raise ConfigError(f"{path}.{key} must be one of {', '.join(SPLIT_NAMES)}, got {value!r}")
        for key in ("workers", "val_batches"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("prefetch", "block", "shuffle_buffer"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("image_size", "resize"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key} must be >= 1 (or null), got {getattr(self, key)}")


@dataclasses.dataclass
class OptimConfig:
    """AdamW with linear warm-up and cosine decay."""

    lr: float = 2e-4  # peak learning rate
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.05  # not on norms, biases, embeddings and task log-variances
    warmup_steps: int = 0  # linear warm-up steps
    warmup_epochs: float = 0.0  # alternative to warmup_steps
    min_lr: float = 1e-6  # the floor of the cosine decay
    steps: int = 0  # total optimiser steps (0: use epochs)
    epochs: float = 0.0  # total epochs (when steps is 0)
    batch_per_rank: int = 8  # images per rank per micro-step
    grad_accum: int = 1  # micro-steps per optimiser step (global batch: batch_per_rank · grad_accum · ranks)
    clip: float = 1.0  # gradient-norm clipping (0 = off)

    def check(self, path: str) -> None:
        # every float is finite already (squad.config.base rejects .nan / .inf, naming the key)
        for key in ("lr", "eps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{path}.{key} must be > 0, got {getattr(self, key)}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{path}.betas must be two numbers in [0, 1), got {self.betas}")
        for key in ("weight_decay", "warmup_steps", "warmup_epochs", "min_lr", "steps", "epochs", "clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key} must be >= 0, got {getattr(self, key)}")
        if self.steps == 0 and self.epochs == 0:
            raise ConfigError(f"{path}.steps and {path}.epochs are both 0: set one of them to a positive number")
        for key in ("batch_per_rank", "grad_accum"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{path}.{key} must be >= 1, got {getattr(self, key)}")
        if self.min_lr > self.lr:
            raise ConfigError(f"{path}.min_lr={self.min_lr} is above {path}.lr={self.lr} (the floor of the cosine "
                              f"decay must not exceed the peak)")


# the signals train.save_on_signal may name (SIGINT stays Ctrl-C: interrupt at once, exit 130)
SAVE_SIGNALS = ("TERM", "USR1", "USR2", "HUP", "XCPU")


@dataclasses.dataclass
class TrainConfig:
    """The loop: precision, ZeRO, task sampling, intervals, safety limits."""

    seed: int = 0  # model init, data order, augmentation and router noise
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPUs, fp32 on CPUs
    # ZeRO: 1 partitions the optimizer state over the data-parallel ranks, 2 the gradients too, 3 the parameters too
    # (gathered per module as the forward and backward reach it). Expert shards (model.moe/moa.expert_parallel) are
    # squad's own at every stage (squad.train.expert_shards).
    zero_stage: int = 0
    # torch.compile the training step's forward (model and losses; DeepSpeed's engine.compile, inductor): the module
    # keeps its parameters and names, so checkpoints, resume and ZeRO are unchanged. The first steps pay the
    # compilation (minutes on a CPU); graph breaks that remain: squad.models.compile.
    compile: bool = False
    # 0: every image trains every task; k: k tasks sampled per image each step (with train.compile each new batch
    # composition compiles again, up to dynamo's recompile limit: docs/training.md)
    tasks_per_image: int = 0
    log_every: int = 10  # steps between train.log / TensorBoard lines
    eval_every: int = 0  # 0: only at the start and the end
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2  # complete checkpoint tags kept (older ones are deleted)
    max_nonfinite: int = 5  # consecutive non-finite losses before the run stops
    stop_at: int = 0  # checkpoint and stop at this step (resume later, e.g. within a cluster's time limit)
    # signals that make every rank checkpoint at the next step boundary and exit 75 (preemption: SLURM sends TERM at
    # the time limit and on scancel, and USR1 before it with --signal=USR1@120; a closed terminal sends HUP); []
    # leaves them to their default action. Before the first training step one exits 75 at once (nothing to save);
    # a second one exits at once. squad.train.checkpointer and squad.train.signals document the protocol.
    save_on_signal: list[str] = dataclasses.field(default_factory=lambda: ["TERM", "USR1", "HUP"])
    # seconds a peer rank may stay silent (stopped, hung, its node gone) before the run ends with a line naming it
    # (exit 3; a rerun resumes from the newest checkpoint); 0 never ends it. squad.train.watchdog. Well under the
    # grace a cluster gives between SIGTERM and SIGKILL, so a hung job still ends with a message.
    peer_timeout: float = 60.0
    progress: bool = True  # a progress bar on rank 0
    # start from this model file instead of the fresh init: what tools/upcycle.py writes (or any squad model of the
    # same architecture and tasks; a hub id hf-hub:org/name[@revision] names a model folder on the Hugging Face
    # hub, read from huggingface_hub's cache), or a dense ViT (timm state dict, dense squad model) upcycled on the spot
    # (squad.models.transfer.initialize_from). A resumed run loads its checkpoint instead; the file is checked when
    # the run starts.
    init: str | None = None
    # activation checkpointing: recompute block activations in the backward pass instead of keeping them (less
    # memory, ~1/3 more compute for the recomputed blocks; same losses and gradients). none; blocks (every block
    # keeps only its input); every_n (blocks 0, n, 2n, ...: n = checkpoint_every, the others keep their activations).
    # Non-reentrant torch.utils.checkpoint with the RNG state restored (router noise routes the same); works with
    # ZeRO 1/2 and torch.compile. Evaluation never checkpoints.
    activation_checkpointing: Literal["none", "blocks", "every_n"] = "none"
    checkpoint_every: int = 2  # n of activation_checkpointing: every_n

    def check(self, path: str) -> None:
        if self.checkpoint_every < 1:
            raise ConfigError(f"{path}.checkpoint_every must be >= 1 (activation_checkpointing: every_n recomputes "
                              f"blocks 0, n, 2n, ...), got {self.checkpoint_every}")
        if self.init is not None and not self.init.strip():
            raise ConfigError(f"{path}.init must be a file path or null, got an empty string")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for key in ("seed", "tasks_per_image", "log_every", "eval_every", "ckpt_every", "stop_at"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key} must be >= 0, got {getattr(self, key)}")
        if self.log_every == 0:
            raise ConfigError(f"{path}.log_every must be >= 1")
        if self.peer_timeout < 0:
            raise ConfigError(f"{path}.peer_timeout must be >= 0 seconds (0: never), got {self.peer_timeout}")
        if self.keep_checkpoints < 1 or self.max_nonfinite < 1:
            raise ConfigError(f"{path}.keep_checkpoints and {path}.max_nonfinite must be >= 1")
        for name in self.save_on_signal:
            if name.upper().removeprefix("SIG") not in SAVE_SIGNALS:
                raise ConfigError(f"{path}.save_on_signal: {name!r} is not one of {', '.join(SAVE_SIGNALS)} (SIGINT, "
                                  f"Ctrl-C, always interrupts without saving)")


@dataclasses.dataclass
class RunConfig:
    """Everything a training run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def check(self, path: str) -> None:
        names = self.model.task_names
        if self.data.tasks != "all":
            try:
                tasks = resolve_task_names(self.data.tasks)
            except ValueError as e:
                raise ConfigError(f"data.tasks: {e}") from e
            missing = [t for t in tasks if t not in names]
            if missing:
                raise ConfigError(f"data.tasks: {missing[0]!r} has no head in the model (model.heads: {names})")
        if self.data.image_size is not None and self.data.image_size != self.model.img_size:
            raise ConfigError(f"data.image_size={self.data.image_size} differs from model.img_size="
                              f"{self.model.img_size}")
        if self.data.resize is not None and self.data.resize < self.model.img_size:
            raise ConfigError(f"data.resize={self.data.resize} is below model.img_size={self.model.img_size} (the "
                              f"crop is taken from the resized image)")
        if self.train.tasks_per_image > len(self.train_tasks()):
            raise ConfigError(f"train.tasks_per_image={self.train.tasks_per_image} exceeds the "
                              f"{len(self.train_tasks())} trained tasks")

    def train_tasks(self) -> list[str]:
        """Canonical names of the tasks this run trains."""
        if self.data.tasks == "all":
            return self.model.task_names
        return resolve_task_names(self.data.tasks)


def precision(cfg: TrainConfig, cuda: bool) -> str:
    """The precision actually used: ``auto`` is bf16 on GPUs and fp32 on CPUs.

    bf16 also runs on the CPU (DeepSpeed's CPU accelerator supports it; often slower than fp32 there); fp16, with
    its dynamic loss scaling, needs a GPU.

    Raises:
        ConfigError: ``train.precision=fp16`` without a GPU.
    """
    if cfg.precision == "auto":
        return "bf16" if cuda else "fp32"
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError("train.precision=fp16 needs a GPU; on the CPU use bf16 (half the activation memory, no "
                          "loss scaling), fp32 or auto")
    return cfg.precision


def deepspeed_config(cfg: RunConfig, cuda: bool, tensorboard_dir: str | None = None) -> dict:
    """The DeepSpeed JSON for a run (the optimiser and schedule are squad's own, passed to DeepSpeed)."""
    prec = precision(cfg.train, cuda)
    ds = {
        "train_micro_batch_size_per_gpu": cfg.optim.batch_per_rank,
        "gradient_accumulation_steps": cfg.optim.grad_accum,
        "gradient_clipping": cfg.optim.clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": cfg.train.zero_stage},
        "bf16": {"enabled": prec == "bf16"},
        "fp16": {"enabled": prec == "fp16"},
        "zero_allow_untested_optimizer": True,
    }
    if cfg.train.zero_stage > 0:
        ds["zero_optimization"].update({"overlap_comm": False, "contiguous_gradients": True,
                                        "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7})
    return ds
