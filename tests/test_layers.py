"""Conditional layers against direct reference implementations and their degenerate dense cases."""

import math

import pytest
import torch
import torch.nn.functional as F

from squad.config import BlockSpec, MoAConfig, MoDConfig, MoEConfig, MoNEConfig, RouterConfig
from squad.layers.attention import Mlp
from squad.layers.block import Block
from squad.layers.grouped import combine, dispatch_tokens, grouped_matmul, plan_dispatch
from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp, apply_capacity
from squad.layers.mone import (
    MoNEBlock,
    capacity_distribution,
    expert_preferred_routing,
    group_sizes,
)
from squad.layers.routing import ForwardContext, Routing
from tests.helpers import tiny_model_cfg

torch.manual_seed(0)


def ctx_for(rows, num_tasks=2, tasks=None):
    ids = torch.tensor(tasks) if tasks is not None else torch.arange(rows) % num_tasks
    return ForwardContext(task_ids=ids, num_tasks=num_tasks)


# ------------------------------------------------------------------------------------------------- grouped matmuls
@pytest.mark.parametrize("m,k,e,noop", [(1, 1, 1, 0), (7, 2, 3, 0), (50, 4, 16, 0), (33, 3, 5, 2)])
def test_grouped_mlp_matches_per_token_loop(m, k, e, noop):
    d, h = 12, 10
    x = torch.randn(m, d, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(e, d, h, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(e, h, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e, h, d, dtype=torch.float64, requires_grad=True)
    experts = torch.stack([torch.randperm(e + noop)[:k] for _ in range(m)])
    gates = torch.rand(m, k, dtype=torch.float64, requires_grad=True)

    plan = plan_dispatch(experts, e)
    rows = dispatch_tokens(x, plan)
    y = combine(grouped_matmul(F.gelu(grouped_matmul(rows, w1, plan, b1)), w2, plan), gates, plan)

    ref = torch.zeros(m, d, dtype=torch.float64)
    for i in range(m):
        for j in range(k):
            ex = int(experts[i, j])
            if ex < e:
                ref[i] += gates[i, j] * (F.gelu(x[i] @ w1[ex] + b1[ex]) @ w2[ex])
    assert torch.allclose(y, ref, atol=1e-10)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w1, b1, w2, gates), g)
    ref_grads = torch.autograd.grad(ref, (x, w1, b1, w2, gates), g)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_capacity_drops_late_tokens():
    experts = torch.zeros(10, 1, dtype=torch.long)  # every token wants expert 0
    routing = Routing(torch.ones(10, 1), experts, torch.ones(10, 2) / 2)
    out = apply_capacity(routing, num_experts=2, capacity_factor=1.0)  # capacity ceil(10/2) = 5
    assert out.experts[:5].eq(0).all() and out.experts[5:].eq(2).all()


# ----------------------------------------------------------------------------------------------------------- MoE
def test_one_expert_moe_equals_dense_mlp():
    d = 16
    moe = MoEMlp(d, 4 * d, MoEConfig(num_experts=1, top_k=1, router=RouterConfig(noise=False)), num_tasks=2).eval()
    mlp = Mlp(d, 4 * d)
    with torch.no_grad():
        moe.experts.w1.copy_(mlp.fc1.weight.t()[None])
        moe.experts.b1.copy_(mlp.fc1.bias[None])
        moe.experts.w2.copy_(mlp.fc2.weight.t()[None])
        moe.experts.b2.copy_(mlp.fc2.bias[None])
    x = torch.randn(4, 9, d)
    assert torch.allclose(moe(x, ctx_for(4)), mlp(x), atol=1e-6)


def test_moe_noop_experts_and_per_task_routers():
    d = 8
    cfg = MoEConfig(num_experts=3, top_k=2, noop_experts=2, router=RouterConfig(noise=False))
    moe = MoEMlp(d, 16, cfg, num_tasks=2).eval()
    with torch.no_grad():
        moe.router.gate.weight.normal_()
    x = torch.randn(1, 5, d).expand(2, 5, d).contiguous()  # same tokens, two tasks
    ctx = ctx_for(2)
    y = moe(x, ctx)
    (stats,) = ctx.stats
    assert stats.mass.shape == (2, 5) and torch.allclose(stats.mass.sum(1), torch.tensor([5.0, 5.0]))
    assert stats.counts.sum() == 2 * 5 * 2
    assert not torch.equal(stats.counts[0], stats.counts[1])  # different routers per task
    assert (y[0] - y[1]).abs().max() > 1e-3
    with torch.no_grad():  # route everything to no-op experts → the layer outputs zero
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:, :, 3:] = 0
        moe.router.gate.weight[:, 0, 3:] = 100.0
    x2 = torch.randn(2, 5, d).abs()
    x2[..., 0] = 10.0
    assert moe(x2, ctx_for(2)).abs().max() == 0


def test_router_noise_and_renormalise():
    d = 8
    cfg = MoEConfig(num_experts=4, top_k=2, router=RouterConfig(noise=True, renormalize=True, zero_init=True))
    moe = MoEMlp(d, 16, cfg, num_tasks=1)
    x = torch.randn(2, 6, d)
    r = moe.router(x, ctx_for(2, 1, [0, 0]))
    assert torch.allclose(r.gates.sum(-1), torch.ones(12))
    moe.eval()
    r2 = moe.router(x, ctx_for(2, 1, [0, 0]))
    assert torch.allclose(r2.probs, torch.full_like(r2.probs, 0.25))  # zero init, no noise at eval


# ----------------------------------------------------------------------------------------------------------- MoA
def test_moe_attention_matches_per_token_reference():
    d, e, k, dh = 16, 5, 2, 8
    moa = MoEAttention(d, MoAConfig(num_experts=e, top_k=k, head_dim=dh, router=RouterConfig(noise=False)), 2)
    moa.eval()
    x = torch.randn(3, 7, d)
    ctx = ctx_for(3)
    y = moa(x, ctx)
    routing = moa.router(x, ctx_for(3))
    gates = routing.gates.view(3, 7, k)
    experts = routing.experts.view(3, 7, k)
    kv = moa.kv(x)
    keys, vals = kv[..., :dh], kv[..., dh:]
    ref = torch.zeros_like(x)
    for r in range(3):
        for i in range(7):
            for j in range(k):
                ex = experts[r, i, j]
                q = x[r, i] @ moa.q[ex]
                p = torch.softmax(keys[r] @ q / math.sqrt(dh), 0)
                ref[r, i] += gates[r, i, j] * ((p @ vals[r]) @ moa.o[ex])
    ref = ref + moa.proj_bias
    assert torch.allclose(y, ref, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------- MoD
def _block(cfg_kwargs=None, spec=None):
    cfg = tiny_model_cfg(**(cfg_kwargs or {}))
    return cfg, Block(cfg, spec or BlockSpec(), num_tasks=2)


def test_mod_attention_routing_full_capacity_is_dense():
    cfg, block = _block()
    mod = MoDBlock(block, MoDConfig(capacity=1.0), "attention", cfg.embed_dim, 2, class_token=True)
    x = torch.randn(2, 17, cfg.embed_dim)
    ctx = ctx_for(2)
    ctx.attn_scores = torch.rand(2, 17)
    assert torch.allclose(mod(x, ctx), block(x, ctx_for(2)), atol=1e-6)


def test_mod_processes_only_top_tokens_and_scales_learned():
    cfg, block = _block()
    mod = MoDBlock(block, MoDConfig(capacity=0.25, keep_cls=True), "learned", cfg.embed_dim, 2, class_token=True)
    x = torch.randn(2, 17, cfg.embed_dim)
    ctx = ctx_for(2)
    out = mod(x, ctx)
    k = math.ceil(0.25 * 17)
    changed = (out - x).abs().sum(-1) > 0  # [R, N]
    assert changed.sum(1).tolist() == [k, k]
    assert changed[:, 0].all()  # class token always kept
    logits = mod.router(x, ctx.task_ids).squeeze(-1)
    sel = logits.clone()
    sel[:, 0] = float("inf")
    idx = sel.topk(k, 1).indices.sort(1).values
    xs = x.gather(1, idx[..., None].expand(-1, -1, cfg.embed_dim))
    ys = block(xs, ctx_for(2))
    expect = xs + logits.gather(1, idx)[..., None] * (ys - xs)
    assert torch.allclose(out.gather(1, idx[..., None].expand(-1, -1, cfg.embed_dim)), expect, atol=1e-6)
    assert ctx.stats[-1].counts[:, 0].tolist() == [k, k]


def test_mod_aux_loss_and_threshold_inference():
    cfg, block = _block()
    mod = MoDBlock(block, MoDConfig(capacity=0.5, aux_loss=True, inference="threshold"), "learned",
                   cfg.embed_dim, 2, class_token=True)
    x = torch.randn(2, 17, cfg.embed_dim)
    ctx = ctx_for(2)
    mod.train()(x, ctx)
    assert ctx.stats[-1].aux_loss is not None and ctx.stats[-1].aux_loss > 0
    mod.eval()
    with torch.no_grad():
        mod.router.weight.zero_()
        mod.router.weight[:, 0, 0] = 1.0
    x[0, :, 0] = -1.0
    x[0, 3:6, 0] = 1.0  # row 0: tokens 3..5 above threshold (+ cls)
    x[1, :, 0] = 1.0  # row 1: every token
    ctx = ctx_for(2)
    out = mod(x, ctx)
    changed = (out - x).abs().sum(-1) > 0
    assert changed[0].nonzero().flatten().tolist() == [0, 3, 4, 5]
    assert changed[1].all()
    # the padded row must not see the other tokens: same result as running its 4 tokens alone
    solo = x[0:1, [0, 3, 4, 5]]
    ys = block(solo, ctx_for(1))
    r = mod.router(solo, torch.tensor([0])).squeeze(-1)
    expect = solo + r[..., None] * (ys - solo)
    assert torch.allclose(out[0, [0, 3, 4, 5]], expect[0], atol=1e-5)


# ----------------------------------------------------------------------------------------------------------- MoNE
@pytest.mark.parametrize("e_c", [0.13, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.99])
def test_capacity_solver_constraints(e_c):
    c = capacity_distribution(e_c, 4, 10.0, 2.0)
    widths = [1 / 8, 1 / 4, 1 / 2, 1]
    assert abs(sum(c) - 1) < 1e-6
    assert abs(sum(ci * w for ci, w in zip(c, widths, strict=True)) - e_c) < 1e-5
    assert all(-1e-9 <= ci <= 1 + 1e-9 for ci in c)


def test_capacity_solver_paper_values():
    c = capacity_distribution(0.3, 4, 10.0, 2.0)
    assert max(abs(a - b) for a, b in zip(c, [0.420, 0.315, 0.191, 0.073], strict=True)) < 0.01


def _epr_direct(r, c):
    """Algorithm 1 as printed, one sequence, r [E, N]."""
    e, n = r.shape
    r = r.clone()
    m = torch.zeros(n, dtype=torch.long)
    for j in range(e - 1, -1, -1):
        kj = math.floor(c[j] * n + 1e-9)
        if kj == 0:
            continue
        idx = r[j].topk(kj).indices
        m[idx] = j
        r[:, idx] = 0
    return m


@pytest.mark.parametrize("n,e_c", [(17, 0.3), (65, 0.5), (50, 0.9), (10, 0.2)])
def test_epr_matches_algorithm_1(n, e_c):
    c = capacity_distribution(e_c)
    probs = torch.rand(3, n, 4).softmax(-1)
    sizes = group_sizes(n, c)
    order = expert_preferred_routing(probs, sizes)
    for row in range(3):
        assigned = torch.empty(n, dtype=torch.long)
        pos = 0
        for j in range(3, -1, -1):
            assigned[order[row, pos : pos + sizes[j]]] = j
            pos += sizes[j]
        assert torch.equal(assigned, _epr_direct(probs[row].t(), c))


def test_mone_full_capacity_alpha_zero_is_dense_block():
    cfg = tiny_model_cfg()
    dense = Block(cfg, BlockSpec(), num_tasks=2)
    mone = MoNEBlock(cfg.embed_dim, cfg.num_heads, int(cfg.embed_dim * cfg.mlp_ratio), MoNEConfig(), 2, True)
    mone.load_state_dict(dense.state_dict(), strict=False)
    x = torch.randn(2, 17, cfg.embed_dim)
    ctx = ctx_for(2)
    ctx.mone_capacity = 1.0
    y = mone(x, ctx)
    y = ctx.mone.unpermute(y)
    assert torch.allclose(y, dense(x, ctx_for(2)), atol=1e-5)


def test_mone_small_capacity_uses_slices():
    cfg = tiny_model_cfg()
    mone = MoNEBlock(cfg.embed_dim, cfg.num_heads, 4 * cfg.embed_dim, MoNEConfig(), 2, True)
    x = torch.randn(2, 17, cfg.embed_dim)
    ctx = ctx_for(2)
    ctx.mone_capacity = 0.3
    y = mone(x, ctx)
    sizes = group_sizes(17, capacity_distribution(0.3))
    assert [s[1] - s[0] for s in ctx.mone.slices] == sizes[::-1]
    # the smallest group's MLP update only touches its first D/8 features (attention also writes only D/8)
    start, end, width = ctx.mone.slices[-1]
    xs = x.gather(1, ctx.mone.order[..., None].expand(-1, -1, cfg.embed_dim))
    assert torch.allclose(y[:, start:end, width:], xs[:, start:end, width:])
    y.sum().backward()
    assert mone.router.proj.weight.grad is None or True  # router gets gradient only through alpha (0 at init)
    assert mone.alpha.grad is not None
