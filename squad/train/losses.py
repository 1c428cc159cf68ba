"""Auxiliary losses and task weighting: mutual information between tasks and experts (Mod-Squad), switch / cv²
balance losses (baselines), MoD router BCE, and uncertainty weighting (Kendall et al. 2018).

The MI statistics are T×E sums of soft router probabilities per task. In data-parallel training they are summed
across ranks with an autograd-aware all-reduce before I(T;E) is taken, so with gradients averaged across ranks
(as DeepSpeed does) 2 ranks × B images give the same loss and gradients as 1 rank × 2B.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from squad.config.model import LossConfig
from squad.distributed import is_distributed
from squad.layers.base import EXPERT_KINDS
from squad.layers.context import RouterStats


def mutual_information(mass: torch.Tensor) -> torch.Tensor:
    """I(T; E) in nats from a T×E table of soft probability mass per task (the Mod-Squad paper's MI loss).

    ``P(T,E) = mass / Σ mass``, ``P(T)`` and ``P(E)`` its marginals (so P(T) is the batch's task mix; tasks
    with no tokens contribute nothing). ``I = Σ P(T,E) log(P(T,E) / (P(T) P(E)))``.
    """
    if mass.dim() != 2:
        raise ValueError(f"mass must be a T×E table, got shape {list(mass.shape)}")
    mass = mass.float()
    p = mass / mass.sum().clamp_min(1e-12)
    pt = p.sum(1, keepdim=True)
    pe = p.sum(0, keepdim=True)
    tiny = 1e-12
    return (p * (torch.log(p.clamp_min(tiny)) - torch.log(pt.clamp_min(tiny)) - torch.log(pe.clamp_min(tiny)))).sum()


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the backward sums the incoming gradients the same way (every rank's loss depends on
    every rank's share)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g)
        return g


def all_reduce_mass(mass: torch.Tensor) -> torch.Tensor:
    """Sums a statistic over data-parallel ranks with autograd (gradients flow back to every rank's share)."""
    if is_distributed():
        return _AllReduceSum.apply(mass)
    return mass


def mi_terms(stats: Sequence[RouterStats], distributed: bool = True) -> dict[str, torch.Tensor]:
    """I(T;E) per routed layer (MoE MLP and MoE attention), keyed by layer name."""
    out = {}
    for s in stats:
        if s.kind in EXPERT_KINDS and s.mass is not None:
            mass = all_reduce_mass(s.mass) if distributed else s.mass
            out[s.name] = mutual_information(mass)
    return out


def balance_loss(stats: Sequence[RouterStats], kind: str = "switch", scope: str = "per_task") -> torch.Tensor:
    """Load-balancing loss averaged over routed layers (the baselines' auxiliary loss).

    Args:
        stats: the step's router statistics.
        kind: ``"switch"`` (E · Σ_e f_e · P_e, f = share of dispatched slots, P = mean probability) or ``"cv2"``
            (squared coefficient of variation of expert importance plus that of the load).
        scope: ``"per_task"`` balances each task's routing separately (normal MoE), ``"all"`` balances the sum
            over tasks (the paper's "modified MoE").
    """
    losses = []
    for s in stats:
        if s.kind not in EXPERT_KINDS or s.mass is None:
            continue
        mass, counts, tokens = s.mass.float(), s.counts.float(), s.tokens.float()
        if scope == "all":
            mass, counts, tokens = mass.sum(0, keepdim=True), counts.sum(0, keepdim=True), tokens.sum().view(1)
        live = tokens > 0
        mass, counts, tokens = mass[live], counts[live], tokens[live]
        if mass.numel() == 0:
            continue
        e = mass.shape[1]
        if kind == "switch":
            frac = counts / (tokens[:, None] * s.top_k)
            prob = mass / tokens[:, None]
            losses.append((e * (frac * prob).sum(1)).mean())
        elif kind == "cv2":
            def cv2(x):
                return x.var(1, unbiased=False) / x.mean(1).pow(2).clamp_min(1e-12)

            losses.append((cv2(mass) + cv2(counts)).mean())
        else:
            raise ValueError(f"unknown balance loss {kind!r} (switch | cv2)")
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).mean()


def router_aux_loss(stats: Sequence[RouterStats]) -> torch.Tensor | None:
    """Mean of the layers' own auxiliary losses (MoD router BCE), or None if none reported one."""
    aux = [s.aux_loss for s in stats if s.aux_loss is not None]
    return torch.stack(aux).mean() if aux else None


class TaskWeighting(nn.Module):
    """Combines task losses: uncertainty weighting (learned log-variance s_t per task) or equal weights.

    ``uncertainty``: Σ_t ½·exp(−s_t)·L_t + ½·s_t (Kendall et al., the stable log-variance form).
    ``uncertainty_log1p``: Σ_t ½·exp(−s_t)·L_t + log(1 + exp(s_t)) (the authors' ½/σ²·L + log(1+σ²), σ² = e^s).
    ``equal``: Σ_t L_t. Task losses are clamped to ±clamp first (the authors' safeguard).
    """

    def __init__(self, tasks: Sequence[str], method: str = "uncertainty", clamp: float = 1000.0):
        super().__init__()
        self.tasks = list(tasks)
        self.method = method
        self.clamp = clamp
        self.log_vars = nn.Parameter(torch.zeros(len(self.tasks))) if method != "equal" else None

    def forward(self, losses: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """Returns (weighted total, the effective weight of each task: 1.0, or a detached 0-dim tensor)."""
        total = None
        weights = {}
        for name, loss in losses.items():
            loss = loss.float().clamp(-self.clamp, self.clamp)
            if self.log_vars is None:
                term, w = loss, 1.0
            else:
                s = self.log_vars[self.tasks.index(name)]
                w_t = 0.5 * torch.exp(-s)
                reg = 0.5 * s if self.method == "uncertainty" else F.softplus(s)
                term, w = w_t * loss + reg, w_t.detach()  # a tensor: read on the host only when logged
            total = term if total is None else total + term
            weights[name] = w
        if total is None:
            raise ValueError("no task losses to weight")
        return total, weights


def auxiliary_loss(stats: Sequence[RouterStats], cfg: LossConfig, distributed: bool = True
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The configured auxiliary terms: −w_mi·Σ I(T;E), w_balance·balance, w_mod_aux·router BCE.

    Returns:
        (sum of the weighted terms, dict of the unweighted parts for logging: ``mi/<layer>``, ``balance``,
        ``mod_aux``).
    """
    parts: dict[str, torch.Tensor] = {}
    total = torch.zeros(())
    if cfg.w_mi > 0:
        mi = mi_terms(stats, distributed)
        for name, value in mi.items():
            parts[f"mi/{name}"] = value
        if mi:
            total = total - cfg.w_mi * torch.stack(list(mi.values())).sum()
    if cfg.balance != "none" and cfg.w_balance > 0:
        bal = balance_loss(stats, cfg.balance, cfg.balance_scope)
        parts["balance"] = bal
        total = total + cfg.w_balance * bal
    aux = router_aux_loss(stats)
    if aux is not None and cfg.w_mod_aux > 0:
        parts["mod_aux"] = aux
        total = total + cfg.w_mod_aux * aux
    return total, parts
