"""Conditional layers against direct reference implementations and their degenerate dense cases."""

import math

import pytest
import torch
import torch.nn.functional as F

import squad
from squad.config.model import BlockSpec, MoAConfig, MoDConfig, MoEConfig, MoNEConfig, RouterConfig
from squad.layers.base import EXPERT_KINDS, RoutedLayer
from squad.layers.block import Block
from squad.layers.context import ForwardContext
from squad.layers.experts import (
    combine,
    dispatch_matmul,
    dispatch_tokens,
    grouped_matmul,
    matmul_combine,
    native_grouped_mm,
    plan_dispatch,
)
from squad.layers.mlp import Mlp
from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp, apply_capacity
from squad.layers.mone import MoNEBlock, MoNERouter
from squad.layers.mone_capacity import capacity_distribution, expert_preferred_routing, group_sizes
from squad.layers.nested import nested_linear_in, nested_linear_out
from squad.layers.routing import Routing
from tests.helpers import MODEL_CONFIGS, tiny_config, tiny_model_cfg

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


@pytest.mark.parametrize("m,k,e,noop,bias", [(1, 1, 1, 0, True), (7, 2, 3, 0, False), (50, 4, 16, 0, True),
                                             (33, 3, 5, 2, True), (20, 2, 8, 0, False)])
def test_fused_dispatch_matmul_and_matmul_combine_match_composition(m, k, e, noop, bias):
    """The fused input/output projections equal dispatch_tokens → grouped_matmul and grouped_matmul → combine,
    values and every gradient (experts left empty, no-op slots and missing biases included)."""
    din, dh, dout = 12, 7, 9
    x = torch.randn(m, din, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(e, din, dh, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e, dh, dout, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(e, dh, dtype=torch.float64, requires_grad=True) if bias else None
    b2 = torch.randn(e, dout, dtype=torch.float64, requires_grad=True) if bias else None
    experts = torch.stack([torch.randperm(e + noop)[:k] for _ in range(m)])
    gates = torch.rand(m, k, dtype=torch.float64, requires_grad=True)
    plan = plan_dispatch(experts, e)

    y = matmul_combine(torch.tanh(dispatch_matmul(x, w1, plan, b1)), w2, gates, plan, b2)
    ref = combine(grouped_matmul(torch.tanh(grouped_matmul(dispatch_tokens(x, plan), w1, plan, b1)), w2, plan, b2),
                  gates, plan)
    assert torch.allclose(y, ref, atol=1e-12)
    inputs = [t for t in (x, w1, b1, w2, b2, gates) if t is not None]
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(ref, inputs, g), strict=True):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("noop", [0, 2])
def test_native_grouped_mm_path_matches_float64_loop(noop):
    """float32 operands with 16-byte strides take PyTorch's grouped_mm (one call for all groups); its results and
    gradients match the float64 looped path, including empty experts and no-op rows (which must come out zero)."""
    m, k, e, din, dh, dout = 40, 3, 6, 16, 8, 12
    experts = torch.stack([torch.randperm(e + noop)[:k] for _ in range(m)])
    experts[experts == 2] = 1  # expert 2 stays empty
    x = torch.randn(m, din, dtype=torch.float64)
    w1, b1 = torch.randn(e, din, dh, dtype=torch.float64), torch.randn(e, dh, dtype=torch.float64)
    w2, b2 = torch.randn(e, dh, dout, dtype=torch.float64), torch.randn(e, dout, dtype=torch.float64)
    gates = torch.rand(m, k, dtype=torch.float64)
    g = torch.randn(m, dout, dtype=torch.float64)
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w1, b1, w2, b2, gates)]
        plan = plan_dispatch(experts, e, host_sizes=False)
        assert native_grouped_mm(leaves[0], leaves[1]) == (dtype == torch.float32)
        y = matmul_combine(F.gelu(dispatch_matmul(leaves[0], leaves[1], plan, leaves[2])), leaves[3], leaves[5], plan,
                           leaves[4])
        results.append([y.double(), *(t.double() for t in torch.autograd.grad(y, leaves, g.to(dtype)))])
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_fused_ops_gradcheck():
    m, k, e = 6, 2, 3
    x = torch.randn(m, 4, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(e, 4, 3, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(e, 3, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(e, 3, 5, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(e, 5, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(m, k, dtype=torch.float64, requires_grad=True)
    plan = plan_dispatch(torch.stack([torch.randperm(e + 1)[:k] for _ in range(m)]), e)  # one no-op expert
    assert torch.autograd.gradcheck(lambda *t: dispatch_matmul(t[0], t[1], plan, t[2]), (x, w1, b1))
    rows = torch.randn(m * k, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: matmul_combine(t[0], t[1], t[3], plan, t[2]), (rows, w2, b2, gates))


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
    # the router learns only through (α·r + 1): at α = 0 (its init) its gradient is exactly zero
    assert mone.router.proj.weight.grad.abs().max() == 0
    assert mone.alpha.grad is not None and mone.alpha.grad.abs() > 0
    mone.zero_grad()
    with torch.no_grad():
        mone.alpha.fill_(0.5)
    ctx = ctx_for(2)
    ctx.mone_capacity = 0.3
    mone(x, ctx).sum().backward()
    assert mone.router.proj.weight.grad.abs().max() > 0


@pytest.mark.parametrize("bias", [True, False])
def test_nested_linear_ops_match_sliced_linear(bias):
    """Nested projections on token-major group blocks equal per-group F.linear on sliced features / weight rows
    (zero-padded), values and gradients; an empty group is allowed."""
    din, c = 8, 6
    blocks = [(0, 5, 8), (5, 5, 4), (5, 12, 2), (12, 15, 1)]  # (row start, row end, width), one empty group
    x = torch.randn(15, din, dtype=torch.float64, requires_grad=True)
    w_in = torch.randn(c, din, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(din, c, dtype=torch.float64, requires_grad=True)
    b_in = torch.randn(c, dtype=torch.float64, requires_grad=True) if bias else None
    b_out = torch.randn(din, dtype=torch.float64, requires_grad=True) if bias else None

    h = nested_linear_in(x, w_in, b_in, blocks)
    y = nested_linear_out(torch.tanh(h), w_out, b_out, blocks)
    ref_h = torch.cat([F.linear(x[s:e, :k], w_in[:, :k], b_in) for s, e, k in blocks])
    ref_y = torch.cat([F.pad(F.linear(torch.tanh(ref_h[s:e]), w_out[:k], None if b_out is None else b_out[:k]),
                             (0, din - k)) for s, e, k in blocks])
    assert torch.allclose(y, ref_y, atol=1e-12)
    inputs = [t for t in (x, w_in, b_in, w_out, b_out) if t is not None]
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, inputs, g), torch.autograd.grad(ref_y, inputs, g), strict=True):
        assert torch.allclose(a, b, atol=1e-10)
    if bias:
        def chain(*t):
            return nested_linear_out(nested_linear_in(t[0], t[1], t[2], blocks), t[3], t[4], blocks)

        assert torch.autograd.gradcheck(chain, (x, w_in, b_in, w_out, b_out))


def test_mone_blocks_pass_token_major_layout():
    """The router hands on [R, N, D] views of token-major memory; blocks accept either layout with equal results."""
    cfg = MoNEConfig(num_experts=4, capacity=0.4)
    torch.manual_seed(1)
    first = MoNEBlock(32, 4, 64, cfg, num_tasks=2, has_router=True).eval()
    second = MoNEBlock(32, 4, 64, cfg, num_tasks=2, has_router=False).eval()
    x = torch.randn(3, 10, 32)
    ctx = ForwardContext(task_ids=torch.tensor([0, 1, 0]), num_tasks=2)
    y = first(x, ctx)
    assert y.transpose(0, 1).is_contiguous()
    assert torch.allclose(second(y, ctx), second(y.contiguous(), ctx), atol=1e-6)


# ---------------------------------------------------------------------------------------------- routed-layer contract
def test_routed_layers_share_the_contract():
    """Every layer that routes is a `RoutedLayer` with its kind; the expert kinds are MoE MLP and MoE attention."""
    assert {cls.kind for cls in (MoEMlp, MoEAttention, MoDBlock, MoNERouter)} == {"moe", "moa", "mod", "mone"}
    assert all(issubclass(cls, RoutedLayer) for cls in (MoEMlp, MoEAttention, MoDBlock, MoNERouter))
    assert not issubclass(MoNEBlock, RoutedLayer)  # holds the router, reports nothing itself
    assert EXPERT_KINDS == (MoEMlp.kind, MoEAttention.kind)

    class Unnamed(RoutedLayer):
        pass

    with pytest.raises(TypeError, match="kind"):
        Unnamed()


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_router_stats_come_from_named_routed_layers(path):
    """Each `RouterStats` names a `RoutedLayer` of the model by its module path and reports that layer's kind."""
    model = squad.build_model(tiny_config(path).model).eval()
    routed = {name: m for name, m in model.named_modules() if isinstance(m, RoutedLayer)}
    assert all(m.layer_name == name for name, m in routed.items())
    with torch.no_grad():
        stats = model(torch.randn(2, 3, 32, 32)).stats
    assert sorted(s.name for s in stats) == sorted(routed)
    assert all(s.kind == routed[s.name].kind for s in stats)
    assert model.has_task_specific_layers() == (bool(routed) or model.task_embed is not None)
