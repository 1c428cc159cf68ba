"""Routers: per-task token-choice gates (MoE MLP, MoE attention), the statistics they report, and the context that
carries task ids and statistics through one forward pass.

Routers live outside the experts: a router maps tokens to ``(gates, expert indices)`` plus a `RouterStats`, and
experts consume ``(x, gates, indices)``, so per-task routing, MoD and MoNE all plug into the same expert code.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config import RouterConfig


@dataclasses.dataclass
class RouterStats:
    """What one routed layer reports for one forward pass (per task, summed over the task's tokens).

    Attributes:
        name: the layer's module path, e.g. ``"blocks.3.mlp"``.
        kind: ``"moe"``, ``"moa"``, ``"mod"`` or ``"mone"``.
        mass: [T, E] soft router probabilities summed per task (differentiable; the MI loss uses it).
        counts: [T, E] hard selections per task (no gradient; usage statistics and balance losses).
        tokens: [T] tokens routed per task.
        top_k: experts selected per token.
        aux_loss: a layer-specific auxiliary loss (e.g. MoD's router BCE), already averaged, or None.
    """

    name: str
    kind: str
    mass: torch.Tensor | None
    counts: torch.Tensor
    tokens: torch.Tensor
    top_k: int
    aux_loss: torch.Tensor | None = None


@dataclasses.dataclass
class ForwardContext:
    """Per-forward state passed explicitly down the blocks (never a global).

    Attributes:
        task_ids: [R] task index (into the model's task list) of every row of the batch.
        num_tasks: T, the model's number of tasks.
        stats: statistics appended by every routed layer, in order.
        attn_scores: [R, N] A-MoD routing scores from the latest attention layer asked for them.
        mone: MoNE routing state shared by the MoNE blocks after the router (see squad.layers.mone).
        mone_capacity: effective capacity e_c used by MoNE blocks in this pass.
        moe_task_embed: [R, D] task embedding per row, added to routed sublayers' inputs (task_embed=moe_inputs).
    """

    task_ids: torch.Tensor
    num_tasks: int
    stats: list[RouterStats] = dataclasses.field(default_factory=list)
    attn_scores: torch.Tensor | None = None
    mone: object | None = None
    mone_capacity: float | None = None
    moe_task_embed: torch.Tensor | None = None

    def token_task_ids(self, tokens_per_row: int) -> torch.Tensor:
        """[R·N] task index of every token when rows hold ``tokens_per_row`` tokens each."""
        return self.task_ids.repeat_interleave(tokens_per_row)

    def per_task_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sums row-level values [R, ...] into [T, ...] by task."""
        out = values.new_zeros(self.num_tasks, *values.shape[1:])
        return out.index_add(0, self.task_ids, values)


class TaskLinear(nn.Module):
    """A bank of per-task linear maps: row r uses task ``task_ids[r]``'s weight, in one batched matmul.

    Weight [T, D, O]; input [R, N, D] → [R, N, O]. Used by every per-task router (no loop over tasks, no host
    sync: the weights are gathered per row and applied with `torch.baddbmm`).
    """

    def __init__(self, num_tasks: int, dim: int, out: int, bias: bool = False, std: float = 0.02, zero: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tasks, dim, out))
        self.bias = nn.Parameter(torch.zeros(num_tasks, out)) if bias else None
        self.std = std
        self.zero = zero
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.zero:
            nn.init.zeros_(self.weight)
        else:
            nn.init.trunc_normal_(self.weight, std=self.std)

    def forward(self, x: torch.Tensor, task_ids: torch.Tensor) -> torch.Tensor:
        w = self.weight.index_select(0, task_ids)  # [R, D, O]
        if self.bias is None:
            return torch.bmm(x, w)
        return torch.baddbmm(self.bias.index_select(0, task_ids).unsqueeze(1), x, w)


@dataclasses.dataclass
class Routing:
    """A token-choice routing decision for M tokens.

    Attributes:
        gates: [M, k] weight of each selected expert.
        experts: [M, k] selected expert indices.
        probs: [M, E] soft probabilities (for statistics).
    """

    gates: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


class TaskRouter(nn.Module):
    """Noisy top-k gate with one router per task (Shazeer et al.; Mod-Squad FACTS §1).

    ``G(x) = TopK(Softmax(x W_g + ε · (Softplus(x W_noise) + 0.01)))`` with ε ~ N(0, 1) during training when noise
    is on; the kept probabilities are the gates (renormalised to sum to 1 if configured). Each row of the batch
    uses its own task's ``(W_g, W_noise)``.

    Args:
        num_tasks: T.
        dim: token width D.
        num_experts: E (including any no-op experts).
        top_k: k.
        cfg: noise / init / renormalisation settings.
    """

    def __init__(self, num_tasks: int, dim: int, num_experts: int, top_k: int, cfg: RouterConfig):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.cfg = cfg
        self.gate = TaskLinear(num_tasks, dim, num_experts, zero=cfg.zero_init)
        self.noise = TaskLinear(num_tasks, dim, num_experts, zero=True) if cfg.noise else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> Routing:
        """Routes x [R, N, D]; returns decisions for the R·N tokens (flattened row-major)."""
        logits = self.gate(x, ctx.task_ids)  # [R, N, E]
        if self.noise is not None and self.training:
            std = F.softplus(self.noise(x, ctx.task_ids)) + 1e-2
            logits = logits + torch.randn_like(logits) * std
        probs = logits.float().softmax(-1).reshape(-1, self.num_experts)  # [M, E]
        gates, experts = probs.topk(self.top_k, dim=-1)
        if self.cfg.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return Routing(gates.to(x.dtype), experts, probs)

    def stats(self, name: str, kind: str, routing: Routing, ctx: ForwardContext, tokens_per_row: int) -> RouterStats:
        """Per-task soft mass and hard counts of this routing decision."""
        r = ctx.task_ids.numel()
        e = self.num_experts
        mass = ctx.per_task_sum(routing.probs.view(r, tokens_per_row, e).sum(1))  # [T, E]
        hard = torch.zeros(r * tokens_per_row, e, device=routing.probs.device, dtype=torch.float32)
        hard.scatter_(1, routing.experts, 1.0)
        counts = ctx.per_task_sum(hard.view(r, tokens_per_row, e).sum(1))
        tokens = ctx.per_task_sum(torch.full((r,), float(tokens_per_row), device=counts.device))
        return RouterStats(name, kind, mass, counts.detach(), tokens, self.top_k)
