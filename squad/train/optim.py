"""The optimiser's side of a run: AdamW parameter groups (`param_groups`, `named_param_groups`: no weight decay on
norms, biases, embeddings, task weights; expert weights in groups of their own) and the learning-rate schedule
(`lr_lambda`: linear warm-up, then cosine to a floor; `warmup_note` when the warm-up outlasts the run).
"""

from __future__ import annotations

import math

from squad.train.objective import MultiTaskObjective


def param_groups(objective: MultiTaskObjective, weight_decay: float) -> list[dict]:
    """AdamW groups of the objective's parameters (`named_param_groups`); an expert-parallel model's expert shards
    are not among them (`squad.train.expert_shards` trains those by the same rules)."""
    return named_param_groups(objective.named_parameters(), weight_decay)


def named_param_groups(named, weight_decay: float) -> list[dict]:
    """AdamW groups of ``(name, parameter)`` pairs: no decay on norms, biases, embeddings, routers' biases and task
    log-variances; expert weights in groups of their own (named ``experts_decay`` etc.)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in named:
        if p.requires_grad:
            groups.setdefault(group_key(name, p.dim()), []).append(p)
    return [{"params": params, "weight_decay": 0.0 if key[0] else weight_decay, "name": group_name(key)}
            for key, params in sorted(groups.items())]


def group_key(name: str, dim: int) -> tuple[bool, bool]:
    """(no weight decay, expert weight) of the parameter ``name`` with ``dim`` dimensions; groups sort by it."""
    no_decay = (dim <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name
                or "task_embed" in name or "log_vars" in name or ".alpha" in name)
    return no_decay, ".experts." in name or name.endswith((".q", ".o"))


def group_name(key: tuple[bool, bool]) -> str:
    """The name of a `group_key`'s group: ``dense_decay``, ``experts_no_decay``, ..."""
    no_decay, expert = key
    return f"{'experts' if expert else 'dense'}_{'no_decay' if no_decay else 'decay'}"


def warmup_note(warmup: int, total: int, lr: float) -> str | None:
    """What a warm-up longer than the run means, or None when it is not (the run logs it as a warning).

    With ``warmup > total`` the learning rate rises linearly for the whole run and never reaches ``optim.lr`` (it
    ends at lr·total/warmup), and the cosine decay never starts: usually a shrunk run (fewer ``optim.steps``) that
    kept a paper config's warm-up.
    """
    if warmup <= total:
        return None
    return (f"optim.warmup_steps={warmup} (or warmup_epochs) exceeds the run's {total} steps: the learning rate rises "
            f"for the whole run, peaks at {lr * total / warmup:.3g} instead of optim.lr={lr:g}, and never decays; "
            f"set optim.warmup_steps below optim.steps")


def lr_lambda(step: int, warmup: int, total: int, base: float, floor: float) -> float:
    """Multiplier of the base lr: linear warm-up, then cosine down to ``floor``."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (floor + (base - floor) * 0.5 * (1 + math.cos(math.pi * progress))) / base
