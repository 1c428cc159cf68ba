"""Tests of squad.kernels.routed_attention: reference and Triton paths against an explicit softmax(QKᵀ)V.

The Triton tests need CUDA or Triton's CPU interpreter. Triton picks interpreter or compiler when it is first
imported, and `import torch` imports it, so TRITON_INTERPRET=1 cannot be switched on inside this process:
`test_triton_kernels_in_interpreter` re-runs this file's Triton tests in a subprocess started with TRITON_INTERPRET=1
(the interpreter is ~100× slower than eager PyTorch, hence a spread subset of shapes there and the full cross product
for the reference path). `test_triton_kernels_compile_for_gpu` compiles every kernel for an sm_80 target (down to a
cubin, with the bundled ptxas) to show they are not only interpretable.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from squad.kernels import explicit_attention, routed_attention, triton_available
from squad.kernels.reference import attention_backward_chunked, attention_forward_chunked, gather_rows

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {  # (out/grad tolerances, score tolerances)
    F32: ({"atol": 2e-5, "rtol": 1e-4}, {"atol": 1e-6, "rtol": 1e-4}),
    F16: ({"atol": 4e-3, "rtol": 1e-2}, {"atol": 2e-4, "rtol": 1e-2}),
    BF16: ({"atol": 3e-2, "rtol": 3e-2}, {"atol": 2e-3, "rtol": 3e-2}),
}
HEADS = [(1, 1), (3, 1), (3, 3), (6, 1), (6, 6)]  # (Hq, Hkv)
SELECT = [None, "one", "half", "all"]  # token_index: none, K = 1, K = N // 2, K = N


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tensors are small: one intra-op thread is about as fast, and does not stall waiting for a descheduled
    second thread when other processes share the cores (restored afterwards for the rest of the session)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _interpreting() -> bool:
    if not triton_available():
        return False
    from squad.kernels.triton_attention import interpreter_enabled
    return interpreter_enabled()


TRITON_RUNNABLE = triton_available() and (torch.cuda.is_available() or _interpreting())


def _inputs(b, hq, hkv, n, d, dtype, select, layout="contiguous", seed=0, device=None):
    """q, k, v (requires_grad) and an optional token index [B, K] of distinct rows in random order."""
    device = device or _device()
    gen = torch.Generator().manual_seed(seed)
    if layout == "timm":  # q, k, v as views of one (B, N, 3, H, d) projection, as in timm's Attention
        assert hq == hkv
        q, k, v = torch.randn(b, n, 3, hq, d, generator=gen).to(device, dtype).permute(2, 0, 3, 1, 4)
    else:
        q = torch.randn(b, hq, n, d, generator=gen).to(device, dtype)
        k = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
        v = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if select is None:
        return q, k, v, None
    kk = {"one": 1, "half": max(1, n // 2), "all": n}[select]
    index = torch.stack([torch.randperm(n, generator=gen)[:kk] for _ in range(b)]).to(device)
    return q, k, v, index


def _run(q, k, v, index, backend, grad_out=None, return_scores=True):
    """Output, scores and input gradients of one call (scores None without return_scores)."""
    res = routed_attention(q, k, v, token_index=index, return_scores=return_scores, backend=backend)
    out, scores = res if return_scores else (res, None)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out, scores, grads, grad_out


def _explicit(q, k, v, index, grad_out):
    """The N×N definition in float32 on float32 copies of the inputs."""
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    out, scores = explicit_attention(qf, kf, vf, token_index=index)
    grads = torch.autograd.grad(out, (qf, kf, vf), grad_out.float())
    return out, scores, grads


def _assert_matches(got, want, dtype, what):
    tol, score_tol = TOL[dtype]
    out, scores, grads = got
    w_out, w_scores, w_grads = want
    torch.testing.assert_close(out.float(), w_out.float(), **tol, msg=lambda m: f"{what} output: {m}")
    if scores is not None:
        assert scores.dtype == torch.float32 and not scores.requires_grad
        torch.testing.assert_close(scores, w_scores.float(), **score_tol, msg=lambda m: f"{what} scores: {m}")
        ones = torch.ones(scores.shape[0], device=scores.device)
        torch.testing.assert_close(scores.sum(-1), ones, atol=1e-4, rtol=0)  # each query row's probabilities sum to 1
    for name, g, w in zip("qkv", grads, w_grads, strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m, name=name: f"{what} d{name}: {m}")


# --------------------------------------------------------------------------- reference path (full cross product)

@pytest.mark.parametrize("select", SELECT)
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"hq{a}-hkv{b}" for a, b in HEADS])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("n", [1, 17, 50, 197, 257])
def test_reference_matches_explicit(n, d, heads, dtype, select):
    q, k, v, index = _inputs(2, *heads, n, d, dtype, select, device="cpu")
    out, scores, grads, grad_out = _run(q, k, v, index, "reference")
    m = n if index is None else index.shape[1]
    assert out.shape == (2, heads[0], m, d) and out.dtype == dtype and scores.shape == (2, m)
    want = _explicit(q, k, v, index, grad_out)
    _assert_matches((out, scores, grads), want, dtype, "reference+scores")
    out2, _, grads2, _ = _run(q, k, v, index, "reference", grad_out, return_scores=False)  # the SDPA path
    _assert_matches((out2, None, grads2), want, dtype, "reference")
    if index is not None:  # rows that were not selected get no gradient
        for row in range(2):
            unselected = torch.ones(n, dtype=torch.bool)
            unselected[index[row]] = False
            assert all(g[row][:, unselected].abs().sum() == 0 for g in grads)


@pytest.mark.parametrize("select", SELECT)
def test_reference_bf16_matches_explicit(select):
    q, k, v, index = _inputs(2, 6, 1, 50, 64, BF16, select, device="cpu")
    out, scores, grads, grad_out = _run(q, k, v, index, "reference")
    want = _explicit(q, k, v, index, grad_out)
    _assert_matches((out, scores, grads), want, BF16, "reference+scores bf16")
    out2, _, grads2, _ = _run(q, k, v, index, "reference", grad_out, return_scores=False)
    _assert_matches((out2, None, grads2), want, BF16, "reference bf16")


@pytest.mark.parametrize("chunk_elements", [1, 600, 10_000])
@pytest.mark.parametrize("shape", [(2, 6, 1, 50, 32), (1, 3, 3, 257, 64), (3, 1, 1, 17, 32)])
def test_chunked_passes_match_explicit(shape, chunk_elements):
    """Several heads per chunk, one head split into row blocks, one row block: all equal the N×N definition."""
    b, hq, hkv, n, d = shape
    q, k, v, _ = _inputs(b, hq, hkv, n, d, F32, None, device="cpu")
    grad_out = torch.randn(b, hq, n, d)
    want = _explicit(q, k, v, None, grad_out)
    with torch.no_grad():
        out, lse, scores = attention_forward_chunked(q, k, v, d ** -0.5, chunk_elements=chunk_elements)
        grads = attention_backward_chunked(grad_out, q, k, v, out, lse, d ** -0.5, chunk_elements=chunk_elements)
        s = (q @ k.repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * d ** -0.5
    torch.testing.assert_close(lse, s.logsumexp(-1), atol=1e-5, rtol=1e-5)
    _assert_matches((out, scores, grads), want, F32, f"chunked({chunk_elements})")


def test_auto_is_reference_on_cpu_and_scale_is_used():
    q, k, v, index = _inputs(2, 6, 1, 50, 32, F32, "half", device="cpu")
    a = routed_attention(q, k, v, token_index=index, return_scores=True, scale=0.3)
    r = routed_attention(q, k, v, token_index=index, return_scores=True, scale=0.3, backend="reference")
    e = explicit_attention(q, k, v, scale=0.3, token_index=index)
    for x, y, z in zip(a, r, e, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x, z, atol=2e-5, rtol=1e-4)
    plain = routed_attention(q, k, v)
    assert isinstance(plain, torch.Tensor) and plain.shape == q.shape


@pytest.mark.parametrize("is_cuda,d,scores,subset,want", [
    (True, 64, False, False, "reference"),  # dense attention on a GPU: SDPA (flash / cuDNN), never Triton
    (True, 64, True, False, "triton"),  # A-MoD scores: only the Triton kernel gives them in one pass
    (True, 64, False, True, "triton"),  # a routed token subset, read in place
    (True, 256, True, True, "reference"),  # past Triton's head dims
    (False, 64, True, True, "reference"),  # the CPU
])
def test_auto_backend_leaves_dense_cuda_attention_to_sdpa(is_cuda, d, scores, subset, want):
    from squad.kernels.op import auto_backend

    want = want if triton_available() else "reference"
    assert auto_backend(is_cuda, d, scores, subset) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_runs_sdpa_without_scores_and_triton_with_them(monkeypatch):
    import squad.kernels.op as op

    calls = []
    sdpa = op.F.scaled_dot_product_attention
    monkeypatch.setattr(op.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    q, k, v, index = _inputs(2, 6, 6, 197, 64, BF16, "half", device="cuda")
    out = routed_attention(q, k, v)
    assert calls == [1]
    torch.testing.assert_close(out, sdpa(q, k, v), atol=0, rtol=0)
    routed_attention(q, k, v, return_scores=True)
    routed_attention(q, k, v, token_index=index)
    assert calls == [1]  # the Triton op served both
    q, k, v, _ = _inputs(2, 6, 1, 197, 64, F32, None, device="cuda")  # fp32 multi-query: k, v expanded for SDPA
    torch.testing.assert_close(routed_attention(q, k, v), _explicit(q, k, v, None, torch.zeros_like(q))[0],
                               **TOL[F32][0])


def test_chunked_ops_pass_opcheck():
    """`squad::chunked_attention` and its backward: schema, fake (meta) implementation, autograd registration and
    AOT dispatch agree with the real kernels (torch.library.opcheck)."""
    from torch.library import opcheck

    for hq, hkv in ((4, 2), (3, 3)):  # grouped and plain heads: the CPU backward's gradients differ in strides
        q, k, v, _ = _inputs(2, hq, hkv, 9, 8, F32, None, device="cpu")
        for need_lse in (True, False):
            args = (q, k, v, 0.3, True) if need_lse else (q.detach(), k.detach(), v.detach(), 0.3, False)
            opcheck(torch.ops.squad.chunked_attention.default, args)
        out, lse, _ = torch.ops.squad.chunked_attention(q, k, v, 0.3, True)
        opcheck(torch.ops.squad.chunked_attention_backward.default,
                (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.3))


def _attention_loss(q, k, v, index, backend):
    """Output and scores of one call folded into a scalar (what a compiled training step differentiates)."""
    out, scores = routed_attention(q, k, v, token_index=index, return_scores=True, backend=backend)
    plain = routed_attention(q, k, v, token_index=index, backend=backend)
    w = torch.linspace(-1, 1, out.shape[-2], device=out.device)  # weigh rows differently: real gradients
    return ((out.float() + plain.float()).sum(-1) * w).sum() + scores.sum(), scores


def _check_compiled_matches_eager(backend, compile_backend, dtype=F32):
    q, k, v, index = _inputs(2, 4, 2, 33, 16, dtype, "half")
    compiled = torch.compile(_attention_loss, backend=compile_backend, fullgraph=True)  # fullgraph: no graph break
    for idx in (None, index):
        loss, scores = compiled(q, k, v, idx, backend)
        grads = torch.autograd.grad(loss, (q, k, v))
        want_loss, want_scores = _attention_loss(q, k, v, idx, backend)
        want = torch.autograd.grad(want_loss, (q, k, v))
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(scores, want_scores)
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g, w)


def test_reference_compiles_in_one_graph():
    """torch.compile takes the reference backend whole (the chunked op is one opaque node; SDPA, gathers native):
    the same loss, scores and gradients as eager, with and without a token subset."""
    torch._dynamo.reset()
    _check_compiled_matches_eager("reference", "aot_eager")


def _peak_bytes(fn) -> int:
    from squad.kernels.bench import peak_cpu_bytes
    return peak_cpu_bytes(fn)


def test_reference_memory_is_linear_in_n():
    """Peak allocation of the reference with scores (forward, and forward + backward) grows linearly with N and at
    N = 4096 stays far below one N×N map; the measurement does see the map of the explicit computation."""
    peaks = {}
    for n in (2048, 4096):
        q, k, v, _ = _inputs(1, 4, 4, n, 16, F32, None, device="cpu")

        def fwd_bwd(q=q, k=k, v=v):
            out, _ = routed_attention(q, k, v, return_scores=True, backend="reference")
            out.sum().backward()

        with torch.no_grad():
            fwd = _peak_bytes(lambda q=q, k=k, v=v: routed_attention(q, k, v, return_scores=True, backend="reference"))
        peaks[n] = (fwd, _peak_bytes(fwd_bwd))
    nxn = 4 * 4096 * 4096 * 4  # one float32 map per head
    with torch.no_grad():
        assert _peak_bytes(lambda: explicit_attention(q, k, v)) >= nxn
    for i in range(2):
        assert 0 < peaks[4096][i] < nxn / 10, (peaks, nxn)
        assert peaks[4096][i] < 2.5 * peaks[2048][i], peaks  # an N×N term would quadruple it


def test_device_bench_rows_dry_run():
    """`tools/bench.py`'s accelerator rows for routed attention, dry-run on the CPU at toy sizes (no timing checks):
    the cases, their contracts, and the device and shapes in every row's details."""
    from squad.kernels.bench import bench_device

    rows = bench_device("cpu", quick=True, tokens=(17, 1024), batch=1, heads=2, head_dim=16, dtype=F32)
    by_case = {r.case: r for r in rows}
    assert len(by_case) == len(rows) == 8
    assert by_case["attention_scores_fwd_n17_vs_sdpa"].target == "<= 1.3"
    assert by_case["attention_scores_fwd_n1024_vs_sdpa"].target == "<= 1.15"
    assert {"attention_fwd_bwd_n17_vs_sdpa", "attention_scores_fwd_bwd_n1024_vs_sdpa",
            "attention_subset_fwd_bwd_n1024_vs_gather_sdpa"} <= set(by_case)
    for r in rows:
        assert r.value > 0 and r.details["device"] == "cpu" and r.details["dtype"] == "float32"
        assert r.details["candidate_s"] > 0 and r.details["baseline_s"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_rows_name_the_gpu():
    from squad.kernels.bench import bench_routed_attention

    rows = bench_routed_attention(quick=True)  # the GPU rows by default when CUDA is present
    assert {r.details["device"] for r in rows} == {torch.cuda.get_device_name()}
    assert any(r.case == "triton_attention_fwd_n4096_vs_sdpa" for r in rows)
    assert all(r.details["timing"] == "CUDA events" and r.details["dtype"] == "bfloat16" for r in rows)


# --------------------------------------------------------------------------- errors

def _bad_calls():
    q, k, v = torch.randn(2, 6, 10, 8), torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    k4 = torch.randn(2, 4, 10, 8)
    idx = torch.tensor([[0, 3], [9, 1]])
    return [
        ("dtype float64", lambda: routed_attention(q.double(), k.double(), v.double()), TypeError, "dtype"),
        ("mixed dtypes", lambda: routed_attention(q.half(), k, v), TypeError, "one dtype"),
        ("3-D q", lambda: routed_attention(q[0], k, v), ValueError, "4-D"),
        ("not a tensor", lambda: routed_attention(q.numpy(), k, v), TypeError, "torch.Tensor"),
        ("k/v shapes", lambda: routed_attention(q, k, v[:, :, :5]), ValueError, "k and v"),
        ("batch", lambda: routed_attention(q[:1], k, v), ValueError, "agree"),
        ("tokens", lambda: routed_attention(q[:, :, :5], k, v), ValueError, "agree"),
        ("head dim", lambda: routed_attention(q[..., :4], k, v), ValueError, "agree"),
        ("heads", lambda: routed_attention(q, k4, k4), ValueError, "divide"),
        ("device", lambda: routed_attention(q, k.to("meta"), v.to("meta")), ValueError, "device"),
        ("index dtype", lambda: routed_attention(q, k, v, token_index=idx.int()), TypeError, "int64"),
        ("index dims", lambda: routed_attention(q, k, v, token_index=idx[0]), ValueError, "token_index"),
        ("index batch", lambda: routed_attention(q, k, v, token_index=idx[:1]), ValueError, "token_index"),
        ("index empty", lambda: routed_attention(q, k, v, token_index=idx[:, :0]), ValueError, "K>=1"),
        ("index range", lambda: routed_attention(q, k, v, token_index=idx + 1), ValueError, "[0, N=10)"),
        ("index negative", lambda: routed_attention(q, k, v, token_index=idx - 1), ValueError, "[0, N=10)"),
        ("scale", lambda: routed_attention(q, k, v, scale=float("nan")), ValueError, "scale"),
        ("backend", lambda: routed_attention(q, k, v, backend="cuda"), ValueError, "backend"),
        ("triton head dim", lambda: routed_attention(*[torch.randn(1, 1, 4, 256)] * 3, backend="triton"),
         ValueError if triton_available() else RuntimeError, "head dim" if triton_available() else "triton"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise_clear_errors(case):
    _, call, exc, words = case
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value) and "routed_attention" in str(info.value)


@pytest.mark.skipif(not triton_available() or TRITON_RUNNABLE, reason="needs triton, and no GPU/interpreter")
def test_triton_backend_on_cpu_without_interpreter_says_how():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        routed_attention(q, q, q, backend="triton")


# --------------------------------------------------------------------------- Triton path (spread subset)

TRITON_CASES = [  # (B, Hq, Hkv, N, d, dtype, select, layout)
    (2, 1, 1, 1, 32, F32, None, "contiguous"),
    (2, 3, 3, 17, 64, F16, None, "contiguous"),
    (2, 6, 1, 50, 32, F32, None, "contiguous"),
    (1, 6, 6, 197, 64, F32, None, "timm"),
    (1, 3, 1, 257, 32, F16, None, "contiguous"),
    (2, 1, 1, 17, 32, F32, "one", "contiguous"),
    (2, 3, 1, 1, 64, F16, "one", "contiguous"),
    (2, 6, 1, 50, 64, F16, "half", "contiguous"),
    (2, 6, 6, 257, 64, F32, "half", "timm"),
    (1, 3, 3, 197, 32, F32, "all", "contiguous"),
    (1, 6, 6, 257, 64, F16, "all", "contiguous"),
    (2, 3, 3, 50, 64, BF16, "half", "contiguous"),
    (1, 1, 1, 197, 64, BF16, None, "contiguous"),
]


def _case_id(c):
    b, hq, hkv, n, d, dtype, select, layout = c
    return f"b{b}-hq{hq}-hkv{hkv}-n{n}-d{d}-{str(dtype)[6:]}-{select or 'dense'}-{layout}"


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_matches_reference_and_explicit(case):
    b, hq, hkv, n, d, dtype, select, layout = case
    q, k, v, index = _inputs(b, hq, hkv, n, d, dtype, select, layout)
    got = _run(q, k, v, index, "triton")
    grad_out = got[3]
    _assert_matches(got[:3], _explicit(q, k, v, index, grad_out), dtype, "triton vs explicit")
    if dtype != BF16:  # the CPU reference has no bf16 SDPA backward worth comparing at these tolerances
        _assert_matches(got[:3], _run(q, k, v, index, "reference", grad_out)[:3], dtype, "triton vs reference")
    plain = routed_attention(q, k, v, token_index=index, backend="triton")
    from squad.kernels.triton_attention import forward_config

    if forward_config(index.shape[1] if index is not None else n, d, dtype, True)["ONE_TILE"]:
        torch.testing.assert_close(plain, got[0], atol=0, rtol=0)  # one tile: the same pass with or without scores
    else:  # two phases with scores, online softmax without: the same values up to rounding
        torch.testing.assert_close(plain, got[0], **TOL[dtype][0])


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
def test_triton_duplicate_indices_add_gradients():
    q, k, v, _ = _inputs(1, 3, 1, 20, 32, F32, None)
    index = torch.tensor([[4, 7, 4, 0, 19]], device=q.device)
    got = _run(q, k, v, index, "triton")
    _assert_matches(got[:3], _explicit(q, k, v, index, got[3]), F32, "duplicates")


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
@pytest.mark.parametrize("splits", [1, 2, 6])
def test_triton_backward_head_splits(splits):
    """dK/dV with a kv head's query heads spread over 1, 2 or 6 programs (partial sums) agree with the definition."""
    from squad.kernels import triton_attention as ta

    q, k, v, index = _inputs(2, 6, 1, 40, 32, F32, "half")
    grad_out = torch.randn(2, 6, 20, 32, device=q.device)
    with torch.no_grad():
        out, lse, _ = ta.attention_forward(q, k, v, 32 ** -0.5, index)
        grads = ta.attention_backward(grad_out, q, k, v, out, lse, 32 ** -0.5, index, head_splits=splits)
    want = _explicit(q, k, v, index, grad_out)
    _assert_matches((out, None, grads), want, F32, f"head_splits={splits}")


FORWARD_PATHS = [  # (B, Hq, Hkv, N, d, dtype, select): odd sizes, partial blocks, grouped heads
    (2, 3, 1, 70, 32, F32, None),
    (1, 2, 2, 33, 64, F16, "half"),
    (2, 4, 4, 100, 16, BF16, "half"),
    (1, 6, 3, 17, 32, F32, "one"),
]


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
@pytest.mark.parametrize("case", FORWARD_PATHS, ids=lambda c: "-".join(map(str, c)))
def test_triton_forward_paths_match_explicit(case):
    """The forward's three paths on the same inputs — one key tile, two phases (the key tile capped at 16 rows so
    that these sizes take several key blocks), online softmax without scores — against the N×N definition: output,
    row log-sum-exp and column-mean scores."""
    from squad.kernels import triton_attention as ta

    b, hq, hkv, n, d, dtype, select = case
    q, k, v, index = _inputs(b, hq, hkv, n, d, dtype, select)
    m = n if index is None else index.shape[1]
    out_tol, score_tol = TOL[dtype]
    with torch.no_grad():
        want_out, want_scores = explicit_attention(q.float(), k.float(), v.float(), token_index=index)
        qf, kf = (x if index is None else gather_rows(x, index) for x in (q.float(), k.float()))
        s = qf @ kf.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * d ** -0.5
        want_lse = s.logsumexp(-1)
        for max_one_tile, scores in ((None, True), (None, False), (16, True), (16, False)):
            cfg = ta.forward_config(m, d, dtype, scores, max_one_tile)
            assert cfg["ONE_TILE"] == (max_one_tile is None or m <= 16)
            out, lse, got_scores = ta.attention_forward(q, k, v, d ** -0.5, index, scores, max_one_tile)
            what = f"one_tile={cfg['ONE_TILE']} scores={scores}"
            torch.testing.assert_close(out.float(), want_out, **out_tol, msg=lambda e, w=what: f"{w} out: {e}")
            torch.testing.assert_close(lse, want_lse, **out_tol, msg=lambda e, w=what: f"{w} lse: {e}")
            if scores:
                torch.testing.assert_close(got_scores, want_scores, **score_tol,
                                           msg=lambda e, w=what: f"{w} scores: {e}")
            else:
                assert got_scores is None


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
def test_triton_ops_pass_opcheck_and_fake_shapes():
    """`squad::triton_attention` and its backward: schema, fake implementation, autograd registration and AOT
    dispatch agree with the kernels (torch.library.opcheck); the fake outputs have the real shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.library import opcheck

    q, k, v, index = _inputs(2, 4, 2, 9, 16, F16, "half")
    for idx in (None, index):
        for scores in (True, False):
            opcheck(torch.ops.squad.triton_attention.default, (q, k, v, idx, 0.3, scores))
            real = torch.ops.squad.triton_attention(q, k, v, idx, 0.3, scores)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                fake = torch.ops.squad.triton_attention(*(mode.from_tensor(x) if x is not None else None
                                                          for x in (q, k, v, idx)), 0.3, scores)
            for r, f in zip(real, fake, strict=True):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    out, lse, _ = torch.ops.squad.triton_attention(q, k, v, index, 0.3, False)
    opcheck(torch.ops.squad.triton_attention_backward.default,
            (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, index, 0.3))


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see the interpreter test)")
def test_triton_backend_compiles_in_one_graph():
    """torch.compile with inductor over the Triton backend (scores, token subsets, gradients): one graph, the
    kernels opaque custom ops, the same results as eager."""
    torch._dynamo.reset()
    _check_compiled_matches_eager("triton", "inductor", F16)


@pytest.mark.skipif(not triton_available() or _interpreting() or torch.cuda.is_available(),
                    reason="runs the Triton tests in an interpreter subprocess when there is no GPU")
@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
           "-k", "test_triton_matches or test_triton_duplicate or test_triton_backward_head_splits or "
                 "test_triton_forward_paths or test_triton_ops_pass or test_triton_backend_compiles"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = res.stdout[-6000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    assert f"{len(TRITON_CASES) + len(FORWARD_PATHS) + 6} passed" in res.stdout, report  # ran, not skipped


GPU_COMPILE = [  # (kernel, dtype, HAS_INDEX, d, M, scores, scale type, sm): every kernel and forward path,
    # 16-bit and fp32, narrow and wide tiles, the scale as fp32 and as the float64 that torch.compile passes
    ("_fwd_kernel", "bf16", True, 64, 197, True, "fp64", 80),  # one tile with scores
    ("_fwd_kernel", "bf16", False, 64, 197, True, "fp64", 90),  # the same for an H100
    ("_fwd_kernel", "fp16", False, 64, 1024, True, "fp64", 80),  # two phases
    ("_fwd_kernel", "fp32", True, 128, 1024, False, "fp64", 80),  # online softmax, wide fp32 tiles
    ("_fwd_kernel", "bf16", True, 32, 4096, False, "fp32", 80),
    ("_bwd_dkdv_kernel", "bf16", True, 128, None, None, "fp64", 80),
    ("_bwd_dq_kernel", "fp32", False, 128, None, None, "fp64", 80),
]


@pytest.mark.skipif(not triton_available() or _interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("case", GPU_COMPILE, ids=lambda c: "-".join(map(str, c)))
def test_triton_kernels_compile_for_gpu(case):
    """Lowers the kernel for an sm_80 (or sm_90) GPU down to a cubin (no GPU needed): the interpreter alone proves no
    compile. A float64 scale once failed here ("Loop-carried variable m_i has initial type fp32 but is re-assigned
    to fp64"): the kernels cast it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from squad.kernels import triton_attention as ta

    kernel, dtype, has_index, d, m, scores, scale_type, sm = case
    fn = getattr(ta, kernel)
    torch_dtype = {"bf16": BF16, "fp16": F16, "fp32": F32}[dtype]
    if kernel == "_fwd_kernel":
        cfg = ta.forward_config(m, d, torch_dtype, scores)
    else:
        cfg = ta._config(d, torch_dtype, torch.device("cuda"))
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    constexprs = {"HAS_INDEX": has_index, **cfg}
    names = list(inspect.signature(fn).parameters)
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"):
            signature[name] = f"*{dtype}"
        elif name == "IDX":
            signature[name] = "*i64"
        elif name in ("LSE", "PART", "DELTA"):
            signature[name] = "*fp32"
        elif name in ("qk_scale", "sm_scale"):
            signature[name] = scale_type
        else:
            signature[name] = "i32"
    src = ASTSource(JITFunction(fn), signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=options)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= 99 * 1024  # fits an sm_80/sm_86 block's shared memory
