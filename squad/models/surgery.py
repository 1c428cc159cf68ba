"""Task surgery on a trained model: keep some tasks, drop the others (their heads, router rows, embeddings).

Every per-task parameter of a `SquadViT` is a row of a [T, ...] tensor (`TaskLinear` banks in MoE attention, MoE
MLP, MoD and MoNE routers; the task embeddings) or a head in ``heads``. `select_tasks` slices those rows, so the
result is an ordinary model of the chosen tasks whose outputs for them equal the original model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from squad.config.model import HeadConfig
from squad.layers.mone import upgrade_legacy_alpha
from squad.layers.routing import TaskLinear, TaskRouter
from squad.models.vit import SquadViT


def head_config(model: SquadViT, task: str) -> HeadConfig:
    """The `HeadConfig` of one of the model's tasks (name or alias)."""
    (t,) = model.task_index([task])
    return model.cfg.head_configs()[t]


def build_on_meta(cfg) -> SquadViT:
    """A model whose parameters have shapes but no storage (to be filled with ``load_state_dict(assign=True)``)."""
    with torch.device("meta"):
        return SquadViT(cfg)


def load_assigned(model: SquadViT, state: dict[str, torch.Tensor], source: str) -> SquadViT:
    """Fills a meta-built model with ``state`` (tensors taken as they are), checking names and shapes.

    Raises:
        ValueError: names or shapes differ, naming the first offending keys and ``source``.
    """
    own = model.state_dict()
    state = upgrade_legacy_alpha(state)  # MoNE's α was saved 0-dim before it became [1]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ValueError(f"{source}: weights do not match the model config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    wrong = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in own.items() if state[k].shape != v.shape]
    if wrong:
        k, got, want = wrong[0]
        raise ValueError(f"{source}: weight {k} has shape {got}, the config needs {want} "
                         f"({len(wrong)} mismatched tensors: a checkpoint of another model?)")
    model.load_state_dict(state, assign=True)
    return model


def select_tasks(model: SquadViT, tasks: Sequence[str]) -> SquadViT:
    """A new model with only ``tasks`` (in that order): their heads, router rows and embeddings.

    Shared weights are copied, so the result is independent of ``model``. Rows of tasks added with
    `SquadViT.add_task` count like the others.

    Raises:
        ValueError: an unknown task, or a model whose routers were pruned.
    """
    if any(isinstance(m, TaskRouter) and m.kept is not None for m in model.modules()):
        raise ValueError("select_tasks: the model's routers are pruned (an extracted model)")
    idx = model.task_index(tasks)
    if len(set(idx)) != len(idx):
        raise ValueError(f"select_tasks: a task is listed twice in {list(tasks)}")
    names = [model.task_names[i] for i in idx]
    heads = model.cfg.head_configs()
    cfg = dataclasses.replace(model.cfg, heads=[heads[i] for i in idx])
    rows = torch.as_tensor(idx, dtype=torch.long)
    banks = {name: m for name, m in model.named_modules() if isinstance(m, TaskLinear)}
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            module, _, leaf = key.rpartition(".")
            if module in banks:
                if leaf in ("extra", "extra_bias"):
                    continue
                full = banks[module].weight if leaf == "weight" else banks[module].bias  # added tasks' rows too
                value = full.index_select(0, rows.to(full.device))
            elif key == "task_embed":
                value = model.task_embeddings().index_select(0, rows.to(value.device))
            elif key == "task_embed_extra":
                continue
            elif key.startswith("heads.") and key.split(".")[1] not in names:
                continue
            state[key] = value.detach().clone()
    out = load_assigned(build_on_meta(cfg), state, "select_tasks")
    out.mone_capacity = model.mone_capacity
    out.train(model.training)
    return out
