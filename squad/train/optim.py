"""The optimiser's side of a run: AdamW parameter groups (`param_groups`: no weight decay on norms, biases,
embeddings, task weights; expert weights in groups of their own) and the learning-rate schedule (`lr_lambda`: linear
warm-up, then cosine to a floor; `warmup_note` when the warm-up outlasts the run).
"""

from __future__ import annotations

import math

from squad.train.objective import MultiTaskObjective


def param_groups(objective: MultiTaskObjective, weight_decay: float) -> list[dict]:
    """AdamW groups: no decay on norms, biases, embeddings, routers' biases and task log-variances; expert
    weights in groups of their own (named, so expert-parallel setups can split them)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in objective.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = (p.dim() <= 1 or name.endswith(".bias") or "pos_embed" in name or "cls_token" in name
                    or "task_embed" in name or "log_vars" in name or ".alpha" in name)
        expert = ".experts." in name or name.endswith((".q", ".o"))
        groups.setdefault((no_decay, expert), []).append(p)
    out = []
    for (no_decay, expert), params in sorted(groups.items()):
        out.append({"params": params, "weight_decay": 0.0 if no_decay else weight_decay,
                    "name": f"{'experts' if expert else 'dense'}_{'no_decay' if no_decay else 'decay'}"})
    return out


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
