"""Expert shards: a layer's stacked expert weights cut to the experts this rank holds, kept where DeepSpeed does not
look, and put back together.

A module that holds stacked expert weights lists their names in a class attribute ``expert_params`` (`ExpertMLP`:
``w1, w2, b1, b2``; `MoEAttention`: ``q, o``) and has an ``ep`` attribute (`ExpertGroups`, `SINGLE` until sharded).
`shard_module` keeps rows ``ep.local_range(E)`` of each and moves them OUT of the module's registered parameters: they
become plain attributes holding `torch.nn.Parameter` objects, so the layer's forward reads them as before while
``module.parameters()``, ``state_dict()``, ``.to()`` and DeepSpeed never see them. That is deliberate: DeepSpeed
averages every gradient it sees over all data-parallel ranks, broadcasts rank 0's values at start-up and partitions
them under ZeRO, and it does the expert-parallel variant of each only for its own ``deepspeed.moe.layer.MoE`` class
(``engine.has_moe_layers``). Squad's training loop owns the shards instead (`squad.train.expert_shards`): their
gradients summed over the expert-data-parallel group, their optimizer, their share of the gradient norm, their
checkpoint files. The shards stay float32 (at least) when the engine casts the model to bf16 (master weights); the
layers cast them to the tokens' dtype as they use them.

`sharded_parameters` lists the shards of a model; `gather_experts` puts every expert of a sharded model back together
(a collective over each expert-parallel group), so `full_state_dict` is the state dict of the single-process model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from squad.layers.parallel.groups import SINGLE, ExpertGroups


@dataclasses.dataclass(frozen=True)
class ShardedParameter:
    """One stacked expert weight of a sharded layer.

    Attributes:
        name: its name in the single-process model's state dict (``blocks.0.mlp.experts.w1``).
        param: the local rows [E/P, ...] (float32 master weights; not a registered parameter).
        num_experts: E, the experts of the whole layer.
        ep: the layout it is sharded by.
    """

    name: str
    param: nn.Parameter
    num_experts: int
    ep: ExpertGroups

    @property
    def first(self) -> int:
        """Global index of the first local expert."""
        return self.ep.local_range(self.num_experts).start


def expert_holders(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, module) of every module holding stacked expert weights (``expert_params``), in model order."""
    return [(name, m) for name, m in model.named_modules() if getattr(type(m), "expert_params", ())]


def shard_module(module: nn.Module, num_experts: int, ep: ExpertGroups) -> None:
    """Cuts ``module``'s stacked expert weights to this rank's experts and hides them from the module's parameters.

    Args:
        module: a module with ``expert_params`` whose tensors are [E, ...] registered parameters.
        num_experts: E (divisible by ``ep.size``).
        ep: the layout; `SINGLE` leaves the module as it is.

    Raises:
        ValueError: the module is sharded already, or a weight's first dimension is not E.
    """
    if ep.size == 1:
        return
    if getattr(module, "ep", SINGLE).size != 1:
        raise ValueError(f"{type(module).__name__}: its experts are sharded already")
    rows = ep.local_range(num_experts)
    for name in type(module).expert_params:
        p = module._parameters.get(name)
        if p is None:
            continue
        if p.shape[0] != num_experts:
            raise ValueError(f"{type(module).__name__}.{name}: {p.shape[0]} rows, expected one per expert "
                             f"({num_experts})")
        master = torch.promote_types(p.dtype, torch.float32)  # bf16/fp16 weights kept in float32, float64 as it is
        local = nn.Parameter(p.detach()[rows.start : rows.stop].to(master).clone(), requires_grad=p.requires_grad)
        del module._parameters[name]
        object.__setattr__(module, name, local)  # a plain attribute: invisible to parameters() and state_dict()
    module.ep = ep


def sharded_parameters(model: nn.Module) -> list[ShardedParameter]:
    """Every expert shard of a model, named as in the single-process model, in model order ([] if none)."""
    out = []
    for path, m in expert_holders(model):
        ep = getattr(m, "ep", SINGLE)
        if ep.size == 1:
            continue
        for name in type(m).expert_params:
            p = m.__dict__.get(name)
            if isinstance(p, nn.Parameter):
                out.append(ShardedParameter(f"{path}.{name}" if path else name, p, p.shape[0] * ep.size, ep))
    return out


def is_sharded(model: nn.Module) -> bool:
    """Whether any layer of the model holds only its share of the experts."""
    return bool(sharded_parameters(model))


@torch.no_grad()
def gather_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every sharded weight whole ([E, ...], float32, on the CPU), on every rank: each expert-parallel group
    gathers its shards (a collective: every rank calls it)."""
    out = {}
    for s in sharded_parameters(model):
        parts = [torch.empty_like(s.param) for _ in range(s.ep.size)]
        dist.all_gather(parts, s.param.detach().contiguous(), group=s.ep.group)
        out[s.name] = torch.cat(parts).cpu()
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the single-process model: the registered tensors plus every expert weight gathered (a
    collective when the model is sharded), each in the dtype the model holds it in."""
    state = model.state_dict()
    if not is_sharded(model):
        return state
    full = gather_experts(model)
    dtypes = {n: t.dtype for n, t in state.items() if t.is_floating_point()}
    dtype = next(iter(dtypes.values()), torch.float32)
    return {**state, **{n: t.to(dtype) for n, t in full.items()}}


@torch.no_grad()
def load_shards(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Copies this rank's rows of whole expert weights ``state[name]`` ([E, ...]) into the model's shards.

    Returns:
        The shard names ``state`` does not hold (left as they are).

    Raises:
        ValueError: a weight in ``state`` has another shape than the whole layer's (the message names it).
    """
    missing = []
    for s in sharded_parameters(model):
        t = state.get(s.name)
        if t is None:
            missing.append(s.name)
            continue
        if tuple(t.shape) != (s.num_experts, *s.param.shape[1:]):
            raise ValueError(f"{s.name}: shape {tuple(t.shape)}, the model's layer has "
                             f"{(s.num_experts, *s.param.shape[1:])}")
        rows = s.ep.local_range(s.num_experts)
        s.param.copy_(t[rows.start : rows.stop])
    return missing
