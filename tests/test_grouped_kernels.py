"""The grouped-GEMM ops of the routed layers' CUDA path (squad.kernels.grouped): the PyTorch reference against a
per-row loop, the custom ops' schemas and fake kernels, the Triton kernels against the reference (in Triton's CPU
interpreter, in a subprocess: ``TRITON_INTERPRET=1`` must be set before torch is imported; it runs MoNE's kernel
tests too) on odd shapes, empty
groups, rows of no group (no-op experts, dropped slots) and tiles smaller than a group, the MoE MLP built on them
against the CPU algorithm, and the kernels compiled for sm_80/sm_90 down to a cubin (no GPU needed).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from squad.kernels import grouped as G
from squad.kernels.device import force_cuda_path, triton_available, triton_interpreting
from squad.kernels.tiles import launch_settings
from squad.layers.experts import expert_mlp, plan_dispatch
from tests.helpers import compile_triton_for_gpu

RUNNABLE = triton_available() and (torch.cuda.is_available() or triton_interpreting())
# small tiles, launched in groups of 3 row tiles (partial groups at the end)
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 3, "num_warps": 4, "num_stages": 1}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _groups(counts: list[int], device=None) -> torch.Tensor:
    """int32 group ends for ``counts`` (rows past the last end belong to no group)."""
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _problem(rows, m, k, n, counts, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = {
        "a": torch.randn(m, k, generator=g), "a_rows": torch.randint(0, m, (rows,), generator=g),
        "w": torch.randn(len(counts), k, n, generator=g), "bias": torch.randn(len(counts), n, generator=g),
        "kbias": torch.randn(len(counts), k, generator=g), "scale": torch.rand(rows, generator=g),
        "out_rows": torch.randperm(rows, generator=g), "aux": torch.randn(rows, n, generator=g),
        "b": torch.randn(m, n, generator=g), "b_rows": torch.randint(0, m, (rows,), generator=g),
    }
    t = {key: v.to(device, dtype) if v.is_floating_point() else v.to(device) for key, v in t.items()}
    return t, _groups(counts, device)


def _loop_mm(t, ends, rows, epilogue, gather, scatter, bias, scale, aux_gelu):
    """One row at a time: what ``squad::grouped_mm`` means."""
    n = t["w"].shape[2]
    out = torch.zeros(rows, n, dtype=torch.float64)
    extra = torch.zeros(rows, n if epilogue == "gelu" else 1, dtype=torch.float64)
    bounds = [0, *ends.tolist()]
    for i in range(rows):
        o = int(t["out_rows"][i]) if scatter else i
        grp = next((j for j in range(len(bounds) - 1) if bounds[j] <= i < bounds[j + 1]), None)
        if grp is None:
            continue
        a = (t["a"][int(t["a_rows"][i])] if gather else t["a"][i]).double()
        acc = a @ t["w"][grp].double()
        s = float(t["scale"][i]) if scale else 1.0
        if epilogue == "linear":
            out[o] = (acc + (t["bias"][grp].double() if bias else 0)) * s
        elif epilogue == "gelu":
            pre = acc + (t["bias"][grp].double() if bias else 0)
            out[o], extra[o] = F.gelu(pre), pre
        else:
            x = t["aux"][o].double()
            act = F.gelu(x) if aux_gelu else x
            extra[i, 0] = (acc * act).sum() + (a @ t["kbias"][grp].double() if bias else 0)
            out[o] = acc * (G.gelu_grad(x) if aux_gelu else 1) * s
    return out, extra


def _args(t, ends, rows, epilogue, gather, scatter, bias, scale, aux_gelu):
    bias_t = (t["kbias"] if epilogue == "gate_grad" else t["bias"]) if bias else None
    return (t["a"] if gather else t["a"][:rows], t["a_rows"] if gather else None, t["w"], bias_t, ends,
            t["scale"] if scale else None, t["out_rows"] if scatter else None,
            t["aux"] if epilogue == "gate_grad" else None, rows, epilogue, True, aux_gelu)


CASES = [  # (rows, tokens, K, N, group sizes): odd shapes, an empty group, rows of no group, one group with all
    (37, 41, 20, 24, [10, 0, 23]),
    (9, 9, 7, 5, [0, 0, 9]),
    (64, 70, 33, 17, [40, 24]),
    (30, 31, 16, 48, [0, 12, 0, 3]),
]
FLAGS = list(itertools.product(["linear", "gelu", "gate_grad"], [False, True], [False, True], [False, True],
                               [False, True]))  # (epilogue, gather, scatter, bias, scale)
TRITON_FLAGS = [(e, on, on, on, on) for e in ("linear", "gelu", "gate_grad") for on in (False, True)] + [
    ("linear", True, False, True, False), ("gate_grad", False, True, False, True)]  # each flag on and off


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_a_row_loop(case):
    """Every epilogue with and without gathered input rows, scattered output rows, bias and scale (float64)."""
    rows, m, k, n, counts = case
    t, ends = _problem(rows, m, k, n, counts, torch.float64)
    for epilogue, gather, scatter, bias, scale in FLAGS:
        aux_gelu = epilogue == "gate_grad" and scale
        out, extra = G.grouped_mm_reference(*_args(t, ends, rows, epilogue, gather, scatter, bias, scale, aux_gelu))
        want, want_extra = _loop_mm(t, ends, rows, epilogue, gather, scatter, bias, scale, aux_gelu)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        if epilogue == "gelu":
            torch.testing.assert_close(extra, want_extra, rtol=1e-12, atol=1e-12)
        if epilogue == "gate_grad":
            torch.testing.assert_close(extra.sum(1, keepdim=True), want_extra, rtol=1e-12, atol=1e-12)
    for gather_a, gather_b, scale, bias_grad in itertools.product([False, True], repeat=4):
        a = t["a"] if gather_a else t["a"][:rows]
        b = t["b"] if gather_b else t["b"][:rows]
        dw, db = G.grouped_wgrad_reference(a, t["a_rows"] if gather_a else None, b, t["b_rows"] if gather_b else None,
                                           t["scale"] if scale else None, ends, bias_grad, torch.float64)
        sa = a.index_select(0, t["a_rows"]) if gather_a else a
        sb = (b.index_select(0, t["b_rows"]) if gather_b else b) * (t["scale"].unsqueeze(1) if scale else 1)
        for grp, (first, end) in enumerate(zip([0, *ends.tolist()[:-1]], ends.tolist(), strict=True)):
            torch.testing.assert_close(dw[grp], sa[first:end].t() @ sb[first:end], rtol=1e-12, atol=1e-12)
            if bias_grad:
                torch.testing.assert_close(db[grp], sb[first:end].sum(0), rtol=1e-12, atol=1e-12)
        assert bias_grad or db.numel() == 0


def test_ops_pass_opcheck():
    """Schemas, fake (meta) kernels and the registered implementations of both ops agree (torch.library.opcheck)."""
    t, ends = _problem(37, 41, 20, 24, [10, 0, 23], torch.float32)
    for epilogue in ("linear", "gelu", "gate_grad"):
        torch.library.opcheck(torch.ops.squad.grouped_mm.default,
                              _args(t, ends, 37, epilogue, True, True, True, True, epilogue == "gate_grad"))
    torch.library.opcheck(torch.ops.squad.grouped_wgrad.default,
                          (t["a"], t["a_rows"], t["b"], t["b_rows"], t["scale"], ends, True, torch.float32))
    with pytest.raises(ValueError, match="epilogue"):
        G.grouped_mm(t["a"], None, t["w"], None, ends, None, None, None, 37, "relu", False, False)
    with pytest.raises(ValueError, match="ends"):
        G.grouped_mm(t["a"], None, t["w"], None, ends.long(), None, None, None, 37, "linear", False, False)


# ------------------------------------------------------------------------------ Triton (CUDA or the interpreter)
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 3e-2, "atol": 6e-2}}


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_triton_matches_reference(dtype, tiles):
    """The Triton kernels against the reference: every epilogue, each flag on and off, odd shapes, empty groups, rows
    of no group;
    small tiles cut groups into several tiles (and tiles across group ends)."""
    from squad.kernels import triton_grouped as T

    config = SMALL_TILES if tiles == "small" else None
    for rows, m, k, n, counts in CASES[:2] if tiles == "small" else CASES:
        t, ends = _problem(rows, m, k, n, counts, dtype, device=_device())
        for epilogue, gather, scatter, bias, scale in TRITON_FLAGS:
            args = _args(t, ends, rows, epilogue, gather, scatter, bias, scale, epilogue == "gate_grad" and scale)
            got = T.grouped_mm(*args, config=config)
            want = G.grouped_mm_reference(*args)
            torch.testing.assert_close(got[0].float(), want[0].float(), **TOL[dtype])
            if epilogue != "linear":  # gate_grad: per-tile partial sums (compare their totals)
                g_sum, w_sum = (got[1].float(), want[1].float()) if epilogue == "gelu" else \
                    (got[1].sum(1), want[1].sum(1))
                torch.testing.assert_close(g_sum, w_sum, **TOL[dtype])
        for gather_a, gather_b, scale in itertools.product([False, True], repeat=3):
            a = t["a"] if gather_a else t["a"][:rows]
            b = t["b"] if gather_b else t["b"][:rows]
            args = (a, t["a_rows"] if gather_a else None, b, t["b_rows"] if gather_b else None,
                    t["scale"] if scale else None, ends, True, dtype)
            got = T.grouped_wgrad(*args, config=config)
            want = G.grouped_wgrad_reference(*args)
            for x, y in zip(got, want, strict=True):
                torch.testing.assert_close(x.float(), y.float(), **TOL[dtype])


def _routes(m, k, e, noop, gen, empty=()):
    allowed = torch.tensor([i for i in range(e + noop) if i not in empty])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(m)])


MLP_CASES = [  # (tokens, k, experts, no-op experts, experts left empty, capacity drop: slots redirected to no-op)
    (29, 2, 5, 0, (1, 3), False),
    (33, 3, 4, 2, (), False),
    (40, 2, 3, 0, (), True),
    (7, 1, 6, 0, (0, 2, 5), False),
]


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
@pytest.mark.parametrize("case", MLP_CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_moe_mlp_matches_the_cpu_algorithm(case, dtype):
    """The MoE MLP on the kernel path (Triton, two launches forward, four backward) against the CPU algorithm in
    float64: output, input, weight, bias and gate gradients, with empty experts, no-op experts and dropped slots."""
    m, k, e, noop, empty, drop = case
    gen = torch.Generator().manual_seed(m)
    experts = _routes(m, k, e, noop, gen, empty)
    if drop:  # the capacity rule's outcome: some slots redirected to the no-op index e
        experts[::3, 0] = e
    d, h = 19, 23
    leaves = [torch.randn(m, d, generator=gen), torch.randn(e, d, h, generator=gen) / 4,
              torch.randn(e, h, generator=gen), torch.randn(e, h, d, generator=gen) / 4,
              torch.randn(e, d, generator=gen), torch.rand(m, k, generator=gen)]
    grad = torch.randn(m, d, generator=gen)
    results = []
    for on_kernels, dt, device in ((False, torch.float64, "cpu"), (True, dtype, _device())):
        ins = [v.to(device, dt).requires_grad_() for v in leaves]
        with force_cuda_path(on_kernels):
            plan = plan_dispatch(experts.to(device), e, host_sizes=False, noop=True)
            assert plan.sync_free == on_kernels
            y = expert_mlp(ins[0], *ins[1:5], ins[5], plan)
            results.append([y, *torch.autograd.grad(y, ins, grad.to(device, dt))])
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 4e-2, "atol": 1e-1}
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, **tol)


@pytest.mark.skipif(not triton_available() or triton_interpreting() or torch.cuda.is_available(),
                    reason="runs the Triton tests in an interpreter subprocess when there is no GPU")
@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    """The Triton tests of this file, of tests/test_nested_kernels.py (MoNE's kernels), tests/test_head_kernels.py
    (MoE attention's head-select GEMMs) and tests/test_row_kernels.py (the row ops of fused inference), in a
    subprocess started with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, f"test_{name}_kernels.py") for name in ("nested", "head", "row")]
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), *files, "-q", "-p", "no:cacheprovider", "-k",
           "test_triton_"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=os.path.dirname(here))
    report = res.stdout[-6000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    assert f"{4 + 2 * len(MLP_CASES) + 5 + 5 + 3} passed" in res.stdout, report  # ran, not skipped


GPU_COMPILE = [  # (kernel, dtype, flags, sm): every epilogue, both kernels, 16-bit and fp32 tiles, sm_80 and sm_90
    ("_grouped_mm_kernel", "bf16", {"EPILOGUE": 0}, 80),
    ("_grouped_mm_kernel", "bf16", {"EPILOGUE": 1}, 90),
    ("_grouped_mm_kernel", "bf16", {"EPILOGUE": 2}, 90),
    ("_grouped_mm_kernel", "fp32", {"EPILOGUE": 2}, 80),
    ("_grouped_mm_kernel", "fp16", {"EPILOGUE": 1}, 80),
    ("_grouped_wgrad_kernel", "bf16", {}, 90),
    ("_grouped_wgrad_kernel", "fp32", {}, 80),
]


@pytest.mark.skipif(not triton_available() or triton_interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("case", GPU_COMPILE, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-sm{c[3]}")
def test_triton_kernels_compile_for_gpu(case):
    """Lowers each kernel for an sm_80 / sm_90 GPU down to a cubin with every feature on (gathers, scatters, bias,
    scale, the epilogue), at the tiles the ops launch with for a ViT-B MoE layer: the interpreter alone proves no
    compile; shared memory fits an sm_86 block."""
    from squad.kernels import triton_grouped as T

    kernel, dtype, flags, sm = case
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if kernel == "_grouped_mm_kernel":
        cfg = G.mm_config(768, 768, torch_dtype)
        constexprs = {"GATHER": True, "SCATTER": True, "HAS_BIAS": True, "HAS_SCALE": True, "STORE_PRE": True,
                      "AUX_GELU": True, **flags}
    else:
        cfg = G.wgrad_config(768, 768, torch_dtype)
        constexprs = {"GATHER_A": True, "GATHER_B": True, "HAS_SCALE": True, "HAS_DB": True}
    cfg, options = launch_settings(cfg)
    constexprs.update(cfg, UPCAST=False, PRECISION="ieee")
    types = {"ENDS": "*i32", **dict.fromkeys(("A_ROWS", "OUT_ROWS", "B_ROWS"), "*i64"),
             **{n: f"*{dtype}" for n in ("A", "W", "BIAS", "SCALE", "OUT", "EXTRA", "AUX", "B", "DW", "DB")}}
    if constexprs.get("EPILOGUE") == 2:
        types["EXTRA"] = "*fp32"
    compiled = compile_triton_for_gpu(getattr(T, kernel), types, constexprs, options, sm)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= 99 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ops_take_triton_on_cuda_and_never_sync():
    """On CUDA both ops run the Triton kernels with no device→host synchronisation and match the reference."""
    t, ends = _problem(1000, 400, 96, 80, [300, 0, 500], torch.bfloat16, device="cuda")
    args = _args(t, ends, 1000, "gate_grad", True, True, True, True, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, extra = G.grouped_mm(*args)
        dw, db = G.grouped_wgrad(t["a"], t["a_rows"], t["b"], t["b_rows"], t["scale"], ends, True, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = G.grouped_mm_reference(*args)
    torch.testing.assert_close(out.float(), ref[0].float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(extra.sum(1), ref[1].sum(1), **TOL[torch.bfloat16])
    ref_w = G.grouped_wgrad_reference(t["a"], t["a_rows"], t["b"], t["b_rows"], t["scale"], ends, True,
                                      torch.float32)
    torch.testing.assert_close(dw.float(), ref_w[0], rtol=3e-2, atol=0.5)
    torch.testing.assert_close(db.float(), ref_w[1], rtol=3e-2, atol=0.5)


def test_tile_configs_name_their_launch_order():
    """Every GEMM kernel's tile config says its launch order (what a cost model reads to count tile loads against the
    L2, `squad.kernels.tiles`); the grouped ones say how many row tiles a group has, and the launch drops the key."""
    from squad.kernels import tiles

    dt = torch.bfloat16
    configs = {"grouped_mm": tiles.mm_config(768, 192, dt), "grouped_wgrad": tiles.wgrad_config(768, 192, dt),
               "head_select": tiles.select_config(768, 64, dt), "head_gather": tiles.gather_config(768, 64, 128, dt),
               "head_wgrad": tiles.head_wgrad_config(30732, 24, 768, 64, dt),
               "nested": tiles.nested_config(384, 1536, dt), "nested_mlp": tiles.nested_mlp_config(384, 1536, dt)}
    orders = {name: c["order"] for name, c in configs.items()}
    assert orders == {"grouped_mm": "grouped", "grouped_wgrad": "rows_looped", "head_select": "heads_inner",
                      "head_gather": "grouped", "head_wgrad": "rows_split", "nested": "rows_outer",
                      "nested_mlp": "rows_outer"}
    assert configs["grouped_mm"]["GROUP_M"] == configs["head_gather"]["GROUP_M"] == 8
    constexprs, launch = tiles.launch_settings(configs["grouped_mm"])
    assert "order" not in constexprs and "order" not in launch and launch == {"num_warps": 8, "num_stages": 3}
