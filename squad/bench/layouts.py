"""Memory per GPU and all-to-all traffic of a model under each parallel layout: ZeRO stage × expert-parallel size.
`squad.bench.plan` adds the table to ``tools/bench.py --plan`` (how many 80 GiB GPUs a config needs, and how).

Counting (bytes per parameter per GPU, as the ZeRO paper counts model state; activations come from the plan's
measured step and are the same in every layout):

- **Dense parameters** (everything but the stacked expert weights) live in DeepSpeed: mixed precision with Adam holds
  2 (bf16 weights) + 2 (gradients) + 12 (fp32 master weights and moments) bytes per parameter, fp32 4 + 4 + 8. ZeRO-1
  divides the 12 (or 8) by the N data-parallel GPUs, ZeRO-2 the gradients too, ZeRO-3 the weights too.
- **Expert weights** of a layer with expert_parallel P > 1 are squad's shards (`squad.train.expert_shards`): each GPU
  holds E/P experts as fp32 master weights with fp32 gradients and Adam moments (16 bytes per parameter), cast to the
  compute dtype as they are used, whatever the ZeRO stage. At P = 1 they are dense parameters for DeepSpeed.
- **Gradient and weight traffic per step per GPU** (sent; a ring moves (N − 1)/N of a buffer per pass): DeepSpeed's
  parameters all-reduce their gradients (ZeRO 0–2: a reduce-scatter and an all-gather, 2 passes of the gradient
  bytes) or, under ZeRO-3, all-gather their weights for the forward and again for the backward and reduce-scatter
  the gradients (3 passes); expert shards all-reduce their float32 gradients over the N/P ranks holding the same
  experts.
- **All-to-all bytes per step per GPU** (sent, forward and backward): a token row routed to a rank other than its
  own crosses the group both ways; with routing spread evenly a fraction (P − 1)/P of the M·k slots leave. An MoE MLP
  slot carries D out and D back; an MoE attention slot D out (to the head's query projection), d back, d out (to its
  output projection), D back; the backward moves the same again. MoD blocks routing fewer tokens are counted at
  every token (an upper bound).
"""

from __future__ import annotations

import torch

from squad.layers.parallel import expert_holders
from squad.models.vit import SquadViT

GPU_BYTES = 80 * 2**30  # the GPUs counted: 80 GiB (an H100 or A100 80 GB)
ZERO_STAGES = (0, 1, 2, 3)


def expert_parameters(model: SquadViT) -> dict[str, int]:
    """Parameters of the stacked expert weights per layer kind (``moe``: MoE MLP experts, ``moa``: MoE attention
    heads' query and output projections)."""
    out = {"moe": 0, "moa": 0}
    for _, m in expert_holders(model):
        kind = "moa" if type(m).expert_parallel_key.startswith("model.moa") else "moe"
        out[kind] += sum(getattr(m, n).numel() for n in type(m).expert_params if getattr(m, n) is not None)
    return out


def _dense_bytes(precision: str, zero: int, gpus: int) -> float:
    weights, grads, optim = (2.0, 2.0, 12.0) if precision in ("bf16", "fp16") else (4.0, 4.0, 8.0)
    if zero >= 1:
        optim /= gpus
    if zero >= 2:
        grads /= gpus
    if zero >= 3:
        weights /= gpus
    return weights + grads + optim


def state_bytes(params: int, experts: dict[str, int], precision: str, zero: int, ep: int | dict[str, int],
                gpus: int) -> float:
    """Model-state bytes per GPU (see the module docstring).

    Args:
        params: every parameter of the model.
        experts: expert-weight parameters per kind (`expert_parameters`).
        precision: ``bf16``/``fp16`` (mixed) or ``fp32``.
        zero: ZeRO stage.
        ep: expert_parallel of every expert layer, or per kind (``{"moe": 8, "moa": 1}``).
        gpus: data-parallel GPUs.
    """
    eps = ep if isinstance(ep, dict) else dict.fromkeys(experts, ep)
    sharded = {k: n for k, n in experts.items() if eps.get(k, 1) > 1}
    dense = params - sum(sharded.values())
    return dense * _dense_bytes(precision, zero, gpus) + sum(n / eps[k] * 16.0 for k, n in sharded.items())


def all_to_all_bytes(model: SquadViT, rows_per_gpu: int, ep: int | dict[str, int], itemsize: int = 2) -> float:
    """Bytes one GPU sends by all-to-all per step (forward and backward) with expert_parallel ``ep`` (one size for
    every expert layer, or per kind)."""
    eps = ep if isinstance(ep, dict) else {"moe": ep, "moa": ep}
    cfg = model.cfg
    tokens = rows_per_gpu * cfg.num_tokens
    total = 0.0
    for block in cfg.blocks():
        p = eps.get("moe", 1)
        if block.mlp == "moe" and p > 1:
            total += tokens * (p - 1) / p * cfg.moe.top_k * 2 * cfg.embed_dim
        p = eps.get("moa", 1)
        if block.attn == "moa" and p > 1:
            total += tokens * (p - 1) / p * cfg.moa.top_k * 2 * (cfg.embed_dim + cfg.moa.head_dim)
    return 2 * total * itemsize  # and the backward, the same again


def sync_bytes(params: int, experts: dict[str, int], precision: str, zero: int, ep: dict[str, int],
               gpus: int) -> float:
    """Gradient and weight bytes one GPU sends per step (see the module docstring)."""
    item = 2 if precision in ("bf16", "fp16") else 4
    sharded = {k: n for k, n in experts.items() if ep.get(k, 1) > 1}
    dense = params - sum(sharded.values())
    ring = (gpus - 1) / gpus
    total = dense * item * (3 if zero == 3 else 2) * ring
    for k, n in sharded.items():
        replicas = gpus // ep[k]
        total += n / ep[k] * 4 * 2 * (replicas - 1) / replicas
    return total


def gpus_needed(fits, start: int, limit: int = 1 << 16) -> int | None:
    """The smallest GPU count from ``start`` (doubling) for which ``fits(gpus)``; None up to ``limit``."""
    n = start
    while n <= limit:
        if fits(n):
            return n
        n *= 2
    return None


def layout_table(model: SquadViT, precision: str, gpus: int, rows_per_gpu: int, activations: float | None,
                 eps: list[dict[str, int]]) -> list[dict]:
    """One row per (expert-parallel layout, ZeRO stage): memory per GPU on ``gpus`` GPUs, the 80 GiB GPUs needed at
    least (activations included, at the plan's batch per GPU), gradient/weight and all-to-all bytes per step per
    GPU.

    Args:
        model: the config's model (meta tensors are enough).
        precision: ``bf16`` or ``fp32``.
        gpus: the plan's GPU count.
        rows_per_gpu: token rows per GPU per step (images × tasks each trains).
        activations: activation bytes per GPU (None when not measured: counted as 0).
        eps: expert-parallel layouts to show, ``{"moe": P, "moa": P'}`` (a size that does not divide its layers'
            experts is skipped).
    """
    params = sum(p.numel() for p in model.parameters())
    experts = expert_parameters(model)
    counts = {"moe": model.cfg.moe.num_experts, "moa": model.cfg.moa.num_experts}
    itemsize = torch.finfo(torch.bfloat16 if precision == "bf16" else torch.float32).bits // 8
    act = activations or 0.0
    rows = []
    for ep in eps:
        if any(counts[k] % p for k, p in ep.items()):
            continue
        group = max(ep.values())
        for zero in ZERO_STAGES:
            per_gpu = state_bytes(params, experts, precision, zero, ep, max(gpus, group)) + act
            need = gpus_needed(lambda n, zero=zero, ep=ep: state_bytes(params, experts, precision, zero, ep, n)
                               + act <= GPU_BYTES, group)
            n = max(gpus, group)
            rows.append({"zero_stage": zero, "expert_parallel": dict(ep), "gpus": n,
                         "memory_per_gpu_bytes": per_gpu, "fits_80gib": per_gpu <= GPU_BYTES,
                         "gpus_needed_80gib": need,
                         "sync_bytes_per_step": sync_bytes(params, experts, precision, zero, ep, n),
                         "all_to_all_bytes_per_step": all_to_all_bytes(model, rows_per_gpu, ep, itemsize)})
    return rows


def format_layouts(rows: list[dict], params: int, experts: dict[str, int]) -> list[str]:
    """The table as text lines."""
    gib = 2**30
    lines = [f"  layouts: {params / 1e9:.3g} B parameters, {sum(experts.values()) / 1e9:.3g} B of them expert weights "
             f"(MoE MLP {experts['moe'] / 1e9:.3g} B, MoE attention {experts['moa'] / 1e9:.3g} B); 80 GiB GPUs",
             "    ZeRO  EP moe/moa   GPUs  memory/GPU  fits  80 GiB GPUs needed  grads+weights/step  all-to-all/step"]
    for r in rows:
        need = "none up to 65536" if r["gpus_needed_80gib"] is None else str(r["gpus_needed_80gib"])
        ep = f"{r['expert_parallel']['moe']}/{r['expert_parallel']['moa']}"
        lines.append(f"    {r['zero_stage']:>4}  {ep:>10}  {r['gpus']:>5}  "
                     f"{r['memory_per_gpu_bytes'] / gib:>8.1f} G  {'yes' if r['fits_80gib'] else 'no ':>4}  "
                     f"{need:>18}  {r['sync_bytes_per_step'] / gib:>14.2f} GiB  "
                     f"{r['all_to_all_bytes_per_step'] / gib:>11.2f} GiB")
    return lines


def layouts_to_show(run_ep: dict[str, int]) -> list[dict[str, int]]:
    """No expert parallelism, the run's own layout, and 8 GPUs per group for the MoE MLP alone and for both kinds."""
    out = []
    for ep in ({"moe": 1, "moa": 1}, dict(run_ep), {"moe": 8, "moa": 1}, {"moe": 8, "moa": 8}):
        if ep not in out:
            out.append(ep)
    return out


def rows_per_gpu(batch: int, tasks_per_image: int, tasks: int) -> int:
    """Token rows per GPU per step: every image once per task it trains (all tasks, or ``tasks_per_image``)."""
    return batch * (tasks_per_image or tasks)
