"""Model surgery: every structural edit of a built model — adding a task, folding added tasks in, keeping some tasks,
keeping some experts — and building on the meta device with shape-checked weight assignment.

Every per-task parameter of a `SquadViT` is a row of a [T, ...] tensor (`TaskLinear` banks in MoE attention, MoE
MLP, MoD and MoNE routers; the task embeddings) or a head in ``heads``:

- `add_task` gives a trained model a new task: its head, its task embedding and a row in every per-task router,
  held in separate parameters (``TaskLinear.extra``, ``task_embed_extra``) so everything the model had can be
  frozen exactly (`added_task_parameters` lists the new ones); `merge_added_tasks` folds them back into an ordinary
  model whose config lists the new head last; `with_new_task` is a copy with one task added;
- `replace_head` puts another module in a task's head's place (router fine-tuning's linear probe);
- `select_tasks` slices the rows of the chosen tasks: an ordinary model of those tasks whose outputs for them equal
  the original model's;
- `keep_experts` cuts every MoE attention / MoE MLP layer down to the experts it keeps, each layer through its own
  contract (`ExpertLayer.keep_experts`): nothing here edits a layer's weights, expert count or top-k from outside.

`squad.models.pruning` decides which experts to keep; `squad.posttrain` (extraction, router fine-tuning) calls these.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from squad.config.model import HeadConfig, ModelConfig
from squad.layers.heads import build_head
from squad.layers.mone import upgrade_legacy_alpha
from squad.layers.routing import TaskLinear, TaskRouter
from squad.models.pruning import prunable_layers
from squad.models.vit import SquadViT, init_timm
from squad.tasks import get_task

INITS = ("mean", "zero", "random")  # where an added task's router rows and task embedding start


def build_on_meta(cfg: ModelConfig) -> SquadViT:
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


def _refuse_pruned(model: SquadViT, what: str) -> None:
    if any(isinstance(m, TaskRouter) and m.kept is not None for m in model.modules()):
        raise ValueError(f"{what}: this model's routers are pruned (an extracted model); use the full model")


# ------------------------------------------------------------------------------------------------- tasks
@torch.no_grad()
def add_task(model: SquadViT, head: HeadConfig | str, init: str = "mean") -> None:
    """Adds a task to a trained model in place: its head, its task embedding and its rows in every per-task router
    (MoE attention, MoE MLP, MoD learned routers, MoNE routers).

    The new rows live in separate parameters (``TaskLinear.extra``, ``task_embed_extra``; `added_task_parameters`),
    so the model's own parameters can be frozen exactly; `merge_added_tasks` folds them in.

    Args:
        model: the model (its config gains the new head, last).
        head: a task name from `squad.tasks` or a `HeadConfig`.
        init: router rows and embedding start at the mean of the existing tasks' (``"mean"``), at zero (``"zero"``:
            uniform routing), or at the layers' own initialisation (``"random"``). The head is initialised as
            `SquadViT.init_weights` initialises heads.

    Raises:
        ValueError: the model already has this task, an unknown ``init``, or a model whose routers are pruned.
    """
    if init not in INITS:
        raise ValueError(f"add_task: init must be one of {', '.join(INITS)}, got {init!r}")
    if isinstance(head, str):
        task = get_task(head)
        head = HeadConfig(task.name, task.head_kind, task.channels)
    if head.name in model.heads:
        raise ValueError(f"add_task: the model already has task {head.name!r} (tasks: {', '.join(model.task_names)})")
    _refuse_pruned(model, "add_task")
    ref = model.pos_embed
    for m in model.modules():
        if isinstance(m, TaskLinear):
            m.add_rows(1, init)
    if model.task_embed is not None:
        if init == "mean":
            row = model.task_embeddings().mean(0, keepdim=True).clone()  # [1, D]
        elif init == "zero":
            row = torch.zeros(1, ref.shape[-1], dtype=ref.dtype, device=ref.device)
        else:
            row = nn.init.trunc_normal_(torch.empty(1, ref.shape[-1], dtype=ref.dtype, device=ref.device), std=0.02)
        extra = row if model.task_embed_extra is None else torch.cat([model.task_embed_extra, row])
        model.task_embed_extra = nn.Parameter(extra)  # [T', D]
    cfg = model.cfg
    module = build_head(head, cfg.embed_dim, cfg.patch_size, cfg.grid, cfg.class_token).to(ref.device, ref.dtype)
    init_timm(module)
    model.heads[head.name] = module
    model.task_names.append(head.name)
    model.cfg = dataclasses.replace(cfg, heads=[*cfg.head_configs(), head])


def added_task_parameters(model: SquadViT) -> dict[str, nn.Parameter]:
    """Name → parameter of everything `add_task` created that is not a head (router rows, task embeddings)."""
    return {n: p for n, p in model.named_parameters()
            if n == "task_embed_extra" or n.endswith((".extra", ".extra_bias"))}


@torch.no_grad()
def merge_added_tasks(model: SquadViT) -> None:
    """Folds added tasks' rows into the ordinary parameters in place (the state dict then matches
    ``build_model(model.cfg)``)."""
    for m in model.modules():
        if isinstance(m, TaskLinear):
            m.merge_rows()
    if model.task_embed_extra is not None:
        grad = model.task_embed.requires_grad
        model.task_embed = nn.Parameter(model.task_embeddings().detach().clone(), requires_grad=grad)
        model.task_embed_extra = None


def with_new_task(base: SquadViT, task: str, init: str = "mean", seed: int = 0) -> SquadViT:
    """A copy of ``base`` with ``task`` added (`add_task`; the fresh parts drawn from ``seed``, the global RNG left
    as it was)."""
    model = copy.deepcopy(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        add_task(model, task, init)
    return model


def replace_head(model: SquadViT, task: str, head: nn.Module) -> None:
    """Puts ``head`` (tokens [B, N, D] → the task's prediction) in the place of ``task``'s head, in place.

    The config still names the head it was built with, so such a model runs and trains but is not saved (its weights
    would not load into ``build_model(model.cfg)``): router fine-tuning's linear probe
    (`squad.posttrain.finetune.LinearProbe`) is one.

    Raises:
        ValueError: a task the model does not have.
    """
    (t,) = model.task_index([task])
    ref = model.pos_embed
    model.heads[model.task_names[t]] = head.to(ref.device)


def select_tasks(model: SquadViT, tasks: Sequence[str]) -> SquadViT:
    """A new model with only ``tasks`` (in that order): their heads, router rows and embeddings.

    Shared weights are copied, so the result is independent of ``model``. Rows of tasks added with `add_task` count
    like the others.

    Raises:
        ValueError: an unknown task, or a model whose routers were pruned.
    """
    _refuse_pruned(model, "select_tasks")
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


# ----------------------------------------------------------------------------------------------- experts
def keep_experts(model: SquadViT, kept: dict[str, list[int]], exact: bool = True) -> None:
    """Cuts every MoE attention / MoE MLP layer of ``model`` down to its kept experts (in place), each layer through
    `ExpertLayer.keep_experts`.

    Args:
        model: a model whose layers are not pruned yet (real or meta tensors).
        kept: layer name → kept real-expert indices (every prunable layer must be listed).
        exact: exact routing (the router scores all experts); False: softmax over the kept experts only.

    Raises:
        ValueError: a layer missing from ``kept`` or unknown to the model, or an index out of range; the model is
            then unchanged (every entry is checked first).
    """
    layers = prunable_layers(model)
    unknown = sorted(set(kept) - set(layers))
    missing = sorted(set(layers) - set(kept))
    if unknown or missing:
        raise ValueError(f"kept experts do not match the model's MoE layers (unknown {unknown[:3]}, "
                         f"missing {missing[:3]})")
    for name, layer in layers.items():
        idx = list(kept[name])
        e = layer.num_experts
        if not idx or len(set(idx)) != len(idx) or not all(isinstance(i, int) and 0 <= i < e for i in idx):
            raise ValueError(f"layer {name}: kept experts must be distinct indices in [0, {e}), got {idx}")
    for name, layer in layers.items():  # checked all first: a bad entry leaves the model as it was
        layer.keep_experts(list(kept[name]), exact)
