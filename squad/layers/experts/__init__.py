"""Grouped expert matmuls and token dispatch: the hot path of every MoE layer, one algorithm per file.

- plan:    `plan_dispatch` groups a routing decision's (token, slot) pairs by expert once per layer (`Dispatch`);
           `segment_groups` groups task-major runs of rows for the per-task routers (`Groups`).
- grouped: `grouped_matmul`, one matmul per group (CPU: `grouped_mm` or a loop; kernel path: the custom op).
- cpu:     the CPU algorithm of dispatch and combine (`embedding_bag` sums, host-sized slices) and its readable
           pieces (`dispatch_tokens`, `to_slots`, `from_slots`, `combine`).
- scatter: the kernel path (CUDA, compiled code): ScatterMoE-style grouped GEMMs that gather and scatter rows by
           index, bias/GELU/gate in their epilogues (`squad.kernels.grouped`), no host sync.
- ops:     what the layers call — `dispatch_matmul`, `matmul_combine`, `expert_mlp` — each choosing its algorithm
           from the plan.

An MoE layer is three separable steps: plan → expert computation → combine. Expert parallelism (tokens sent to
their expert's rank) goes between them: the plan's group sizes say how many rows go where, the experts run on the
received rows, and the combine sums what comes back (see `squad.layers.moe_mlp.ExpertMLP`).
"""

from squad.layers.experts.cpu import combine, dispatch_tokens, from_slots, to_slots
from squad.layers.experts.grouped import grouped_matmul, grouped_mm_flops, native_grouped_mm
from squad.layers.experts.ops import dispatch_matmul, expert_mlp, matmul_combine
from squad.layers.experts.plan import Dispatch, Groups, host_ints, plan_dispatch, segment_groups, takes_kernel_path

__all__ = ["Dispatch", "Groups", "combine", "dispatch_matmul", "dispatch_tokens", "expert_mlp", "from_slots",
           "grouped_matmul", "grouped_mm_flops", "host_ints", "matmul_combine", "native_grouped_mm", "plan_dispatch",
           "segment_groups", "takes_kernel_path", "to_slots"]
