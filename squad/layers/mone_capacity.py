"""Mixture of Nested Experts routing arithmetic (Jain et al. 2024): how many tokens each nested expert takes.

`capacity_distribution` solves the paper's Eq. 3 (SLSQP) for the share of tokens per expert at an effective
capacity e_c, `group_sizes` turns shares into token counts for a sequence length, and `expert_preferred_routing`
(Algorithm 1) assigns tokens to experts under those counts, largest expert first. The layers that use them live in
squad.layers.mone.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from squad.lazy import constant_result


@constant_result
def capacity_distribution(e_c: float, num_experts: int = 4, beta: float = 10.0, delta: float = 2.0) -> tuple:
    """`_capacity_distribution`, which torch.compile calls while tracing and keeps as a constant: the SLSQP solve is
    host work on constants (and tracing it into scipy fails)."""
    return _capacity_distribution(e_c, num_experts, beta, delta)


@functools.lru_cache(maxsize=256)
def _capacity_distribution(e_c: float, num_experts: int, beta: float, delta: float) -> tuple:
    """Share of tokens per nested expert (smallest first) for an effective capacity e_c (paper Eq. 3).

    Maximises ``Σ_i c_i / δ^(i-1) − β Σ_i c_i log c_i`` subject to ``Σ c_i = 1``, ``Σ c_i / 2^(E-i) = e_c``,
    ``0 ≤ c_i ≤ 1`` with SLSQP. We use the formula as printed (dividing by δ^(i−1), i = 1 the smallest expert);
    at β = 10 it differs from the multiplying variant (a public re-implementation) by < 0.01 per entry.

    Returns:
        c as a tuple of E floats (smallest expert first), summing to 1.
    """
    from scipy.optimize import minimize

    widths = np.array([1.0 / 2 ** (num_experts - 1 - i) for i in range(num_experts)])  # d_i / D
    if e_c >= 1.0 - 1e-9:
        return tuple([0.0] * (num_experts - 1) + [1.0])
    if e_c <= widths[0] + 1e-9:
        return tuple([1.0] + [0.0] * (num_experts - 1))
    if num_experts == 1:
        return (1.0,)
    reward = 1.0 / delta ** np.arange(num_experts)
    eps = 1e-12

    def objective(c):
        c = np.clip(c, eps, 1.0)
        return -(np.sum(reward * c) - beta * np.sum(c * np.log(c)))

    def grad(c):
        c = np.clip(c, eps, 1.0)
        return -(reward - beta * (np.log(c) + 1.0))

    cons = [
        {"type": "eq", "fun": lambda c: np.sum(c) - 1.0, "jac": lambda c: np.ones_like(c)},
        {"type": "eq", "fun": lambda c: np.dot(c, widths) - e_c, "jac": lambda c: widths},
    ]
    x0 = np.full(num_experts, 1.0 / num_experts)
    res = minimize(objective, x0, jac=grad, method="SLSQP", bounds=[(0.0, 1.0)] * num_experts, constraints=cons,
                   options={"ftol": 1e-12, "maxiter": 500})
    if not res.success:
        raise RuntimeError(f"capacity solver failed for e_c={e_c}: {res.message}")
    c = np.clip(res.x, 0.0, 1.0)
    return tuple(float(v) for v in c / c.sum())


def group_sizes(n: int, capacity: tuple) -> list[int]:
    """Tokens per expert (smallest first): k_j = floor(c_j · N) for all but the smallest, which takes the rest."""
    sizes = [math.floor(c * n + 1e-9) for c in capacity]
    sizes[0] = n - sum(sizes[1:])
    return sizes


def expert_preferred_routing(probs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Expert Preferred Routing (paper Algorithm 1), batched over rows.

    Args:
        probs: [R, N, E] router probabilities (expert 0 smallest).
        sizes: tokens per expert (smallest first), summing to N.

    Returns:
        order [R, N]: token indices grouped by expert, largest expert first (each group's tokens in decreasing
        preference); token ``order[r, i]`` goes to the expert whose group contains position i.
    """
    r, n, e = probs.shape
    taken = torch.zeros(r, n, dtype=torch.bool, device=probs.device)
    groups = []
    for j in range(e - 1, 0, -1):
        if sizes[j] == 0:
            continue
        p = probs[..., j].masked_fill(taken, -1.0)
        idx = p.topk(sizes[j], dim=1).indices  # [R, k_j]
        taken.scatter_(1, idx, True)
        groups.append(idx)
    if sizes[0]:
        rest = (~taken).float()
        groups.append(rest.topk(sizes[0], dim=1, sorted=False).indices)  # all remaining tokens
    return torch.cat(groups, dim=1)
