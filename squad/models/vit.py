"""SquadViT: a ViT whose blocks follow a layer plan of dense and conditional layers, with per-task routing.

Several tasks run in ONE backbone pass: the batch is tagged with task ids (each image once per task it trains on,
task-major rows), every router picks its task's weights per row, and the experts of a layer process all tasks'
tokens together. Rows are independent, so the fused pass equals one pass per task.

Shared rows run once: the blocks before the first task-specific block (one that holds a per-task router — MoE
attention, MoE MLP, a learned MoD router, the MoNE router — or sees the task embedding) are the same for every
task, so they run on the B images once; the rows fan out to the task rows at the first task-specific block (A-MoD
scores fan out with them). A model without task-specific blocks (MTL, STL, dense) never fans out: each head reads
its images' rows of the shared tokens.

Activation checkpointing (`SquadViT.set_activation_checkpointing`) recomputes a block's activations in the
backward pass instead of keeping them (non-reentrant `torch.utils.checkpoint`, RNG state restored, so router
noise routes the same); the recomputation runs on a copy of the block's context, so nothing it reports is recorded
twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from squad.config.loading import load_config
from squad.config.model import ModelConfig, SquadConfig
from squad.kernels.rows import row_norm
from squad.layers.base import RoutedLayer, observed
from squad.layers.block import Block
from squad.layers.context import ForwardContext, RouterStats
from squad.layers.experts import takes_kernel_path
from squad.layers.heads import build_head
from squad.layers.mod import MoDBlock
from squad.layers.mone import MoNEBlock
from squad.layers.routing import TaskLinear
from squad.tasks import Task, canonical_name, get_task


class SquadOutput(NamedTuple):
    """What one forward pass returns (a named tuple: module hooks that look for the tensors of a module's output find
    them, as DeepSpeed ZeRO-3 does to gather the model's own weights again for its backward).

    Attributes:
        preds: task → prediction ([B_t, C, H, W] for dense heads, [B_t, C] logits for class heads).
        image_index: task → [B_t] indices into the input batch of the images the task ran on.
        stats: per routed layer, its `RouterStats` (MI mass, usage counts, aux losses), in layer order.
    """

    preds: dict[str, torch.Tensor]
    image_index: dict[str, torch.Tensor]
    stats: list[RouterStats]


def init_timm(module: nn.Module) -> None:
    """timm's init of every linear layer and LayerNorm in ``module``: weights truncated normal(0.02), zero biases,
    unit norms (a whole model's, or a head added to a trained one)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class PatchConv(nn.Conv2d):
    """A Conv2d whose kernel tiles the image (kernel = stride, no padding, dilation or groups) computed as one GEMM:
    the image cut into patches [B, N, C·p·p] times the weight viewed as [D, C·p·p] (``F.linear``), the same numbers
    as ``F.conv2d`` up to summation order. cuDNN runs such a convolution as an implicit-GEMM kernel about 10× slower
    than the GEMM (an H200 measured 1.65 ms for ViT-S's 256 images at 224 px: reports/bench/gpu_check_h200).

    Still a Conv2d for everything outside ``forward``: its parameters, state-dict keys, module hooks (DeepSpeed
    ZeRO-3 gathers them around this module's call) and what timm checkpoints load into. The output is the
    convolution's [B, D, H/p, W/p], laid out channels-last (a view of the GEMM's [B, N, D]: flattening it back to
    tokens copies nothing). Any other configuration runs the convolution.
    """

    def tiles(self) -> bool:
        """Whether the kernel tiles the image (the GEMM path applies)."""
        return (self.kernel_size == self.stride and self.padding == (0, 0) and self.dilation == (1, 1)
                and self.groups == 1 and self.padding_mode == "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tiles() or x.dim() != 4:
            return super().forward(x)
        b, c, h, w = x.shape
        ph, pw = self.kernel_size
        gh, gw = h // ph, w // pw  # rows and columns a stride-p convolution keeps (the rest is cut off, as there)
        x = x[:, :, : gh * ph, : gw * pw]
        patches = x.reshape(b, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)  # [B, N, D]
        return out.transpose(1, 2).unflatten(2, (gh, gw))  # [B, D, gh, gw], channels-last


class PatchEmbed(nn.Module):
    """Non-overlapping p×p patches → D (timm layout: ``proj`` Conv2d, computed as one GEMM: `PatchConv`)."""

    def __init__(self, img_size: int, patch: int, in_chans: int, dim: int):
        super().__init__()
        self.img_size, self.patch, self.in_chans = img_size, patch, in_chans
        self.proj = PatchConv(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, g·g, D]


class SquadViT(nn.Module):
    """Vision transformer with a configurable plan of dense, MoE-attention, MoE-MLP, MoD and MoNE blocks.

    Build with `squad.build_model(cfg)`. ``model(images, tasks)`` runs the listed tasks in one backbone pass.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        heads = cfg.head_configs()
        self.task_names = [h.name for h in heads]
        t, d = len(heads), cfg.embed_dim
        self.patch_embed = PatchEmbed(cfg.img_size, cfg.patch_size, cfg.in_chans, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if cfg.class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_tokens, d))
        self.task_embed = nn.Parameter(torch.zeros(t, d)) if cfg.task_embed != "none" else None
        self.register_parameter("task_embed_extra", None)  # [T', D] tasks added later (squad.models.surgery.add_task)
        self.record_routing = False  # routers report every token's experts (RouterStats.experts), for analysis
        self.activation_checkpointing = "none"  # none | blocks | every_n (set_activation_checkpointing)
        self.checkpoint_every = 1
        specs = cfg.blocks()
        router_block = cfg.mone_router_block()
        blocks = []
        for i, spec in enumerate(specs):
            if spec.mone:
                blocks.append(MoNEBlock(d, cfg.num_heads, int(d * cfg.mlp_ratio), cfg.mone, t, i == router_block,
                                        cfg.qkv_bias))
                continue
            block = Block(cfg, spec, t)
            if spec.mod is not None:
                block = MoDBlock(block, cfg.mod, spec.mod, d, t, cfg.class_token)
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        # timm's avg-pool ViTs have no norm here (their fc_norm comes after pooling: a `class` head's own norm)
        self.norm = nn.LayerNorm(d, eps=1e-6) if cfg.final_norm else nn.Identity()
        self.heads = nn.ModuleDict({h.name: build_head(h, d, cfg.patch_size, cfg.grid, cfg.class_token)
                                    for h in heads})
        self.mone_capacity = cfg.mone.capacity
        self._wire()
        self.init_weights()

    def _wire(self) -> None:
        """Names routed layers (for statistics) and asks attention layers for A-MoD scores where needed."""
        for name, module in self.named_modules():
            if isinstance(module, RoutedLayer):
                module.layer_name = name
        for i, spec in enumerate(self.cfg.blocks()):
            if spec.mod == "attention":
                prev = self.blocks[i - 1]
                inner = prev.block if isinstance(prev, MoDBlock) else prev
                target = inner if isinstance(inner, MoNEBlock) else inner.attn
                target.want_scores = True

    def init_weights(self) -> None:
        """timm-style init: truncated normal(0.02) for embeddings (`init_timm` for the linear layers and norms)."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.task_embed is not None:
            nn.init.trunc_normal_(self.task_embed, std=0.02)
        init_timm(self)

    # ----------------------------------------------------------------------------------------------------- inputs
    def task_index(self, tasks: Sequence[str]) -> list[int]:
        """Model task indices of ``tasks``; an unknown name fails listing the model's tasks."""
        out = []
        for name in tasks:
            if name not in self.heads:
                try:
                    canonical = canonical_name(name)
                except ValueError:
                    canonical = None
                if canonical not in self.heads:
                    raise ValueError(f"unknown task {name!r}: this model has {', '.join(self.task_names)}")
                name = canonical
            out.append(self.task_names.index(name))
        return out

    def get_task(self, name: str) -> Task:
        """The task ``name`` (name or alias) as this model decodes, scores and trains it: configured by its
        ``cfg.task_options`` (e.g. occlusion edges decoded with ``clip``), whatever other models in the process use."""
        return get_task(name, self.cfg.task_options)

    def _check_images(self, images: torch.Tensor) -> None:
        c, s = self.cfg.in_chans, self.cfg.img_size
        if images.dim() != 4 or images.shape[1] != c or images.shape[2] != s or images.shape[3] != s:
            raise ValueError(f"images must be [B, {c}, {s}, {s}], got {list(images.shape)}")
        if not images.is_floating_point():
            raise ValueError(f"images must be a floating-point tensor, got {images.dtype}")

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch + position embedding: [B, C, H, W] → [B, N, D]."""
        self._check_images(images)
        x = self.patch_embed(images)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed

    # ---------------------------------------------------------------------------------------------------- forward
    def set_mone_capacity(self, e_c: float) -> None:
        """Effective capacity used by MoNE blocks at inference (and in training unless sampled per step).

        Raises:
            ValueError: e_c outside [1/2^(E-1), 1], the range ``model.mone.capacity`` accepts (E nested experts).
        """
        low = 2 ** (self.cfg.mone.num_experts - 1)
        if not 1 / low - 1e-9 <= e_c <= 1.0:
            raise ValueError(f"MoNE effective capacity must be in [1/{low}, 1] (from every token at the smallest "
                             f"expert's width share to every token at full width, as model.mone.capacity), got {e_c}")
        self.mone_capacity = float(e_c)

    def _capacity_for_step(self) -> float:
        choices = self.cfg.mone.sample_capacity
        if self.training and choices:
            return float(choices[int(torch.randint(len(choices), ()).item())])
        return self.mone_capacity

    def set_activation_checkpointing(self, mode: str = "blocks", every: int = 1) -> None:
        """Recomputes block activations in the backward pass instead of keeping them (training memory).

        Args:
            mode: ``"none"``; ``"blocks"`` (every block keeps only its input); ``"every_n"`` (blocks 0, n, 2n, ...:
                a 1/n share of the blocks recomputed, the others keep their activations).
            every: n for ``"every_n"`` (>= 1).

        Only passes that build a graph (training mode, gradients enabled) checkpoint; evaluation is unchanged.

        Raises:
            ValueError: an unknown mode or ``every`` < 1.
        """
        if mode not in ("none", "blocks", "every_n"):
            raise ValueError(f"activation checkpointing must be 'none', 'blocks' or 'every_n', got {mode!r}")
        if int(every) < 1:
            raise ValueError(f"activation checkpointing every_n needs n >= 1, got {every}")
        self.activation_checkpointing = mode
        self.checkpoint_every = int(every)

    def checkpointed_blocks(self) -> list[int]:
        """Indices of the blocks whose activations a training pass recomputes in the backward pass."""
        mode = self.activation_checkpointing
        if mode == "blocks":
            return list(range(len(self.blocks)))
        if mode == "every_n":
            return list(range(0, len(self.blocks), self.checkpoint_every))
        return []

    def is_task_specific(self, index: int) -> bool:
        """Whether block ``index`` depends on the task: the task embedding is added before it (``every_block``), or
        it holds a per-task router (MoE attention, MoE MLP, learned MoD, MoNE's router) or a routed layer that reads
        the task embedding (``moe_inputs``). An A-MoD block around a dense block does not (its scores come from the
        tokens)."""
        if self.task_embed is not None and self.cfg.task_embed == "every_block":
            return True
        for m in self.blocks[index].modules():
            if isinstance(m, TaskLinear):
                return True
            if isinstance(m, RoutedLayer) and not (isinstance(m, MoDBlock) and m.router is None):
                return True
        return False

    def first_task_block(self) -> int:
        """Index of the first task-specific block (`is_task_specific`); ``len(self.blocks)`` when none is: the
        blocks before it run once per image, whatever the number of tasks."""
        return next((i for i in range(len(self.blocks)) if self.is_task_specific(i)), len(self.blocks))

    def _run_block(self, block: nn.Module, x: torch.Tensor, ctx: ForwardContext, recompute: bool) -> torch.Tensor:
        """``block(x, ctx)``; with ``recompute``, under activation checkpointing: the block runs on a copy of the
        context and what it wrote there (statistics, A-MoD scores, MoNE state) is copied back once, so the
        backward's recomputation (on another copy) changes nothing the pass recorded."""
        if not recompute:
            return block(x, ctx)
        before = dataclasses.replace(ctx, stats=[])  # the context as this block finds it

        def run(rows: torch.Tensor) -> tuple[torch.Tensor, ForwardContext]:
            # a fresh copy each call: the backward's recomputation writes into a copy that is dropped
            own = dataclasses.replace(before, stats=[])
            return block(rows, own), own

        y, after = checkpoint(run, x, use_reentrant=False, preserve_rng_state=True)
        for field in dataclasses.fields(ForwardContext):
            if field.name != "stats":
                setattr(ctx, field.name, getattr(after, field.name))
        ctx.stats.extend(after.stats)
        return y

    def forward_tokens(self, x: torch.Tensor, task_ids: torch.Tensor,
                       segments: list[tuple[int, int, int]] | None = None,
                       rows: torch.Tensor | None = None, collect_stats: bool = True
                       ) -> tuple[torch.Tensor, ForwardContext]:
        """Runs the blocks on x tagged with ``task_ids`` [R]; returns normed tokens and the context.

        Args:
            x: [R, N, D], one row per task row; or, with ``rows``, [B, N, D], one row per image.
            task_ids: [R] model task index of every task row.
            segments: ``(task, first_row, end_row)`` runs when task rows are task-major: per-task routers then run
                one matmul per task.
            rows: [R] the image (row of x) each task row reads. The blocks before the first task-specific one
                (`first_task_block`) then run once on x's B rows, and the rows fan out (``x[rows]``) at that block.
            collect_stats: the routed layers report statistics into ``ctx.stats`` (False: none are made).

        Returns:
            (tokens, ctx). Tokens have one row per task row, except when ``rows`` was given and no block is
            task-specific: then they are still the B image rows and ``ctx.shared_rows`` (= ``rows``) is set; task
            row r's tokens are ``tokens[rows[r]]``.
        """
        ctx = ForwardContext(task_ids=task_ids, num_tasks=len(self.task_names),
                             mone_capacity=self._capacity_for_step(), record_routing=self.record_routing,
                             segments=segments, shared_rows=rows, collect_stats=collect_stats)
        emb = None
        if self.task_embed is not None:
            emb = self.task_embeddings().index_select(0, task_ids).to(x.dtype)  # [R, D]
            if self.cfg.task_embed == "moe_inputs":
                ctx.moe_task_embed = emb
        fan_out = self.first_task_block() if rows is not None else 0
        graph = self.training and torch.is_grad_enabled()
        recompute = set(self.checkpointed_blocks()) if graph else set()
        every = emb is not None and self.cfg.task_embed == "every_block"
        # inference on the CUDA path: dense and MoD blocks add the embedding in passes they make anyway
        # (`squad.kernels.rows`), and a MoD block may write into an input made in this pass that no hook sees
        fused = every and not torch.is_grad_enabled() and takes_kernel_path(x.device)
        pending: torch.Tensor | None = None  # [R, D] the embedding x still lacks
        given, made, prev = x, None, None  # the caller's tensor, the last block's output, the last block
        # `routed`: the MoNE block x just came from while x is in MoNE's routed token order, else None. Only MoNE
        # blocks see that order (squad.layers.mone): it is undone before any other block and redone after it.
        routed: MoNEBlock | None = None
        for i, block in enumerate(self.blocks):
            if i == fan_out and ctx.shared_rows is not None:
                x = self._fan_out(x, ctx)
            is_mone = isinstance(block, MoNEBlock)
            if every:
                pending = emb if pending is None else pending + emb
                takes = is_mone or (fused and isinstance(block, Block | MoDBlock) and block.takes_pending_embed()
                                    and not observed(block))
                if takes:  # MoNE blocks always add it themselves, fused into their kernels where those run
                    ctx.pending_embed = pending
                else:
                    x = x + pending[:, None, :]
                pending = None
            if ctx.mone is not None and is_mone and routed is None:
                x = ctx.mone.permute(x)
            elif routed is not None and not is_mone:
                x = ctx.mone.unpermute(x)
                scores = ctx.attn_scores if routed.want_scores else None  # A-MoD scores for this block, if any
                ctx.attn_scores = ctx.mone.unpermute(scores) if scores is not None else None
            ctx.owns_input = fused and x is not given and not (x is made and observed(prev)) and not observed(block)
            x = made = self._run_block(block, x, ctx, i in recompute)
            prev, routed = block, (block if is_mone else None)
            pending, ctx.pending_embed, ctx.owns_input = ctx.pending_embed, None, False  # what x still lacks
        if routed is not None:
            x = ctx.mone.unpermute(x)
        if pending is not None:  # left by the last block: added in the final norm's pass
            if isinstance(self.norm, nn.LayerNorm):
                return row_norm(x, None, pending, self.norm.weight, self.norm.bias, self.norm.eps)[0], ctx
            x = x + pending[:, None, :]
        return self.norm(x), ctx

    @staticmethod
    def _fan_out(x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Image rows [B, N, D] → task rows [R, N, D] (with the A-MoD scores the last shared block left)."""
        rows = ctx.shared_rows
        if ctx.mone is not None:  # MoNE's router is task-specific: the rows fan out before it
            raise RuntimeError("fan-out after a MoNE router: MoNE routing state cannot be shared across tasks")
        if ctx.attn_scores is not None:
            ctx.attn_scores = ctx.attn_scores.index_select(0, rows)
        ctx.shared_rows = None
        return x.index_select(0, rows)

    def forward(self, images: torch.Tensor, tasks: str | Sequence[str] | None = None,
                assignment: torch.Tensor | None = None) -> SquadOutput:
        """Runs ``tasks`` on ``images`` in one backbone pass.

        Args:
            images: [B, C, H, W].
            tasks: task names or aliases, or one name (``"depth"`` = ``["depth"]``); default: all of the model's
                tasks. Each task at most once (predictions are keyed by canonical name).
            assignment: optional [B, len(tasks)] bool, which images run which task (default: every image runs
                every task). Task rows are task-major; the blocks before the first task-specific one run once per
                image (`forward_tokens`).

        Returns:
            `SquadOutput` with per-task predictions, the images each task ran on, and the routing statistics.

        Raises:
            ValueError: an unknown task, a task listed twice (also under two aliases), or bad shapes.
        """
        if isinstance(tasks, str):
            tasks = [tasks]
        tasks = list(self.task_names if tasks is None else tasks)
        tidx = self.task_index(tasks)
        if len(set(tidx)) != len(tidx):
            first = {}
            for name, t in zip(tasks, tidx, strict=True):
                if t in first:
                    raise ValueError(f"tasks {first[t]!r} and {name!r} are both task {self.task_names[t]!r}: "
                                     "list each task once")
                first[t] = name
        x0 = self.embed(images)
        b = x0.shape[0]
        if assignment is None:
            per_task = [torch.arange(b, device=x0.device)] * len(tasks)
        else:
            if assignment.shape != (b, len(tasks)):
                raise ValueError(f"assignment must be [{b}, {len(tasks)}] (images × tasks), "
                                 f"got {list(assignment.shape)}")
            per_task = [assignment[:, j].nonzero().flatten().to(x0.device) for j in range(len(tasks))]
        task_ids = torch.cat([torch.full((len(p),), t, device=x0.device, dtype=torch.long)
                              for p, t in zip(per_task, tidx, strict=True)])
        # the task rows read image rows: fanned out inside the backbone at its first task-specific block
        rows = torch.cat(per_task) if assignment is not None or len(tasks) > 1 else None
        segments, start = [], 0
        for t, p in zip(tidx, per_task, strict=True):
            if len(p):
                segments.append((t, start, start + len(p)))
            start += len(p)
        tokens, ctx = self.forward_tokens(x0, task_ids, segments, rows)
        shared = ctx.shared_rows is not None  # no task-specific block: tokens are the B image rows
        preds, index, start = {}, {}, 0
        for t, p in zip(tidx, per_task, strict=True):
            canonical = self.task_names[t]
            if not shared:
                own = tokens[start : start + len(p)]
            else:
                own = tokens if assignment is None else tokens.index_select(0, p)
            preds[canonical] = self.heads[canonical](own)
            index[canonical] = p
            start += len(p)
        return SquadOutput(preds, index, ctx.stats)

    def forward_features(self, images: torch.Tensor, task: str | None = None) -> torch.Tensor:
        """Final normed tokens [B, N, D] for one task (the task may be omitted when the model has one)."""
        if task is None:
            if len(self.task_names) != 1 and self.has_task_specific_layers():
                raise ValueError(f"forward_features needs task= (one of {', '.join(self.task_names)})")
            task = self.task_names[0]
        (t,) = self.task_index([task])
        x = self.embed(images)
        ids = torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)
        tokens, _ = self.forward_tokens(x, ids, [(t, 0, x.shape[0])], collect_stats=False)
        return tokens

    def has_task_specific_layers(self) -> bool:
        """Whether the backbone depends on the task (task embeddings or routers)."""
        if self.task_embed is not None:
            return True
        return any(isinstance(m, RoutedLayer) for m in self.modules())

    def task_embeddings(self) -> torch.Tensor | None:
        """[T, D] task embeddings, added tasks' rows last (None when the model has none)."""
        if self.task_embed is None or self.task_embed_extra is None:
            return self.task_embed
        return torch.cat([self.task_embed, self.task_embed_extra])


def build_model(cfg: ModelConfig | SquadConfig | str | Path) -> SquadViT:
    """Builds a freshly initialised `SquadViT`.

    Args:
        cfg: a `ModelConfig`; a `SquadConfig` or `RunConfig` (its ``model`` section is used); a YAML path (model
            or run config); or a registered model name (`squad.list_models`). Use `squad.create_model` to change
            fields of a named config as you build it.

    Raises:
        ConfigError: an unknown name or file, or an invalid config (the message names the key).
        TypeError: ``cfg`` is none of these.
    """
    if isinstance(cfg, str | Path):
        cfg = load_config(cfg)
    if not isinstance(cfg, ModelConfig) and isinstance(getattr(cfg, "model", None), ModelConfig):
        cfg = cfg.model
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model takes a ModelConfig, a SquadConfig/RunConfig, a YAML path or a model name, "
                        f"got {type(cfg).__name__}")
    return SquadViT(cfg)
