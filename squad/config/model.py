"""The model's configuration: widths, the layer plan, the conditional layers' settings, the heads, the losses.

A model is a function of a `ModelConfig` (named variants are YAML files in configs/model/, not code paths). Load one
with `squad.load_config(path_or_name, overrides)` (`squad.config.loading`); every key is checked and a wrong one is
named in the error.

Example (configs/model/modsquad_vit_b.yaml)::

    model:
      embed_dim: 768
      depth: 12
      num_heads: 12
      plan: [{attn: dense, mlp: dense}, {attn: moa, mlp: moe}]   # tiled to `depth` blocks
      moa: {num_experts: 24, top_k: 12}
      moe: {num_experts: 16, top_k: 4}
      heads: [depth_euclidean, normal, class_scene]               # names from squad.tasks, or {name, kind, channels}
    loss: {w_mi: 0.001, weighting: uncertainty}
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from squad.config.base import ConfigError
from squad.tasks import Task, canonical_name, get_task

HeadKind = Literal["dense", "class", "token"]
DECODERS = ("linear", "light")  # a dense head's decoder (squad.layers.heads)


@dataclasses.dataclass
class HeadConfig:
    """One task head.

    ``dense``: linear per patch token to patch·patch·channels pixels; ``class``: mean-pooled patch tokens →
    LayerNorm → Linear(channels) (the paper's heads, and timm's average-pooled ViT head: pool → fc_norm → head);
    ``token``: the class token → Linear (timm's class-token ViT head).

    A dense head's ``decoder`` is ``linear`` (the per-patch linear map above) or ``light`` (`squad.layers.heads.
    LightDecoder`: 3×3 convs on the token grid with progressive ×2 upsampling, ``decoder_width`` channels after the
    first conv, halving each step), e.g. ``{name: semseg, kind: dense, channels: 21, decoder: light}``.
    """

    name: str  # the task (squad.tasks; an alias is resolved)
    kind: HeadKind = "dense"  # dense: per patch token; class: pooled tokens; token: the class token (above)
    channels: int = 1  # output channels (classes for a class head)
    decoder: str = "linear"  # one of DECODERS (checked here, so a wrong value is named with its key)
    decoder_width: int = 64  # the light decoder's channels after its first conv

    def check(self, path: str) -> None:
        if self.channels < 1:
            raise ConfigError(f"{path}.channels must be >= 1, got {self.channels}")
        if self.decoder not in DECODERS:
            raise ConfigError(f"{path}.decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.decoder != "linear" and self.kind != "dense":
            raise ConfigError(f"{path}.decoder={self.decoder} needs kind=dense (a {self.kind} head predicts one "
                              f"vector per image: it has no decoder)")
        if self.decoder_width < 1:
            raise ConfigError(f"{path}.decoder_width must be >= 1, got {self.decoder_width}")


@dataclasses.dataclass
class RouterConfig:
    """Per-task token-choice router settings shared by MoE MLP and MoE attention (Shazeer's noisy top-k gate, as
    in the Mod-Squad paper)."""

    noise: bool = True  # Shazeer's softplus-scaled Gaussian noise on the logits during training
    # Gate weights start at trunc-normal(std 0.02), the init the authors' trained routers effectively had: their
    # model-wide timm init re-initialises every router Linear (the released ViT-B's routers have std 0.02, none
    # zero). true: start at zero. Zero routers with noise off give every expert the same logit, so every token of
    # every task picks the same k experts at step 0 and the other experts get no gradient.
    zero_init: bool = False
    renormalize: bool = False  # renormalise the kept top-k probabilities to sum to 1 (the paper does not)


@dataclasses.dataclass
class MoEConfig:
    """MoE MLP: E two-layer experts, top-k per token, one router per task."""

    num_experts: int = 16  # E
    top_k: int = 4  # experts per token
    hidden: int | None = None  # per-expert hidden width; default mlp_ratio·D / top_k (equal active FLOPs)
    bias: bool = True  # biases in the experts' projections
    noop_experts: int = 0  # MoDE (integrated): extra experts that return nothing (the token skips the MLP)
    capacity_factor: float = 0.0  # > 0: at most ceil(cf · tokens·k / E) tokens per expert (drops the rest)
    # expert parallelism: training spreads the E experts over groups of this many ranks (E/P each; tokens exchanged
    # with all-to-all); it must divide num_experts and the number of ranks. 1: every rank holds every expert. Only
    # how a run is laid out: the model, its checkpoints and exported files are the same for every value.
    expert_parallel: int = 1
    # the expert GEMMs on the CUDA path: `grouped_mm` (torch's grouped GEMM on tokens permuted into expert order),
    # `triton` (squad's kernels that gather and scatter rows themselves), `auto` (the one `make gpu-check` measured
    # faster at this shape on this GPU, else what a committed gpu-check on a GPU of its name measured; grouped_mm
    # until one has). The CPU algorithm is the same for all three.
    kernel: Literal["auto", "grouped_mm", "triton"] = "auto"
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)

    def check(self, path: str) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{path}.num_experts must be >= 1, got {self.num_experts}")
        total = self.num_experts + self.noop_experts
        if not 1 <= self.top_k <= total:
            raise ConfigError(f"{path}.top_k={self.top_k} must be between 1 and the number of experts ({total})")
        if self.noop_experts < 0:
            raise ConfigError(f"{path}.noop_experts must be >= 0, got {self.noop_experts}")
        if self.hidden is not None and self.hidden < 1:
            raise ConfigError(f"{path}.hidden must be >= 1, got {self.hidden}")
        if self.capacity_factor < 0:
            raise ConfigError(f"{path}.capacity_factor must be >= 0 (0 = no dropping), got {self.capacity_factor}")
        check_expert_parallel(self.expert_parallel, self.num_experts, path)


@dataclasses.dataclass
class MoAConfig:
    """MoE attention (MoA): each expert is one head's query and output projection; key/value shared (one head)."""

    num_experts: int = 24  # E query/output heads
    top_k: int = 12  # heads per token
    head_dim: int = 64  # width of every head (the shared key/value head's too)
    expert_parallel: int = 1  # heads spread over groups of this many ranks (as MoEConfig.expert_parallel)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    # The query and output projections on the CUDA path: `cublas` (every head by one plain GEMM, the selected ones
    # gathered), `heads` (the same all-head form on squad's Triton head kernels), `routed` (grouped GEMMs over the
    # expert-sorted rows), `auto` (the one `make gpu-check` measured faster at this shape on this GPU; until one has,
    # the form a cost model prices lower: cublas for the all-head form). Expert-parallel runs are always routed.
    kernel: Literal["auto", "cublas", "heads", "routed"] = "auto"

    def check(self, path: str) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{path}.num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"{path}.top_k={self.top_k} must be between 1 and {path}.num_experts={self.num_experts}"
            )
        if self.head_dim < 1:
            raise ConfigError(f"{path}.head_dim must be >= 1, got {self.head_dim}")
        check_expert_parallel(self.expert_parallel, self.num_experts, path)


def check_expert_parallel(size: int, num_experts: int, path: str) -> None:
    """``{path}.expert_parallel`` is >= 1 and divides ``{path}.num_experts`` (the world size is checked when a run
    starts: `squad.train.expert_shards.check_layout`)."""
    if size < 1:
        raise ConfigError(f"{path}.expert_parallel must be >= 1, got {size}")
    if num_experts % size:
        raise ConfigError(f"{path}.expert_parallel={size} does not divide {path}.num_experts={num_experts} (each rank "
                          f"of an expert-parallel group holds num_experts / expert_parallel experts)")


@dataclasses.dataclass
class MoDConfig:
    """Mixture-of-Depths: expert-choice top-k tokens per image go through the block, the rest skip it."""

    capacity: float = 0.125  # share of tokens processed; k = ceil(capacity · N)
    keep_cls: bool = True  # the class token is always processed (counted inside k)
    aux_loss: bool = False  # BCE of router logits against top-k membership (learned routing only)
    inference: Literal["topk", "threshold"] = "topk"  # learned routing at eval: sigmoid(logit) > 0.5 (needs aux_loss)

    def check(self, path: str) -> None:
        if not 0.0 < self.capacity <= 1.0:
            raise ConfigError(f"{path}.capacity must be in (0, 1], got {self.capacity}")
        if self.inference == "threshold" and not self.aux_loss:
            raise ConfigError(f"{path}.inference=threshold needs {path}.aux_loss=true (a router trained to threshold)")


@dataclasses.dataclass
class MoNEConfig:
    """Mixture of Nested Experts: nested widths D/2^(E-1) … D, Expert Preferred Routing under a capacity budget."""

    num_experts: int = 4  # E nested widths D/2^(E-1) … D
    capacity: float = 0.3  # effective capacity e_c = Σ c_i d_i / D
    router_layer: int = -1  # block index of the router; -1 = the first MoNE block. Later MoNE blocks reuse it.
    beta: float = 10.0  # entropy weight of the capacity distribution's objective (squad.layers.mone_capacity)
    delta: float = 2.0  # reward of nested expert i is 1/delta^i in that objective
    sample_capacity: list[float] | None = None  # e_c sampled per training step from these values
    # MoNE inference on the CUDA path: `cublas` (a matmul per width slice), `triton` (the nested kernels: norms,
    # projections and the MLP sublayer fused), `auto` (the one `make gpu-check` measured faster at this shape on this
    # GPU, else what a committed gpu-check on a GPU of its name measured — an H200: triton; cublas until one has).
    # Training always takes the width slices.
    kernel: Literal["auto", "cublas", "triton"] = "auto"

    def check(self, path: str) -> None:
        if self.num_experts < 1:
            raise ConfigError(f"{path}.num_experts must be >= 1, got {self.num_experts}")
        for key, value in [("capacity", self.capacity)] + [
            (f"sample_capacity[{i}]", c) for i, c in enumerate(self.sample_capacity or [])
        ]:
            if not 0.0 < value <= 1.0:
                raise ConfigError(f"{path}.{key} must be in (0, 1], got {value}")
            if value < 1 / 2 ** (self.num_experts - 1) - 1e-9:
                raise ConfigError(
                    f"{path}.{key}={value} is below the smallest expert's width share 1/{2 ** (self.num_experts - 1)}"
                )
        if self.beta <= 0 or self.delta <= 1:
            raise ConfigError(f"{path}: beta must be > 0 and delta > 1, got beta={self.beta}, delta={self.delta}")


@dataclasses.dataclass
class BlockSpec:
    """One block of the layer plan."""

    attn: Literal["dense", "moa", "none"] = "dense"  # dense attention, MoE attention (model.moa), or none
    mlp: Literal["dense", "moe", "none"] = "dense"  # dense MLP, MoE MLP (model.moe), or none
    mod: Literal["learned", "attention"] | None = None  # wrap in Mixture-of-Depths: learned router or A-MoD scores
    mone: bool = False  # nested experts for this block's attention and MLP (attn/mlp must be dense)

    def check(self, path: str) -> None:
        if self.mone and (self.attn != "dense" or self.mlp != "dense" or self.mod is not None):
            raise ConfigError(f"{path}: a MoNE block needs attn=dense, mlp=dense and no mod")
        if self.mod is not None and self.attn == "none" and self.mlp == "none":
            raise ConfigError(f"{path}: mod around an empty block")


@dataclasses.dataclass
class ModelConfig:
    """A SquadViT: widths, the layer plan, conditional-layer settings and the task heads."""

    name: str = "squad"  # the model's name (saved with it; the registry's names are the files of configs/model/)
    img_size: int = 224  # input images are img_size × img_size pixels
    patch_size: int = 16
    in_chans: int = 3  # input channels
    embed_dim: int = 768  # D, the token width
    depth: int = 12  # number of blocks (the plan is tiled to it)
    num_heads: int = 12  # dense attention heads
    head_dim: int | None = None  # dense attention head width (default embed_dim / num_heads)
    mlp_ratio: float = 4.0  # a dense MLP's hidden width is mlp_ratio · D
    qkv_bias: bool = True
    class_token: bool = True  # prepend a class token (the `token` head reads it)
    final_norm: bool = True  # LayerNorm on the final tokens; false for timm's avg-pool ViTs (norm after pooling)
    plan: list[BlockSpec] = dataclasses.field(default_factory=lambda: [BlockSpec()])  # tiled to depth
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    moa: MoAConfig = dataclasses.field(default_factory=MoAConfig)
    mod: MoDConfig = dataclasses.field(default_factory=MoDConfig)
    mone: MoNEConfig = dataclasses.field(default_factory=MoNEConfig)
    # learnable task embedding: added before every block, only to the routed layers' inputs, or none
    task_embed: Literal["every_block", "moe_inputs", "none"] = "every_block"
    # the task heads: task names (squad.tasks, aliases accepted) or {name, kind, channels, decoder, decoder_width}
    heads: list[HeadConfig | str] = dataclasses.field(default_factory=list)
    # options of the tasks' decoding/targets/metrics, stored with the model, e.g. {edge_occlusion: {decode: clip}};
    # they reach the model's tasks through `get_task` (squad.tasks.registry): never a process-wide setting
    task_options: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def blocks(self) -> list[BlockSpec]:
        """The plan tiled to `depth` blocks."""
        return [self.plan[i % len(self.plan)] for i in range(self.depth)]

    def head_configs(self) -> list[HeadConfig]:
        """Heads with task names resolved through the task registry (squad.tasks)."""
        out = []
        for h in self.heads:
            if isinstance(h, HeadConfig):
                out.append(h)
            else:
                task = get_task(h)
                out.append(HeadConfig(task.name, task.head_kind, task.channels))
        return out

    @property
    def task_names(self) -> list[str]:
        return [h.name for h in self.head_configs()]

    def get_task(self, name: str) -> Task:
        """The task ``name`` (name or alias) configured by this model's ``task_options``."""
        return get_task(name, self.task_options)

    @property
    def grid(self) -> int:
        return self.img_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        return self.grid**2 + int(self.class_token)

    def mone_router_block(self) -> int | None:
        """Index of the block holding the MoNE router (None without MoNE blocks)."""
        idx = [i for i, b in enumerate(self.blocks()) if b.mone]
        if not idx:
            return None
        return idx[0] if self.mone.router_layer < 0 else self.mone.router_layer

    def check(self, path: str) -> None:
        p = f"{path}." if path else ""
        for key in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{p}{key} must be >= 1, got {getattr(self, key)}")
        if self.img_size % self.patch_size:
            raise ConfigError(f"{p}img_size={self.img_size} is not a multiple of {p}patch_size={self.patch_size}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ConfigError(f"{p}head_dim must be >= 1, got {self.head_dim}")
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise ConfigError(f"{p}embed_dim={self.embed_dim} is not divisible by {p}num_heads={self.num_heads}")
        if not self.plan:
            raise ConfigError(f"{p}plan must list at least one block")
        if not self.heads:
            raise ConfigError(f"{p}heads must list at least one task head")
        try:
            heads = self.head_configs()
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{p}heads: {e}") from e
        for name, opts in self.task_options.items():
            try:
                canonical_name(name)
            except ValueError as e:
                raise ConfigError(f"{p}task_options: {e}") from e
            try:
                get_task(name, **opts)
            except ValueError as e:  # the factory's message starts with the option's name ("decode: ...")
                raise ConfigError(f"{p}task_options.{name}.{e}" if ": " in str(e) and str(e).split(": ")[0] in opts
                                  else f"{p}task_options.{name}: {e}") from e
        names = [h.name for h in heads]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"{p}heads: task {dup[0]!r} is listed twice")
        blocks = self.blocks()
        for i, b in enumerate(blocks):
            if b.mod == "attention" and (i == 0 or blocks[i - 1].attn == "none"):
                raise ConfigError(
                    f"{p}plan: block {i} routes on attention (mod=attention) but has no preceding attention layer"
                )
        if any(b.mone for b in blocks):
            e = self.mone.num_experts
            if self.embed_dim % 2 ** (e - 1):
                raise ConfigError(f"{p}embed_dim={self.embed_dim} must be divisible by 2^(mone.num_experts-1)")
            r = self.mone_router_block()
            if not 0 <= r < self.depth or not blocks[r].mone:
                raise ConfigError(f"{p}mone.router_layer={self.mone.router_layer} is not a MoNE block")
            if any(b.mone for b in blocks[:r]):
                raise ConfigError(f"{p}mone.router_layer={r}: MoNE blocks before the router have no routing")

    def moe_hidden(self) -> int:
        """Per-expert hidden width of the MoE MLP."""
        if self.moe.hidden is not None:
            return self.moe.hidden
        return max(1, math.ceil(self.mlp_ratio * self.embed_dim / self.moe.top_k))


@dataclasses.dataclass
class LossConfig:
    """Auxiliary losses and task weighting."""

    w_mi: float = 0.001  # weight of the mutual-information term (subtracted: L = Σ w_t L_t − w_mi Σ_l I(T;E_l))
    # uncertainty: Σ ½·exp(−s_t)·L_t + ½·s_t with a learned s_t per task; uncertainty_log1p: the authors' form
    # ½·exp(−s_t)·L_t + log(1 + exp(s_t)); equal: Σ L_t (squad.train.losses.TaskWeighting)
    weighting: Literal["uncertainty", "uncertainty_log1p", "equal"] = "uncertainty"
    balance: Literal["none", "switch", "cv2"] = "none"  # load-balancing loss (baselines)
    balance_scope: Literal["per_task", "all"] = "per_task"  # balance each task's routing, or their sum
    w_balance: float = 0.01  # weight of the balance loss
    w_mod_aux: float = 0.01  # MoD router BCE (when model.mod.aux_loss)
    clamp: float = 1000.0  # task losses clamped to ±clamp before weighting (authors' safeguard)

    def check(self, path: str) -> None:
        for key in ("w_mi", "w_balance", "w_mod_aux", "clamp"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{path}.{key} must be >= 0, got {getattr(self, key)}")


@dataclasses.dataclass
class SquadConfig:
    """The model and its losses (training runs extend this with data/optimisation settings)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
