"""The routed-layer contract: `RoutedLayer`, the base class of every layer that routes tokens, `ExpertLayer`, the
routed layers whose router picks k of E experts per token, and `EXPERT_KINDS`, their kinds.

A routed layer has a class-level ``kind`` (``"moe"``, ``"moa"``, ``"mod"``, ``"mone"``: the ``RouterStats.kind``
it reports) and an instance ``layer_name``, its module path in the model (``"blocks.3.mlp"``), which the model sets
once built (`SquadViT._wire`) and which names its statistics. Every routed layer

- reports each forward pass through `RoutedLayer.report` (one `RouterStats` appended to the pass's context, its
  per-task sums and token counts made in that one place);
- counts its multiply-accumulates with ``macs(tokens, capacity=None)`` (the signature of every token layer:
  ``capacity`` is MoD's share of processed tokens or MoNE's effective capacity, None for the configured one, and
  ignored by layers that have none);
- when it is an `ExpertLayer`, removes experts itself (`ExpertLayer.keep_experts`: pruning never edits its weights,
  expert count or top-k from outside).

Code finds routed layers with ``isinstance(m, RoutedLayer)`` and the expert-choosing ones with
``m.kind in EXPERT_KINDS`` (or ``isinstance(m, ExpertLayer)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn as nn

from squad.layers.context import ForwardContext, RouterStats
from squad.layers.routing import Routing, TaskRouter

EXPERT_KINDS: tuple[str, ...] = ("moe", "moa")
"""Kinds whose routers pick k of E experts per token (MoE MLP, MoE attention): the layers the MI and balance losses
act on, that pruning slices, that usage frequencies and task relations describe."""


class RoutedLayer(nn.Module):
    """A layer that routes tokens and reports one `RouterStats` per forward pass (`report`).

    Subclasses set ``kind`` and call ``super().__init__()`` first; ``layer_name`` starts as the kind and becomes the
    module path once the model names its layers.

    Attributes:
        kind: the ``RouterStats.kind`` this layer reports.
        layer_name: the layer's module path (the ``RouterStats.name`` it reports).
    """

    kind: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        if not type(self).kind:
            raise TypeError(f"{type(self).__name__} subclasses RoutedLayer without setting its class attribute 'kind'")
        self.layer_name = type(self).kind

    def report(self, ctx: ForwardContext, tokens_per_row: int, counts: torch.Tensor, mass: torch.Tensor | None = None,
               top_k: int = 1, aux_loss: torch.Tensor | None = None,
               experts: torch.Tensor | None = None) -> RouterStats | None:
        """Appends this layer's `RouterStats` for this pass to ``ctx.stats`` (and returns it); nothing (None) when the
        pass collects no statistics (``ctx.collect_stats`` off: callers may skip making the counts too).

        Args:
            ctx: the pass's context (its task ids say which task each row belongs to).
            tokens_per_row: tokens the layer routed in every row (N; the per-task token counts are made here).
            counts: [R, C] hard counts per row (no gradient kept); summed per task.
            mass: [R, E] soft router probabilities summed per row (differentiable), or None; summed per task.
            top_k: selections per token.
            aux_loss: the layer's auxiliary loss, already averaged, or None.
            experts: [R·N, k] every token's selections (the counts' columns); kept only when ``ctx.record_routing``
                ([B·N, k] of image rows shared by the task rows are recorded per task row, [R·N, k]).
        """
        if not ctx.collect_stats:
            return None
        tokens = ctx.rows_per_task() * tokens_per_row
        recorded = None
        if experts is not None and ctx.record_routing:
            recorded = experts.detach()
            if ctx.shared_rows is not None:  # image rows → the task rows that read them (as the counts count them)
                k = recorded.shape[-1]
                recorded = recorded.view(-1, tokens_per_row, k).index_select(0, ctx.shared_rows).reshape(-1, k)
        stats = RouterStats(self.layer_name, self.kind, None if mass is None else ctx.per_task_sum(mass),
                            ctx.per_task_sum(counts).detach(), tokens, top_k, aux_loss, recorded)
        ctx.stats.append(stats)
        return stats


class ExpertLayer(RoutedLayer):
    """A routed layer whose per-task `TaskRouter` picks k of its experts per token (MoE MLP, MoE attention).

    The layer holds its experts' weights stacked along a first dimension of size `num_experts` (the real experts;
    an MoE MLP's no-op experts hold nothing and follow them in the router's numbering). `top_k` is the router's:
    the one place it lives.

    Subclasses create ``self.router`` and implement `num_experts` and `_select_experts`.
    """

    router: TaskRouter

    @property
    def num_experts(self) -> int:
        """Real experts the layer holds weights for (no-op experts excluded)."""
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        """Experts selected per token (the router's; fewer than configured after pruning left fewer experts)."""
        return self.router.top_k

    def route(self, x: torch.Tensor, ctx: ForwardContext) -> Routing:
        """Routes x [R, N, D] with this layer's router and reports the decision (`RoutedLayer.report`)."""
        routing = self.router(x, ctx)
        if ctx.collect_stats:
            mass, counts = routing.row_sums(x.shape[0])
            self.report(ctx, x.shape[1], counts, mass, self.top_k, experts=routing.experts)
        return routing

    def keep_experts(self, kept: Sequence[int], exact: bool = True) -> None:
        """Keeps only real experts ``kept`` (in place); their order becomes the new expert numbering and no-op
        experts follow them. The router is restricted to them (`TaskRouter.restrict`); top-k shrinks to the
        number of experts left when fewer than k remain.

        Args:
            kept: distinct indices in [0, num_experts).
            exact: the router keeps scoring every expert (removed ones are never selected), so on tokens that never
                chose a removed expert the layer computes what it did before; False: the router's other columns are
                dropped and its softmax runs over the kept experts only (the paper's pruned router).

        Raises:
            ValueError: ``kept`` is empty, repeats an index or names one out of range; or the layer was pruned
                already.
        """
        e = self.num_experts
        kept = list(kept)
        if not kept or len(set(kept)) != len(kept) or not all(isinstance(i, int) and 0 <= i < e for i in kept):
            raise ValueError(f"{self.layer_name}: kept experts must be distinct indices in [0, {e}), got {kept}")
        if self.router.kept is not None:
            raise ValueError(f"{self.layer_name}: the layer's experts were pruned already")
        noop = self.router.choices - e
        self._select_experts(torch.as_tensor(kept, dtype=torch.long))
        self.router.restrict(kept + list(range(e, e + noop)), exact)

    def _select_experts(self, index: torch.Tensor) -> None:
        """Replaces the stacked expert weights by their rows ``index`` [K] (new parameters, same requires_grad)."""
        raise NotImplementedError


def observed(module: nn.Module | None) -> bool:
    """Whether a forward hook or pre-hook can see ``module``'s inputs or outputs (on it or any submodule, or a
    global one): fused inference paths that skip a submodule's call or write into a block's input are off then."""
    if module is None:
        return False
    hooks = torch.nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def select_rows(p: torch.Tensor | None, index: torch.Tensor) -> nn.Parameter | None:
    """A new parameter holding rows ``index`` of ``p`` (None stays None; real or meta tensors)."""
    if p is None:
        return None
    return nn.Parameter(p.detach().index_select(0, index.to(p.device)).clone(), requires_grad=p.requires_grad)
