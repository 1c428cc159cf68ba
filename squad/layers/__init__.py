"""The layers of a SquadViT, one concept per module.

- attention:     `attend` (every attention call, through squad.kernels) and the dense `Attention` (timm layout).
- mlp:           the dense two-layer GELU `Mlp` (timm layout).
- heads:         task heads on the final tokens (`DenseHead`, `ClassHead`, `TokenHead`, `build_head`).
- context:       `ForwardContext`, the per-forward state passed down the blocks, and `RouterStats`, what routed
                 layers report into it.
- base:          the routed-layer contract: `RoutedLayer` (``kind``, ``layer_name``, `report`, ``macs(tokens,
                 capacity=None)``), `ExpertLayer` (`keep_experts`) and `EXPERT_KINDS`.
- routing:       per-task routers: `TaskLinear` (per-task weight bank) and `TaskRouter` (noisy top-k gate, `Routing`).
- experts:       grouped expert matmuls and token dispatch/combine (a package: the dispatch plan, the CPU algorithm,
                 the kernel path of grouped GEMMs for CUDA, dense all-head projections, the ops layers call).
- parallel:      expert parallelism (a package): DeepSpeed's expert(-data)-parallel groups, the token exchange
                 (all_to_all_single, uneven splits, autograd), the routed layers across a group, expert shards.
- moe_mlp:       `MoEMlp`, the mixture-of-experts MLP (`ExpertMLP`, no-op experts, capacity dropping).
- moe_attention: `MoEAttention`, mixture of attention heads (MoA) over one shared key/value head.
- mod:           `MoDBlock`, Mixture-of-Depths around any block (learned or attention routing).
- mone:          Mixture of Nested Experts layers: `MoNERouter` and `MoNEBlock` (and their shared `MoNEState`).
- mone_capacity: MoNE routing arithmetic: capacity distribution (SLSQP), group sizes, Expert Preferred Routing.
- nested:        nested-width projections for MoNE (`nested_linear_in` / `nested_linear_out` autograd ops).
- block:         `Block`, the pre-norm transformer block whose attention and MLP the layer plan picks.
"""
