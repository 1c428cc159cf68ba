"""The training side of expert parallelism: the expert shards' gradients, optimizer, clipping and checkpoint files.

A layer with ``expert_parallel`` P > 1 holds E/P experts per rank as shards DeepSpeed never sees
(`squad.layers.parallel.shard`): DeepSpeed would average their gradients over every data-parallel rank, although
ranks in different positions of an expert-parallel group hold different experts. `ExpertShards` does for them what
the engine does for the dense parameters, at the same points of every step:

- **gradients** (`before_step`, at a gradient-accumulation boundary): a shard's gradient already sums the
  contributions of every token its experts processed, from every rank of its expert-parallel group (the exchange's
  backward brought them); it is summed over the expert-data-parallel group (the ranks holding the same experts) and
  divided by the number of ranks W, the engine's normalisation of the dense gradients. The result is what one process
  training on all W ranks' images would compute, so expert_parallel changes nothing but where the experts live;
- **clipping**: ``optim.clip`` clips by the norm of ALL gradients. The shards' share of the squared norm is summed
  over the ranks (each expert counted once) and added to the engine's own norm where DeepSpeed clips — the ZeRO and
  mixed-precision optimizers' ``unscale_and_clip_grads``, the engine's ``clip_fp32_gradients`` without them (the two
  private names this module wraps, in `_GlobalNorm`) — and the shards are clipped by the same coefficient;
- **the optimizer** (`after_step`): AdamW with the run's hyperparameters, weight decay as `squad.train.optim`
  assigns it, and the learning rate the engine's schedule used for the step; it steps only when the engine did;
- **checkpoints** (`save`, `load`): rank i < P of each layout writes its shard, weights and Adam moments, indexed by
  GLOBAL expert (``expert_shards_rank<i>.pt`` in the tag folder, `squad.io.expert_files`); loading picks each
  rank's experts out of whichever files hold them, so a run resumes at any expert-parallel size and any number of
  data-parallel ranks.

fp16 (loss scaling inside DeepSpeed's optimizer, which never sees the shards) is refused with expert parallelism;
bf16 and fp32 train with float32 master shards.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import torch
import torch.distributed as dist

from squad.config.base import ConfigError
from squad.config.model import ModelConfig
from squad.config.run import OptimConfig
from squad.io.expert_files import SHARD_FILE, SHARD_FORMAT, SHARD_GLOB, assemble, read_pieces
from squad.layers.parallel import ShardedParameter
from squad.train.optim import named_param_groups


def expert_parallel_sizes(cfg: ModelConfig) -> dict[str, int]:
    """{config key: P} of the layer kinds the model has and that ask for expert parallelism (P > 1)."""
    kinds = {b.attn for b in cfg.blocks()} | {b.mlp for b in cfg.blocks()}
    sizes = {"model.moe.expert_parallel": cfg.moe.expert_parallel if "moe" in kinds else 1,
             "model.moa.expert_parallel": cfg.moa.expert_parallel if "moa" in kinds else 1}
    return {k: v for k, v in sizes.items() if v > 1}


def check_layout(cfg: ModelConfig, world: int, precision: str) -> None:
    """Refuses expert-parallel sizes this run cannot lay out (before anything is built).

    Raises:
        ConfigError: a size does not divide the number of ranks, or fp16 with expert parallelism (each message
            names the key).
    """
    for key, size in expert_parallel_sizes(cfg).items():
        if world % size:
            raise ConfigError(f"{key}={size} does not divide the {world} ranks of this run (launch a multiple of "
                              f"{size} ranks, or set {key} to a divisor of {world})")
        if precision == "fp16":
            raise ConfigError(f"{key}={size} with train.precision=fp16: fp16's loss scaling lives inside DeepSpeed's "
                              f"optimizer, which never sees the expert shards; use bf16")


def _undecorated(fn):
    """The function under DeepSpeed's decorators (``instrument_w_nvtx`` keeps no ``__wrapped__``: its closure
    holds the function)."""
    while not inspect.signature(fn).parameters.get("total_norm") and fn.__closure__:
        inner = [c.cell_contents for c in fn.__closure__ if callable(c.cell_contents)]
        if not inner:
            break
        fn = inner[0]
    return fn


class _GlobalNorm:
    """Puts the shards' squared gradient norm into DeepSpeed's clipping, wrapping the one method the engine's
    optimizer clips with (``unscale_and_clip_grads(..., total_norm)`` of the ZeRO and fp16/bf16 optimizers) or,
    without one (fp32 at ZeRO stage 0), the engine's ``clip_fp32_gradients``. `total` is the norm the step was
    clipped by."""

    def __init__(self, engine, clip: float):
        self.clip = clip
        self.expert_sq = 0.0
        self.total: float | None = None
        opt = engine.optimizer
        method = getattr(opt, "unscale_and_clip_grads", None)
        if method is not None:
            params = inspect.signature(_undecorated(type(opt).unscale_and_clip_grads)).parameters.values()
            sig = inspect.Signature([p for p in params if p.name != "self"])  # of the bound method

            def clip_with_experts(*args, **kwargs):
                bound = sig.bind(*args, **kwargs)
                scale = float(getattr(opt, "loss_scale", 1.0) or 1.0)
                norm = bound.arguments["total_norm"]
                total = (norm**2 + self.expert_sq * scale**2) ** 0.5
                self.total = float(total) / scale
                bound.arguments["total_norm"] = total
                return method(*bound.args, **bound.kwargs)

            opt.unscale_and_clip_grads = clip_with_experts
        else:
            def clip_fp32(*_args, **_kwargs):
                grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                dense = float(torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()) if grads else 0.0
                self.total = math.sqrt(dense + self.expert_sq)
                coef = self.coefficient()
                if coef < 1.0:
                    for g in grads:
                        g.mul_(coef)

            engine.clip_fp32_gradients = clip_fp32

    def coefficient(self) -> float:
        """The factor every gradient was clipped by in this step (1 when not clipped)."""
        if self.clip <= 0 or self.total is None:
            return 1.0
        return 1.0 / max(1.0, (self.total + 1e-6) / self.clip)


class ExpertShards:
    """Gradients, optimizer, clipping and checkpoint files of a run's expert shards (see the module docstring).

    Args:
        shards: the model's shards (`squad.layers.parallel.shard_model`), prefixed as the engine names its module's
            parameters (e.g. ``model.``) by ``prefix``.
        optim: the run's optimiser settings.
        device: where the shards train.
        prefix: the name of the model inside the engine's module (weight-decay rules see the same names).
    """

    def __init__(self, shards: list[ShardedParameter], optim: OptimConfig, device: torch.device, prefix: str = ""):
        self.shards = shards
        self.prefix = prefix
        with torch.no_grad():
            for s in shards:
                s.param.data = s.param.data.to(device)
        named = [(prefix + s.name, s.param) for s in shards]
        groups = named_param_groups(named, optim.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
        self.clip = optim.clip
        self.norm: _GlobalNorm | None = None
        self._boundary = False
        self._lr = optim.lr
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def attach(self, engine) -> None:
        """Wraps the engine's clipping (`_GlobalNorm`); call once, right after ``deepspeed.initialize``."""
        self.engine = engine
        self.norm = _GlobalNorm(engine, self.clip)

    # ------------------------------------------------------------------------------------------------ a step
    @torch.no_grad()
    def before_step(self) -> None:
        """Between ``engine.backward`` and ``engine.step``: at a boundary, reduces the shards' gradients over their
        expert-data-parallel groups and hands their squared norm to the engine's clipping."""
        self._boundary = self.engine.is_gradient_accumulation_boundary()
        if not self._boundary:
            return
        self._lr = self.engine.get_lr()[0]  # the rate of this step (the schedule advances inside engine.step)
        sq = torch.zeros((), dtype=torch.float64, device=self.shards[0].param.device)
        for s in self.shards:
            g = s.param.grad
            if g is None:
                g = s.param.grad = torch.zeros_like(s.param)
            if s.ep.data_group is not None:
                dist.all_reduce(g, group=s.ep.data_group)
            g.div_(self.world)
            sq += g.double().pow(2).sum() / s.ep.data_size  # every rank adds its copy: counted once overall
        if self.world > 1:
            dist.all_reduce(sq)
        if self.norm is not None:
            self.norm.expert_sq = float(sq)  # one read of the device per step
            self.norm.total = None

    @torch.no_grad()
    def after_step(self) -> None:
        """After ``engine.step``: at a boundary where the engine stepped, clips the shards by the step's coefficient
        and steps their optimizer at the step's learning rate."""
        if not self._boundary:
            return
        self._boundary = False
        if self.engine.was_step_applied():
            coef = self.norm.coefficient() if self.norm is not None else 1.0
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr
                if coef < 1.0:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict | None:
        """This rank's file content (None when another rank of its expert-data-parallel group writes its shards):
        every shard it writes, by name, with its first global expert, weights and Adam moments."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = {}
        for s in self.shards:
            if rank >= s.ep.size:  # not the first holder of these experts
                continue
            st = self.optimizer.state.get(s.param, {})
            out[s.name] = {"first": s.first, "num_experts": s.num_experts, "weight": s.param.detach().cpu(),
                           "exp_avg": _cpu(st.get("exp_avg")), "exp_avg_sq": _cpu(st.get("exp_avg_sq")),
                           "step": float(st["step"]) if "step" in st else 0.0}
        return {"format": SHARD_FORMAT, "shards": out} if out else None

    def save(self, tag_dir: str | Path, write) -> None:
        """Writes this rank's file into ``tag_dir`` with ``write(obj, path)`` (the engine's guarded writer)."""
        state = self.state()
        if state is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            write(state, str(Path(tag_dir) / SHARD_FILE.format(rank)))

    @torch.no_grad()
    def load(self, tag_dir: str | Path, saved: str | Path | None = None, optimizer: bool = True) -> None:
        """Loads every shard's rows (and Adam moments) from the tag's shard files, whatever expert-parallel size and
        number of ranks wrote them.

        Args:
            tag_dir: the tag DeepSpeed loaded (a converted copy when the checkpointer converted it).
            saved: the tag as written: its shard files serve when ``tag_dir`` has none (a conversion of DeepSpeed's
                files only, such as the universal checkpoint).
            optimizer: load the Adam moments too.

        Raises:
            DamagedCheckpointError: a shard's experts are not all in the files (naming the weight and experts).
        """
        if saved is not None and not any(Path(tag_dir).glob(SHARD_GLOB)):
            tag_dir = saved
        pieces = read_pieces(tag_dir)
        for s in self.shards:
            rows = s.ep.local_range(s.num_experts)
            weight, moments = assemble(pieces.get(s.name, []), rows, tag_dir, s.name)
            s.param.copy_(weight)
            if optimizer and moments is not None:
                exp_avg, exp_avg_sq, step = moments
                self.optimizer.state[s.param] = {"step": torch.tensor(step), "exp_avg": exp_avg.to(s.param),
                                                 "exp_avg_sq": exp_avg_sq.to(s.param)}


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().cpu()
