"""Per-task routers: `TaskLinear`, the bank of per-task linear maps every router is made of (MoE, MoD, MoNE), and
`TaskRouter`, the noisy top-k token-choice gate of MoE MLP and MoE attention, with its decision `Routing`.

Routers live outside the experts: a router maps tokens to a `Routing` (gates, expert indices, probabilities), the
layer reports it (`RoutedLayer.report`), and experts consume ``(x, gates, indices)``, so per-task routing, MoD and
MoNE all plug into the same expert code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from squad.config.model import RouterConfig
from squad.layers.context import ForwardContext
from squad.layers.experts import grouped_matmul, segment_groups


class TaskLinear(nn.Module):
    """A bank of per-task linear maps: row r uses task ``task_ids[r]``'s weight, in one batched matmul.

    Weight [T, D, O]; input [R, N, D] → [R, N, O]. Used by every per-task router, with no loop over tasks and no
    host sync: one grouped matmul over the task-major runs of rows when the pass knows them (the model's forward
    always does), otherwise the weights gathered per row and applied with `torch.baddbmm`.

    Tasks added to a trained model (router fine-tuning) get their rows in separate parameters ``extra`` [T', D, O]
    (and ``extra_bias`` [T', O]), so the original rows can stay truly frozen; `merge_rows` folds them back. Readers
    never see the split: ``weight`` and ``bias`` are the whole bank, [T + T', D, O] and [T + T', O] (the stored
    parameters keep the names ``weight``/``bias``, so state dicts do not change).
    """

    def __init__(self, num_tasks: int, dim: int, out: int, bias: bool = False, std: float = 0.02, zero: bool = False):
        super().__init__()
        self.register_parameter("extra", None)
        self.register_parameter("extra_bias", None)
        self.register_parameter("weight", nn.Parameter(torch.empty(num_tasks, dim, out)))
        self.register_parameter("bias", nn.Parameter(torch.zeros(num_tasks, out)) if bias else None)
        self.std = std
        self.zero = zero
        self.reset_parameters()

    def _stored(self, name: str) -> torch.Tensor | None:
        if name not in self._parameters:
            raise AttributeError(name)
        return self._parameters[name]

    @property
    def weight(self) -> torch.Tensor:
        """[T + T', D, O]: the original rows followed by the added tasks' rows (one tensor: no copy without any)."""
        w = self._stored("weight")
        return w if self.extra is None else torch.cat([w, self.extra])

    @property
    def bias(self) -> torch.Tensor | None:
        """[T + T', O] or None."""
        b = self._stored("bias")
        return b if b is None or self.extra_bias is None else torch.cat([b, self.extra_bias])

    def reset_parameters(self) -> None:
        w = self._stored("weight")
        if self.zero:
            nn.init.zeros_(w)
        else:
            nn.init.trunc_normal_(w, std=self.std)

    @property
    def num_tasks(self) -> int:
        """Rows of the bank, added tasks included."""
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, task_ids: torch.Tensor,
                segments: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """x [R, N, D] → [R, N, O].

        With ``segments`` (task-major row runs, `ForwardContext.segments`) every task's rows meet its weight in one
        grouped matmul over all tasks (no per-task slices, forward or backward); without, each row gathers its
        task's weight and one batched matmul applies them.
        """
        weight, bias = self.weight, self.bias
        if segments is None:
            w = weight.index_select(0, task_ids)  # [R, D, O]
            if bias is None:
                return torch.bmm(x, w)
            return torch.baddbmm(bias.index_select(0, task_ids).unsqueeze(1), x, w)
        if torch.compiler.is_exporting():  # symbolic row counts: one matmul per run
            return self._per_segment(x, weight, bias, segments)
        r, n, d = x.shape
        if not segments or segments[-1][2] != r:
            raise ValueError(f"segments {list(segments)} do not cover the {r} rows")
        # compiled: the uncached function (dynamo traces through a cache, which it warns could be stale)
        layout = segment_groups.__wrapped__ if torch.compiler.is_compiling() else segment_groups
        groups, tasks = layout(tuple(segments), n, x.device)
        order = [t for t, _, _ in segments]
        if order == list(range(weight.shape[0])):
            pass
        elif order == list(range(order[0], order[0] + len(order))):  # consecutive tasks: a view of the bank
            weight = weight.narrow(0, order[0], len(order))
        else:
            weight = weight.index_select(0, tasks)  # [S, D, O]: the runs' tasks in run order
        y = grouped_matmul(x.reshape(r * n, d), weight, groups).view(r, n, -1)
        if bias is not None:
            y = y + bias.index_select(0, task_ids).unsqueeze(1)
        return y

    @staticmethod
    def _per_segment(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     segments: list[tuple[int, int, int]]) -> torch.Tensor:
        outs = []
        for t, start, end in segments:
            rows = x[start:end]  # [R_t, N, D]
            y = rows.reshape(-1, rows.shape[-1]) @ weight[t]
            if bias is not None:
                y = y + bias[t]
            outs.append(y.view(*rows.shape[:-1], -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.no_grad()
    def add_rows(self, count: int = 1, init: str = "mean") -> None:
        """Appends ``count`` task rows as the trainable ``extra`` parameters.

        Args:
            count: tasks to add.
            init: ``"mean"`` (the mean of the existing rows: the new task starts routing like an average task),
                ``"zero"``, or ``"random"`` (this bank's own initialisation).
        """
        if init not in ("mean", "zero", "random"):
            raise ValueError(f"init must be 'mean', 'zero' or 'random', got {init!r}")
        w = self.weight
        if init == "mean":
            rows = w.mean(0, keepdim=True).expand(count, -1, -1).clone()
        elif init == "zero" or self.zero:
            rows = torch.zeros(count, *w.shape[1:], dtype=w.dtype, device=w.device)
        else:
            rows = nn.init.trunc_normal_(torch.empty(count, *w.shape[1:], dtype=w.dtype, device=w.device), std=self.std)
        self.extra = nn.Parameter(rows if self.extra is None else torch.cat([self.extra, rows]))
        b = self.bias
        if b is not None:
            brows = b.mean(0, keepdim=True).expand(count, -1).clone() if init == "mean" else b.new_zeros(count,
                                                                                                          b.shape[1])
            self.extra_bias = nn.Parameter(brows if self.extra_bias is None else torch.cat([self.extra_bias, brows]))

    @torch.no_grad()
    def merge_rows(self) -> None:
        """Folds the added rows into the stored ``weight``/``bias`` (an ordinary [T + T', D, O] bank again)."""
        if self.extra is None:
            return
        grad = self._stored("weight").requires_grad
        w, b = self.weight.detach().clone(), self.bias
        self.extra = None
        self.extra_bias = None
        self.register_parameter("weight", nn.Parameter(w, requires_grad=grad))
        if b is not None:
            self.register_parameter("bias", nn.Parameter(b.detach().clone(), requires_grad=grad))

    @torch.no_grad()
    def select_outputs(self, columns: torch.Tensor) -> None:
        """Keeps only the output columns ``columns`` [O'] (in that order) of every task's map."""
        for name, dim in (("weight", 2), ("bias", 1), ("extra", 2), ("extra_bias", 1)):
            p = self._parameters[name]
            if p is not None:
                self.register_parameter(name, nn.Parameter(p.index_select(dim, columns).clone(), p.requires_grad))


class Routing(NamedTuple):
    """A token-choice routing decision for M tokens.

    A named tuple, so that module hooks that look for the tensors of a module's output (DeepSpeed ZeRO-3 gathers a
    router's weights again for its backward through them) find them.

    Attributes:
        gates: [M, k] weight of each selected expert.
        experts: [M, k] selected expert indices.
        probs: [M, E] soft probabilities (for statistics).
    """

    gates: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor

    def row_sums(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft mass and hard counts of the decision summed over each of ``rows`` rows of tokens.

        Returns:
            (mass [R, E] of the probabilities (differentiable), counts [R, E] of the selections (float32)).
        """
        e = self.probs.shape[-1]
        mass = self.probs.view(rows, -1, e).sum(1)
        hard = torch.zeros(self.probs.shape[0], e, device=self.probs.device, dtype=torch.float32)
        hard.scatter_(1, self.experts, 1.0)
        return mass, hard.view(rows, -1, e).sum(1)


class TaskRouter(nn.Module):
    """Noisy top-k gate with one router per task (Shazeer et al.; as in the Mod-Squad paper and its authors' code).

    ``G(x) = TopK(Softmax(x W_g + ε · (Softplus(x W_noise) + 0.01)))`` with ε ~ N(0, 1) during training when noise
    is on; the kept probabilities are the gates (renormalised to sum to 1 if configured). Each row of the batch
    uses its own task's ``(W_g, W_noise)``.

    A router of a pruned (extracted) layer may be restricted to some of its experts (`restrict`): with exact
    routing it still scores all ``num_experts`` (the softmax runs over every expert) but selects only among the
    kept ones, and it returns their positions in the kept list, i.e. the pruned layer's expert indices.

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
        self.register_buffer("kept", None)  # [K] selectable router columns, in the pruned layer's expert order

    @property
    def choices(self) -> int:
        """How many experts a token can choose from (all scored experts unless restricted)."""
        return self.num_experts if self.kept is None else self.kept.numel()

    def restrict(self, columns: list[int], exact: bool = True) -> None:
        """Limits the choice to router columns ``columns`` (their order becomes the new expert numbering).

        Args:
            columns: distinct indices in [0, num_experts).
            exact: keep scoring every expert (the softmax and the gates are the full router's; removed experts
                are never selected); otherwise drop the other columns' weights, so the softmax runs over the
                kept experts only (the paper's pruned router).

        top-k shrinks to the number of kept columns when fewer remain.
        """
        if not columns or len(set(columns)) != len(columns) or not all(0 <= c < self.num_experts for c in columns):
            raise ValueError(f"restrict: columns must be distinct indices in [0, {self.num_experts}), got {columns}")
        if self.kept is not None:
            raise ValueError("restrict: this router is already restricted")
        cols = torch.as_tensor(columns, dtype=torch.long, device=self.gate.weight.device)
        if exact:
            self.kept = cols
        else:
            self.gate.select_outputs(cols)
            if self.noise is not None:
                self.noise.select_outputs(cols)
            self.num_experts = len(columns)
        self.top_k = min(self.top_k, len(columns))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> Routing:
        """Routes x [R, N, D]; returns decisions for the R·N tokens (flattened row-major)."""
        logits = self.gate(x, ctx.task_ids, ctx.segments)  # [R, N, E]
        if self.noise is not None and self.training:
            std = F.softplus(self.noise(x, ctx.task_ids, ctx.segments)) + 1e-2
            logits = logits + torch.randn_like(logits) * std
        probs = logits.float().softmax(-1).reshape(-1, self.num_experts)  # [M, E]
        if self.kept is not None:
            probs = probs.index_select(1, self.kept)  # [M, K]: only the kept experts can be chosen
        gates, experts = probs.topk(self.top_k, dim=-1)
        if self.cfg.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return Routing(gates.to(x.dtype), experts, probs)

    def macs(self, tokens: int) -> int:
        """Multiply-accumulates of scoring ``tokens`` tokens: every scored expert's logit (all of them under exact
        routing after pruning; the noise branch, training only, is not counted)."""
        return tokens * self.gate.weight.shape[1] * self.num_experts
