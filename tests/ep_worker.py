"""Expert-parallel layers against the single-process layer, in float64, on every rank of a launched job.

Run by tests/test_expert_parallel.py under ``deepspeed --num_gpus N`` (CPU, gloo): every rank builds the same layers
and data from seeds, runs each case once expert-parallel (its own tokens, its share of the experts) and once as the
single-process layer (the tokens of every rank of its expert-parallel group, the whole layer), and rank 0 writes the
largest differences of outputs and gradients per case (and what the exchange moved) to ``--out`` as JSON.

Cases: odd token counts that differ per rank, an expert no token chooses, every token on the first rank's experts
(the others receive nothing), no-op experts, capacity drops (the whole MoE MLP with its routers), and the whole MoE
attention layer; some again on the CUDA path (`force_cuda_path`: the grouped-GEMM custom ops, which the local experts
run on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch
import torch.distributed as dist


def _ctx(rows: int, num_tasks: int):
    from squad.layers.context import ForwardContext

    per = -(-rows // num_tasks)
    ids = torch.arange(rows) // per
    segments = [(t, t * per, min(rows, (t + 1) * per)) for t in range(num_tasks) if t * per < rows]
    return ForwardContext(task_ids=ids, num_tasks=num_tasks, segments=segments)


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def expert_case(name: str, ep, tokens: list[int], experts_fn, num_experts: int = 8, noop: int = 0, k: int = 2,
                dim: int = 6, hidden: int = 5) -> dict:
    """`ExpertMLP` with given routing: EP on this rank's tokens vs the whole layer on its group's tokens."""
    from squad.layers.moe_mlp import ExpertMLP
    from squad.layers.parallel import shard_module

    rank, p = dist.get_rank(), ep.size
    torch.manual_seed(1)
    full = ExpertMLP(num_experts, dim, hidden).double()
    with torch.no_grad():
        for b in (full.b1, full.b2):
            b.normal_()
    sharded = copy.deepcopy(full)
    shard_module(sharded, num_experts, ep)
    group = range(rank - rank % p, rank - rank % p + p)  # the ranks of this rank's expert-parallel group
    data = {}
    for r in group:
        g = torch.Generator().manual_seed(100 + r)
        x = torch.randn(tokens[r], dim, generator=g, dtype=torch.float64)
        experts = experts_fn(r, tokens[r], k, g)
        gates = torch.rand(tokens[r], k, generator=g, dtype=torch.float64)
        weight = torch.randn(tokens[r], dim, generator=g, dtype=torch.float64)
        data[r] = (x, experts, gates, weight)
    # single process: every rank of the group through the whole layer, the losses summed
    ref = {}
    for r in group:
        x, experts, gates, weight = (t.clone() for t in data[r])
        x.requires_grad_(True)
        gates.requires_grad_(True)
        y = full(x, gates, experts, noop=noop > 0 or bool((experts >= num_experts).any()))
        (y * weight).sum().backward()
        ref[r] = (y.detach(), x.grad, gates.grad)
    x, experts, gates, weight = (t.clone() for t in data[rank])
    x.requires_grad_(True)
    gates.requires_grad_(True)
    y = sharded(x, gates, experts, noop=True)
    (y * weight).sum().backward()
    rows = ep.local_range(num_experts)
    diffs = {"out": _diff(y, ref[rank][0]), "grad_x": _diff(x.grad, ref[rank][1]),
             "grad_gates": _diff(gates.grad, ref[rank][2])}
    for wname in ("w1", "w2", "b1", "b2"):
        diffs[f"grad_{wname}"] = _diff(getattr(sharded, wname).grad,
                                       getattr(full, wname).grad[rows.start : rows.stop])
    from squad.layers.parallel import routed

    _, ex = routed.plan_exchange(experts, num_experts, ep)
    return {"case": name, "diffs": diffs, "sent": ex.sent, "received": ex.received,
            "real_slots": int((experts < num_experts).sum()), "slots": experts.numel()}


def moe_layer_case(ep, capacity: float, noop: int) -> dict:
    """The whole MoE MLP (routers, no-op experts, capacity dropping) on odd-length rows."""
    from squad.config.model import MoEConfig, RouterConfig
    from squad.layers.moe_mlp import MoEMlp
    from squad.layers.parallel import shard_module

    rank, p = dist.get_rank(), ep.size
    cfg = MoEConfig(num_experts=4 * p, top_k=3, noop_experts=noop, capacity_factor=capacity,
                    router=RouterConfig(noise=False), expert_parallel=p)
    torch.manual_seed(2)
    full = MoEMlp(10, 7, cfg, num_tasks=3).double()
    with torch.no_grad():
        full.router.gate.weight.normal_(std=0.7)
    sharded = copy.deepcopy(full)
    shard_module(sharded.experts, cfg.num_experts, ep)
    g = torch.Generator().manual_seed(200 + rank)
    rows, n = 3 + rank, 5  # odd token counts, different per rank
    x = torch.randn(rows, n, 10, generator=g, dtype=torch.float64)
    weight = torch.randn(rows, n, 10, generator=g, dtype=torch.float64)
    outs = {}
    for tag, layer in (("ref", full), ("ep", sharded)):
        xi = x.clone().requires_grad_(True)
        y = layer(xi, _ctx(rows, 3))
        (y * weight).sum().backward()
        outs[tag] = (y.detach(), xi.grad, layer.router.gate.weight.grad)
    diffs = {"out": _diff(outs["ep"][0], outs["ref"][0]), "grad_x": _diff(outs["ep"][1], outs["ref"][1]),
             "grad_router": _diff(outs["ep"][2], outs["ref"][2])}
    # the experts' gradients sum over the group's tokens: compare with the whole layer's, summed over the group
    grads = {}
    for wname in ("w1", "w2", "b1", "b2"):
        full_grad = getattr(full.experts, wname).grad.clone()
        dist.all_reduce(full_grad, group=ep.group)
        local = ep.local_range(cfg.num_experts)
        grads[f"grad_{wname}"] = _diff(getattr(sharded.experts, wname).grad, full_grad[local.start : local.stop])
    diffs.update(grads)
    return {"case": f"moe_layer cf={capacity} noop={noop}", "diffs": diffs}


def moa_projection_case(ep, tokens: list[int]) -> dict:
    """MoE attention's two projections across the group (`head_queries`, `head_outputs`) vs the single-process ones,
    in float64 (the attention between them is the same code either way, and takes no float64)."""
    from squad.layers.experts import dispatch_matmul, matmul_combine, plan_dispatch, to_slots
    from squad.layers.parallel import routed

    rank, p = dist.get_rank(), ep.size
    e, k, dim, dh = 3 * p, 2, 6, 4
    g = torch.Generator().manual_seed(7)
    q_full = torch.randn(e, dim, dh, generator=g, dtype=torch.float64)
    o_full = torch.randn(e, dh, dim, generator=g, dtype=torch.float64)
    rows = ep.local_range(e)
    g = torch.Generator().manual_seed(400 + rank)
    m = tokens[rank]
    x = torch.randn(m, dim, generator=g, dtype=torch.float64)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])
    gates = torch.rand(m, k, generator=g, dtype=torch.float64)
    mix = torch.randn(m, k, dh, dh, generator=g, dtype=torch.float64)  # stands for the attention between them
    weight = torch.randn(m, dim, generator=g, dtype=torch.float64)
    outs, grads = {}, {}
    for tag in ("ref", "ep"):
        xi, gi = x.clone().requires_grad_(True), gates.clone().requires_grad_(True)
        if tag == "ref":
            qw, ow = q_full.clone().requires_grad_(True), o_full.clone().requires_grad_(True)
            plan = plan_dispatch(experts, e, noop=False)
            q = to_slots(dispatch_matmul(xi, qw, plan), plan)  # [M, k, d]
            out = torch.einsum("mkd,mkde->mke", q, mix)
            y = matmul_combine(out.flatten(0, 1).index_select(0, plan.order), ow, gi, plan)
        else:
            qw = q_full[rows.start : rows.stop].clone().requires_grad_(True)
            ow = o_full[rows.start : rows.stop].clone().requires_grad_(True)
            plan, ex = routed.plan_exchange(experts, e, ep, noop=False)
            q = routed.head_queries(xi, qw, plan, ex)
            out = torch.einsum("mkd,mkde->mke", q, mix)
            y = routed.head_outputs(out, ow, gi, plan, ex)
        (y * weight).sum().backward()
        outs[tag] = (y.detach(), xi.grad, gi.grad)
        grads[tag] = (qw.grad, ow.grad)
    diffs = {k: _diff(a, b) for k, a, b in zip(("out", "grad_x", "grad_gates"), outs["ep"], outs["ref"],
                                               strict=True)}
    for name, mine, whole in zip(("grad_q", "grad_o"), grads["ep"], grads["ref"], strict=True):
        whole = whole.clone()
        dist.all_reduce(whole, group=ep.group)
        diffs[name] = _diff(mine, whole[rows.start : rows.stop])
    return {"case": f"moa_projections P={p}", "diffs": diffs}


def moa_layer_case(ep) -> dict:
    """The whole MoE attention layer (routers, heads sharded) on odd-length rows, in float32 (the attention kernel
    takes no float64): differences of float32 rounding only."""
    from squad.config.model import MoAConfig, RouterConfig
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.parallel import shard_module

    rank, p = dist.get_rank(), ep.size
    cfg = MoAConfig(num_experts=3 * p, top_k=2, head_dim=4, router=RouterConfig(noise=False), expert_parallel=p)
    torch.manual_seed(3)
    full = MoEAttention(8, cfg, num_tasks=2)
    with torch.no_grad():
        full.router.gate.weight.normal_(std=0.7)
    sharded = copy.deepcopy(full)
    shard_module(sharded, cfg.num_experts, ep)
    g = torch.Generator().manual_seed(300 + rank)
    rows, n = 2 + rank, 7
    x = torch.randn(rows, n, 8, generator=g)
    weight = torch.randn(rows, n, 8, generator=g)
    outs = {}
    for tag, layer in (("ref", full), ("ep", sharded)):
        xi = x.clone().requires_grad_(True)
        y = layer(xi, _ctx(rows, 2))
        (y * weight).sum().backward()
        outs[tag] = (y.detach(), xi.grad, layer.router.gate.weight.grad, layer.kv.weight.grad)
    names = ("out", "grad_x", "grad_router", "grad_kv")
    diffs = {k: _diff(a, b) for k, a, b in zip(names, outs["ep"], outs["ref"], strict=True)}
    for wname in ("q", "o"):
        full_grad = getattr(full, wname).grad.clone()
        dist.all_reduce(full_grad, group=ep.group)
        local = ep.local_range(cfg.num_experts)
        diffs[f"grad_{wname}"] = _diff(getattr(sharded, wname).grad, full_grad[local.start : local.stop])
    return {"case": "moa_layer", "diffs": diffs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args(argv)
    from squad.distributed import init_distributed, shutdown
    from squad.kernels.device import force_cuda_path
    from squad.layers.parallel import expert_groups

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    results = []
    sizes = [s for s in (2, 4) if world % s == 0]
    for p in sizes:
        ep = expert_groups(p)
        odd = [7 + 2 * r for r in range(world)]
        e = 8

        def rand_experts(r, m, k, g, e=e):
            return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)])

        def skip_one(r, m, k, g, e=e):  # expert 1 never chosen
            choices = torch.tensor([i for i in range(e) if i != 1])
            return torch.stack([choices[torch.randperm(e - 1, generator=g)[:k]] for _ in range(m)])

        def first_rank(r, m, k, g, e=e, p=p):  # every slot on the experts of rank 0 of the group
            return torch.stack([torch.randperm(e // p, generator=g)[:k] for _ in range(m)])

        def with_noop(r, m, k, g, e=e):  # slot indices E and E+1 are no-op experts
            return torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(m)])

        for name, fn in (("odd_tokens", rand_experts), ("expert_without_tokens", skip_one),
                         ("all_on_first_rank", first_rank), ("noop_experts", with_noop)):
            res = expert_case(f"{name} P={p}", ep, odd, fn)
            results.append(res)
        results.append(expert_case(f"one_token P={p}", ep, [1] * world, rand_experts, k=1))
        for capacity, noop in ((0.0, 0), (0.5, 0), (0.75, 2)):
            res = moe_layer_case(ep, capacity, noop)
            res["case"] += f" P={p}"
            results.append(res)
        results.append(moa_projection_case(ep, odd))
        with force_cuda_path():  # the CUDA path's grouped-GEMM ops (their PyTorch implementation on the CPU)
            for name, fn in (("odd_tokens", rand_experts), ("noop_experts", with_noop)):
                results.append(expert_case(f"{name} cuda_path P={p}", ep, odd, fn))
            res = moe_layer_case(ep, 0.75, 2)
            res["case"] += f" cuda_path P={p}"
            results.append(res)
            res = moa_projection_case(ep, odd)
            res["case"] += " cuda_path"
            results.append(res)
        res = moa_layer_case(ep)
        res["case"] += f" P={p}"
        results.append(res)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "ranks": gathered}, f, indent=1)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
