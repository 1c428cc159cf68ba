"""Expert parallelism: a layer's experts spread over the ranks of an expert-parallel group, tokens exchanged.

- groups:   `ExpertGroups`, the expert-parallel and expert-data-parallel process groups (DeepSpeed's, made by
            `expert_groups`; the private DeepSpeed names live there only), and `check_size`.
- exchange: `all_to_all` (uneven splits, autograd both ways) and `ExpertExchange`, one layer's count exchange (its
            one wait for the device), row exchange and local plan.
- routed:   the MoE MLP and MoE attention computations across a group (`expert_mlp`, `head_queries`,
            `head_outputs`), equal to the single-process layers'.
- shard:    cutting a layer's stacked expert weights to this rank's experts (`shard_module`, `shard_model`), listing
            them (`sharded_parameters`) and putting them back together (`gather_experts`, `full_state_dict`,
            `load_shards`).

The routers are replicated (every rank routes its own tokens over all experts), so the MI loss and the router
statistics are computed as without expert parallelism. Only training shards a model: every other entry point
builds the whole, single-process model, and checkpoints store experts by their global index, so a run resumes at any
expert-parallel size (`squad.train.expert_shards`).
"""

from __future__ import annotations

import torch.nn as nn

from squad.layers.parallel import routed
from squad.layers.parallel.exchange import ExpertExchange, all_to_all
from squad.layers.parallel.groups import SINGLE, ExpertGroups, check_size, expert_groups
from squad.layers.parallel.shard import (
    ShardedParameter,
    expert_holders,
    full_state_dict,
    gather_experts,
    is_sharded,
    load_shards,
    shard_module,
    sharded_parameters,
)


def shard_model(model: nn.Module) -> list[ShardedParameter]:
    """Shards every layer whose ``expert_parallel`` is above 1 over the running process group (a collective: every
    rank calls it on the same model).

    Returns:
        The shards (`sharded_parameters`); [] when no layer asks for expert parallelism.

    Raises:
        ValueError: an ``expert_parallel`` does not divide its layer's experts or the number of ranks.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for name, m in expert_holders(model):
        size = getattr(m, "expert_parallel", 1)
        if size > 1:
            key = getattr(type(m), "expert_parallel_key", f"{name}.expert_parallel")
            check_size(size, m.num_experts, world, f"{key} ({name})")
            shard_module(m, m.num_experts, expert_groups(size))
    return sharded_parameters(model)


__all__ = ["SINGLE", "ExpertExchange", "ExpertGroups", "ShardedParameter", "all_to_all", "check_size",
           "expert_groups", "expert_holders", "full_state_dict", "gather_experts", "is_sharded", "load_shards",
           "routed", "shard_model", "shard_module", "sharded_parameters"]
