"""What flows through one forward pass besides the tokens: `ForwardContext` (task ids, task-major row segments,
A-MoD scores, MoNE routing state) passed explicitly down the blocks, and `RouterStats`, what every routed layer
appends to it (per-task soft mass and hard counts) for the losses, usage statistics and task relations.
"""

from __future__ import annotations

import dataclasses

import torch


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
        experts: [R·N, k] the expert indices every token selected (row-major over the layer's input rows), only
            when the forward pass records routing (``ForwardContext.record_routing``; task-relation analysis).
    """

    name: str
    kind: str
    mass: torch.Tensor | None
    counts: torch.Tensor
    tokens: torch.Tensor
    top_k: int
    aux_loss: torch.Tensor | None = None
    experts: torch.Tensor | None = None


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
        record_routing: routers also report every token's selected experts (`RouterStats.experts`); off in
            training, so the hot path keeps nothing extra.
        segments: ``(task, first_row, end_row)`` when the rows are task-major runs known on the host (the model's
            forward always lays them out so); per-task layers then run one grouped matmul over all tasks instead
            of gathering a weight per row.
        shared_rows: [R] the image row each task row reads while the blocks still run once per image (the blocks
            before the first task-specific one, `SquadViT.forward_tokens`): those blocks see the B image rows,
            ``task_ids`` and ``segments`` describe the R task rows they fan out to; None once the rows are per task.
        pending_embed: [R, D] a per-row embedding the next block's input still lacks, which the block adds itself in
            passes it makes anyway (MoNE blocks always; on the CUDA path in inference dense blocks and Mixture-of-Depths
            blocks too, `squad.kernels.rows`) instead of the model adding it before the block. A block that takes it
            clears it, or leaves what its output still lacks (a MoD block writing into its own input).
        collect_stats: routed layers report their statistics (`RoutedLayer.report`); off where nothing reads them
            (`SquadViT.forward_features`), so inference launches nothing for them.
        owns_input: the next block may write into its input (inference on the CUDA path, the input made in this pass
            and seen by no hook); set by the model before each block.
    """

    task_ids: torch.Tensor
    num_tasks: int
    stats: list[RouterStats] = dataclasses.field(default_factory=list)
    attn_scores: torch.Tensor | None = None
    mone: object | None = None
    mone_capacity: float | None = None
    moe_task_embed: torch.Tensor | None = None
    record_routing: bool = False
    segments: list[tuple[int, int, int]] | None = None
    shared_rows: torch.Tensor | None = None
    pending_embed: torch.Tensor | None = None
    collect_stats: bool = True
    owns_input: bool = False
    _rows_per_task: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    def rows_per_task(self) -> torch.Tensor:
        """[T] float32 task rows of each task (computed once per pass: every routed layer's token counts are it
        times the tokens it routed per row)."""
        if self._rows_per_task is None:
            ones = torch.ones(self.task_ids.shape, device=self.task_ids.device)
            self._rows_per_task = ones.new_zeros(self.num_tasks).index_add(0, self.task_ids, ones)
        return self._rows_per_task

    def per_task_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sums row-level values [R, ...] into [T, ...] by task (values [B, ...] of the image rows while the rows
        are shared: each counts once for every task row that reads it)."""
        if self.shared_rows is not None:
            values = values.index_select(0, self.shared_rows)
        out = values.new_zeros(self.num_tasks, *values.shape[1:])
        return out.index_add(0, self.task_ids, values)
