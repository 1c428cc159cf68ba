"""MoE attention's head-select GEMMs (squad.kernels.heads): the reference against explicit all-head products, the
ops' schemas and fake kernels, the Triton kernels against the reference (in the interpreter subprocess of
tests/test_grouped_kernels.py, or on a GPU) on odd shapes, heads no token selected and tiles cut across rows, MoE
attention's dense form on the kernels against its CPU algorithm, one compiled graph, and the kernels compiled for
sm_80/sm_90."""

from __future__ import annotations

import pytest
import torch

from squad.config.model import MoAConfig, RouterConfig
from squad.kernels import heads as HK
from squad.kernels.device import force_cuda_path, triton_available, triton_interpreting
from squad.kernels.tiles import launch_settings
from squad.layers.context import ForwardContext
from squad.layers.experts import heads as HE
from squad.layers.experts.heads import head_slots
from squad.layers.moe_attention import MoEAttention
from squad.layers.routing import Routing
from tests.helpers import assert_compiles_for_gpu

RUNNABLE = triton_available() and (torch.cuda.is_available() or triton_interpreting())
CASES = [(37, 20, 6, 3, 16, 24), (70, 33, 5, 2, 24, 40), (9, 16, 7, 1, 8, 17)]  # (M, K, E, k, d, N)
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}  # launch groups of 2 row tiles
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 3e-2, "atol": 6e-2}}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _problem(m, kk, e, k, d, n, dtype, device="cpu", seed=0):
    """Tensors of every op, with head e - 1 selected by no token (its tiles return early)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(m)])
    t = {"a": torch.randn(m, kk, generator=g), "w": torch.randn(e, kk, d, generator=g),
         "gates": torch.rand(m, k, generator=g), "c": torch.randn(m, k, d, generator=g),
         "wo": torch.randn(e, d, n, generator=g), "a2": torch.randn(m, 7, generator=g),
         "w2": torch.randn(7, n, generator=g), "bias": torch.randn(n, generator=g), "b": torch.randn(m, n, generator=g)}
    t = {key: v.to(device, dtype) for key, v in t.items()}
    t["gates"] = t["gates"].float()  # the routers' gates are float32
    t["c"] = t["c"].transpose(0, 1).contiguous().transpose(0, 1)  # [M, k, d] slot-major in memory: any strides
    return t, experts.to(device), head_slots(experts.to(device), e)


def test_head_slots_name_each_selected_head_once():
    experts = torch.tensor([[2, 0], [1, 3], [3, 2]])
    assert head_slots(experts, 5).tolist() == [[1, -1, 0, -1, -1], [-1, 0, -1, 1, -1], [-1, -1, 1, 0, -1]]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_equals_explicit_all_head_products(case):
    """In float64: the selected heads of ``a @ [w_1 … w_E]`` (gated, with the gates' gradient), the GEMM over the
    zero-padded [M, E·d] buffer of (gated) heads, and the weight gradients through it."""
    m, kk, e, k, d, n = case
    t, experts, slots = _problem(*case, torch.float64)
    every = torch.einsum("mk,ekd->med", t["a"], t["w"])  # [M, E, d]
    picked = every[torch.arange(m).unsqueeze(1), experts]  # [M, k, d]
    out, gate_grad = HK.head_select_reference(t["a"], t["w"], slots, k, None, None)
    torch.testing.assert_close(out, picked, rtol=1e-12, atol=1e-12)
    assert gate_grad.numel() == 0
    out, gate_grad = HK.head_select_reference(t["a"], t["w"], slots, k, t["gates"], t["c"])
    torch.testing.assert_close(out, picked * t["gates"].double().unsqueeze(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gate_grad, (picked * t["c"]).sum(-1), rtol=1e-12, atol=1e-12)
    for gates in (None, t["gates"]):
        buffer = torch.zeros(m, e, d, dtype=torch.float64)
        rows = t["c"] if gates is None else t["c"] * gates.double().unsqueeze(-1)
        buffer[torch.arange(m).unsqueeze(1), experts] = rows
        want = buffer.view(m, e * d) @ t["wo"].view(e * d, n) + t["a2"] @ t["w2"] + t["bias"]
        got = HK.head_gather_reference(t["c"], slots, gates, t["wo"], t["a2"], t["w2"], t["bias"])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        dw, db = HK.head_wgrad_reference(t["c"], slots, gates, t["b"], False, True, torch.float64)
        torch.testing.assert_close(dw, (buffer.view(m, e * d).t() @ t["b"]).view(e, d, n), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(db, t["b"].sum(0), rtol=1e-12, atol=1e-12)
        dwt, none = HK.head_wgrad_reference(t["c"], slots, gates, t["b"], True, False, torch.float64)
        torch.testing.assert_close(dwt, dw.transpose(1, 2), rtol=1e-12, atol=1e-12)
        assert none.numel() == 0


def test_ops_pass_opcheck_and_reject_bad_input():
    """Schemas, fake (meta) kernels and the registered implementations agree (torch.library.opcheck); a bad slot map
    or an aux without gates is named."""
    t, _, slots = _problem(*CASES[0], torch.float32)
    k = CASES[0][3]
    ops = torch.ops.squad
    torch.library.opcheck(ops.head_select_mm.default, (t["a"], t["w"], slots, k, None, None))
    torch.library.opcheck(ops.head_select_mm.default, (t["a"], t["w"], slots, k, t["gates"], t["c"]))
    torch.library.opcheck(ops.head_gather_mm.default, (t["c"], slots, t["gates"], t["wo"], t["a2"], t["w2"],
                                                       t["bias"]))
    torch.library.opcheck(ops.head_wgrad.default, (t["c"], slots, t["gates"], t["b"], 6, True, True, torch.float32))
    with pytest.raises(ValueError, match="slots must be int32"):
        HK.head_select_mm(t["a"], t["w"], slots.long(), k, None, None)
    with pytest.raises(ValueError, match="gates and aux"):
        HK.head_select_mm(t["a"], t["w"], slots, k, t["gates"], None)
    with pytest.raises(ValueError, match="a2"):
        HK.head_gather_mm(t["c"], slots, None, t["wo"], t["a2"], None, None)


# ------------------------------------------------------------------------------ Triton (CUDA or the interpreter)
@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_head_kernels_match_reference(dtype):
    """All three kernels against the reference, gated and not, with and without the second operand, the bias and the
    transposed gradient; the default tiles and small ones that cut the rows into several tiles."""
    from squad.kernels import triton_heads as T

    for case in CASES:
        m, kk, e, k, d, n = case
        t, _, slots = _problem(*case, dtype, device=_device())
        for small in (False, True):
            cfgs = [HK.select_config(kk, d, dtype), HK.gather_config(n, d, 7, dtype),
                    HK.wgrad_config(m, e, n, d, dtype)]
            if small:
                cfgs = [{**c, **{key: v for key, v in SMALL.items() if key in c}} for c in cfgs]
            for gated in (False, True):
                g, aux = (t["gates"], t["c"]) if gated else (None, None)
                got = T.head_select_mm(t["a"], t["w"], slots, k, g, aux, cfgs[0])
                want = HK.head_select_reference(t["a"], t["w"], slots, k, g, aux)
                torch.testing.assert_close(got[0].float(), want[0].float(), **TOL[dtype])
                if gated:
                    torch.testing.assert_close(got[1], want[1].float(), **TOL[dtype])
                extra = (t["a2"], t["w2"], t["bias"]) if gated else (None, None, None)
                got = T.head_gather_mm(t["c"], slots, g, t["wo"], *extra, cfgs[1])
                want = HK.head_gather_reference(t["c"], slots, g, t["wo"], *extra)
                torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
                got = T.head_wgrad(t["c"], slots, g, t["b"], e, gated, gated, dtype, cfgs[2])
                want = HK.head_wgrad_reference(t["c"], slots, g, t["b"], gated, gated, dtype)
                for x, y in zip(got, want, strict=True):
                    torch.testing.assert_close(x.float(), y.float(), **TOL[dtype])


def test_wgrad_splits_fill_several_waves_and_cut_whole_row_tiles():
    """The split count of `squad.kernels.tiles` for the weight gradient: modsquad_vit_b's (30,732 rows, 24 heads, 6 N
    tiles in bf16) takes several waves of 132 SMs where one program per output tile took 144 programs; a small problem
    keeps one chunk; chunks are whole row tiles, none empty, the last one short."""
    from squad.kernels import tiles

    cfg = tiles.head_wgrad_config(12 * 13 * 197, 24, 768, 64, torch.bfloat16)
    programs = 24 * (768 // cfg["BLOCK_N"]) * cfg["splits"]
    assert cfg["order"] == "rows_split" and programs >= 4 * tiles.WAVE_SMS, (cfg, programs)
    assert tiles.head_wgrad_config(37, 6, 24, 16, torch.float32)["splits"] == 1
    assert tiles.split_rows(37, 16, 2) == (32, 2)  # 32 + 5 rows
    assert tiles.split_rows(37, 16, 8) == (16, 3)  # never more chunks than row tiles
    assert tiles.split_rows(64, 16, 3) == (32, 2)  # 4 tiles in chunks of 2: no empty third chunk
    assert tiles.split_rows(0, 16, 4) == (16, 1)
    assert "splits" not in tiles.launch_settings(cfg)[1]


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
def test_triton_head_wgrad_split_rows_match_reference():
    """The weight gradient split over row chunks (1, 2, 3 and more chunks asked than row tiles; rows not a multiple
    of a chunk), gated with the bias gradient and transposed, or neither: equal to the reference, the head no token
    selected exactly zero, and the same bits on a second run (the partials are summed in chunk order)."""
    from squad.kernels import triton_heads as T

    for case in CASES[:2]:
        m, _, e, k, d, n = case
        t, _, slots = _problem(*case, torch.float32, device=_device())
        base = {**HK.wgrad_config(m, e, n, d, torch.float32), "BLOCK_M": 16, "BLOCK_N": 16}
        for splits, gated in ((1, True), (2, True), (3, False), (8, True)):
            g = t["gates"] if gated else None
            cfg = {**base, "splits": splits}
            got = T.head_wgrad(t["c"], slots, g, t["b"], e, gated, gated, torch.float32, cfg)
            want = HK.head_wgrad_reference(t["c"], slots, g, t["b"], gated, gated, torch.float32)
            for x, y in zip(got, want, strict=True):
                torch.testing.assert_close(x, y, **TOL[torch.float32])
            assert not got[0][e - 1].any()  # head e - 1: no rows
            if splits == 2:
                again = T.head_wgrad(t["c"], slots, g, t["b"], e, gated, gated, torch.float32, cfg)
                assert all(torch.equal(x, y) for x, y in zip(got, again, strict=True))
    t, _, slots = _problem(*CASES[0], torch.bfloat16, device=_device())  # 16-bit results from float32 partials
    cfg = {**HK.wgrad_config(37, 6, 24, 16, torch.bfloat16), "BLOCK_M": 16, "splits": 3}
    got = T.head_wgrad(t["c"], slots, t["gates"], t["b"], 6, False, True, torch.bfloat16, cfg)
    want = HK.head_wgrad_reference(t["c"], slots, t["gates"], t["b"], False, True, torch.bfloat16)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x.float(), y.float(), **TOL[torch.bfloat16])


def _moa(dtype):
    torch.manual_seed(0)
    cfg = MoAConfig(num_experts=6, top_k=3, head_dim=8, router=RouterConfig(noise=False))
    return MoEAttention(12, cfg, num_tasks=2).to(dtype)


def _ctx():
    return ForwardContext(task_ids=torch.tensor([0, 0, 1]), num_tasks=2, segments=[(0, 0, 2), (1, 2, 3)])


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_moe_attention_dense_form_matches_the_cpu_algorithm(dtype, monkeypatch):
    """MoE attention's dense all-head form on the Triton kernels against the CPU algorithm (routed) in float32 (the
    attention's widest type), on one routing decision (bf16 logits could break a near tie): output and every
    gradient (input, query and output weights, key/value head, bias, gates)."""
    x0 = torch.randn(3, 11, 12)
    with torch.no_grad():
        decided = _moa(torch.float32).router(x0, _ctx())
    results = []
    for on_kernels, dt, device in ((False, torch.float32, "cpu"), (True, dtype, _device())):
        monkeypatch.setattr(MoEAttention, "projections", lambda self, *a, f=on_kernels: "heads" if f else "routed")
        layer = _moa(dt).to(device)
        gates = decided.gates.to(device).requires_grad_()
        routing = Routing(gates, decided.experts.to(device), decided.probs.to(device))
        layer.router.forward = lambda *a, r=routing: r
        x = x0.to(device, dt).requires_grad_()
        leaves = [x, layer.q, layer.kv.weight, layer.kv.bias, layer.o, layer.proj_bias, gates]
        with force_cuda_path(on_kernels):
            y = layer(x, _ctx())
            weights = torch.linspace(-1, 1, y.numel(), dtype=dt, device=device).view_as(y)
            results.append([y, *torch.autograd.grad(y, leaves, weights)])
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 1e-1}
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.double().cpu(), want.double(), **tol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cublas_ops_match_explicit_per_head_products_in_float64(case):
    """`library_query_kv` / `library_gated_output` (``model.moa.kernel: cublas``: all-head GEMMs and gathers) against
    the per-head products written out with autograd, in float64, on odd shapes with a head no token selected: both
    outputs and every gradient."""
    m, kk, e, k, d, _ = case
    t, experts, _ = _problem(m, kk, e, k, d, kk, torch.float64)
    index = HE.HeadIndex.of(experts, e)
    x, wq, wo = t["a"].requires_grad_(), t["w"].requires_grad_(), t["wo"][:, :, :kk].contiguous().requires_grad_()
    wkv, bkv = torch.randn(2 * d, kk, dtype=torch.float64, requires_grad=True), torch.randn(2 * d, dtype=torch.float64,
                                                                                            requires_grad=True)
    gates, bias = t["gates"].double().requires_grad_(), torch.randn(kk, dtype=torch.float64, requires_grad=True)
    o = torch.randn(m, k, d, dtype=torch.float64, requires_grad=True)
    leaves = [x, wq, wkv, bkv, o, wo, gates, bias]
    dq, dkv, dy = torch.randn(m, k, d, dtype=torch.float64), torch.randn(m, 2 * d, dtype=torch.float64), torch.randn(
        m, kk, dtype=torch.float64)

    def run(q, kv, y):
        return [q, kv, y, *torch.autograd.grad([q, kv, y], leaves, [dq, dkv, dy])]

    q, kv = HE.library_query_kv(x, wq, wkv, bkv, index)
    got = run(q, kv, HE.library_gated_output(o, wo, gates, bias, index))
    q_ref = torch.einsum("mc,mjcd->mjd", x, wq[experts])
    y_ref = torch.einsum("mj,mjd,mjdn->mn", gates, o, wo[experts]) + bias
    want = run(q_ref, x @ wkv.t() + bkv, y_ref)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert not got[4][e - 1].any() and not got[8][e - 1].any()  # head e - 1: no weight gradient


def test_cublas_form_matches_the_cpu_algorithm(monkeypatch):
    """MoE attention with ``model.moa.kernel: cublas`` on the CUDA path (forced; the form runs on any device) against
    the CPU algorithm (routed) in float32, on one routing decision: output and every gradient."""
    x0 = torch.randn(3, 11, 12)
    with torch.no_grad():
        decided = _moa(torch.float32).router(x0, _ctx())
    results = []
    for form in ("routed", "cublas"):
        monkeypatch.setattr(MoEAttention, "projections", lambda self, *a, f=form: f)
        layer = _moa(torch.float32)
        gates = decided.gates.detach().clone().requires_grad_()
        routing = Routing(gates, decided.experts, decided.probs)
        layer.router.forward = lambda *a, r=routing: r
        x = x0.clone().requires_grad_()
        leaves = [x, layer.q, layer.kv.weight, layer.kv.bias, layer.o, layer.proj_bias, gates]
        with force_cuda_path(form != "routed"):
            y = layer(x, _ctx())
            weights = torch.linspace(-1, 1, y.numel()).view_as(y)
            results.append([y, *torch.autograd.grad(y, leaves, weights)])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cublas_ops_never_add_by_index():
    """The ``cublas`` backend's ops move rows by gathers and copies to distinct rows only (no ``index_add``, no
    accumulating ``index_put``, no scatter-add: no atomics on a GPU, deterministic) and never read the device on the
    host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    m, kk, e, k, d, _ = CASES[0]
    t, experts, _ = _problem(m, kk, e, k, d, kk, torch.float32)
    x, wq, wo = t["a"].requires_grad_(), t["w"].requires_grad_(), t["wo"][:, :, :kk].contiguous().requires_grad_()
    o, gates = torch.randn(m, k, d, requires_grad=True), t["gates"].requires_grad_()
    wkv, bias = torch.randn(2 * d, kk, requires_grad=True), torch.randn(kk, requires_grad=True)
    with Ops():
        index = HE.HeadIndex.of(experts, e)
        q, kv = HE.library_query_kv(x, wq, wkv, None, index)
        y = HE.library_gated_output(o, wo, gates, bias, index)
        (q.sum() + kv.sum() + y.square().sum()).backward()
    assert not [op for op in seen if "index_add" in op or "index_put" in op or "scatter" in op], seen
    assert not [op for op in seen if "_local_scalar_dense" in op or "nonzero" in op], seen
    assert sum("index_select" in op for op in seen) == 2  # q forward, dsel backward
    assert sum("index_copy" in op for op in seen) == 3  # V forward; dQ and V again backward
    assert all(p.grad is not None for p in (x, wq, wo, o, gates, wkv, bias))


@pytest.mark.parametrize("form", ["heads", "cublas"])
def test_dense_form_compiles_in_one_graph(form, monkeypatch):
    """The dense form (either backend) on the CUDA path (forced) under ``torch.compile(fullgraph=True)``: one graph,
    eager's output and gradients (the head ops are opaque nodes, the gathers plain ones: nothing reads the
    device)."""
    monkeypatch.setattr(MoEAttention, "projections", lambda self, *a, f=form: f)
    layer = _moa(torch.float32)
    x = torch.randn(3, 11, 12, requires_grad=True)

    def step(fn):
        y = fn(x, _ctx())
        return [y, *torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])]

    torch._dynamo.reset()
    with force_cuda_path():
        want = step(layer)
        got = step(torch.compile(layer, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


GPU_COMPILE = [("_head_select_kernel", "bf16", {"GATED": True}, 90),
               ("_head_select_kernel", "fp32", {"GATED": True}, 80),
               ("_head_gather_kernel", "bf16", {}, 80), ("_head_gather_kernel", "bf16", {}, 90),
               ("_head_gather_kernel", "fp32", {}, 80), ("_head_wgrad_kernel", "bf16", {}, 90),
               ("_head_wgrad_kernel", "bf16", {"partials": True}, 90), ("_head_wgrad_kernel", "fp32", {}, 80),
               ("_split_sum_kernel", "bf16", {}, 90), ("_split_sum_kernel", "fp32", {}, 80)]


@pytest.mark.skipif(not triton_available() or triton_interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("case", GPU_COMPILE, ids=lambda c: "-".join([c[0], c[1], *c[2].keys() - {"GATED"},
                                                                       f"sm{c[3]}"]))
def test_triton_head_kernels_compile_for_gpu(case):
    """Each kernel lowered for sm_80 / sm_90 down to a cubin with every feature on, at modsquad_vit_b's MoE attention
    (E 24, d 64, D 768); shared memory fits an sm_86 block."""
    from squad.kernels import triton_heads as T

    kernel, dtype, flags, sm = case
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    cfg = {"_head_select_kernel": HK.select_config(768, 64, torch_dtype),
           "_head_gather_kernel": HK.gather_config(768, 64, 128, torch_dtype),
           "_head_wgrad_kernel": HK.wgrad_config(12 * 13 * 197, 24, 768, 64, torch_dtype),
           "_split_sum_kernel": {"BLOCK": T.SUM_BLOCK, "num_warps": 4}}[kernel]
    cfg, options = launch_settings(cfg)
    constexprs = {"GATED": True, "HAS_A2": True, "HAS_BIAS": True, "HAS_DB": True, "HAS_SECOND": True,
                  "UPCAST": False, "PRECISION": "ieee", **flags, **cfg}
    constexprs = {name: v for name, v in constexprs.items() if name in getattr(T, kernel).__code__.co_varnames}
    types = {"SLOTS": "*i32", "GATES": "*fp32", "GATE_GRAD": "*fp32", "P": "*fp32", "P2": "*fp32",
             **{n: f"*{dtype}" for n in ("A", "W", "AUX", "OUT", "OUT2", "C", "A2", "W2", "BIAS", "B", "DW", "DB")}}
    if flags.get("partials"):  # a split launch writes float32 partials
        types.update(DW="*fp32", DB="*fp32")
    assert_compiles_for_gpu(getattr(T, kernel), types, constexprs, options, sm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_head_ops_take_triton_on_cuda_and_never_sync():
    """On CUDA the three ops run their Triton kernels with no device→host synchronisation and match the reference at
    modsquad_vit_b's head shapes."""
    m, e, k, d, dim = 6000, 24, 12, 64, 768  # the weight gradient in 2 row chunks
    t, _, slots = _problem(m, dim, e, k, d, dim, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q, dg = HK.head_select_mm(t["a"], t["w"], slots, k, t["gates"], t["c"])
        y = HK.head_gather_mm(t["c"], slots, t["gates"], t["wo"], None, None, t["bias"])
        dw, db = HK.head_wgrad(t["c"], slots, t["gates"], t["b"], e, False, True, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = HK.head_select_reference(t["a"], t["w"], slots, k, t["gates"], t["c"])
    torch.testing.assert_close(q.float(), ref[0].float(), rtol=3e-2, atol=0.5)
    torch.testing.assert_close(dg, ref[1], rtol=3e-2, atol=2.0)
    ref_y = HK.head_gather_reference(t["c"], slots, t["gates"], t["wo"], None, None, t["bias"])
    torch.testing.assert_close(y.float(), ref_y.float(), rtol=3e-2, atol=0.5)
    ref_w = HK.head_wgrad_reference(t["c"], slots, t["gates"], t["b"], False, True, torch.float32)
    torch.testing.assert_close(dw.float(), ref_w[0], rtol=3e-2, atol=2.0)
    torch.testing.assert_close(db.float(), ref_w[1], rtol=3e-2, atol=2.0)
