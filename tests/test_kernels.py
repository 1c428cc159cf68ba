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
from squad.kernels.reference import attention_backward_chunked, attention_forward_chunked

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
    torch.testing.assert_close(plain, got[0], atol=0, rtol=0)  # same kernel with or without the score pass


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
        out, lse = ta.attention_forward(q, k, v, 32 ** -0.5, index)
        grads = ta.attention_backward(grad_out, q, k, v, out, lse, 32 ** -0.5, index, head_splits=splits)
    want = _explicit(q, k, v, index, grad_out)
    _assert_matches((out, None, grads), want, F32, f"head_splits={splits}")


@pytest.mark.skipif(not triton_available() or _interpreting() or torch.cuda.is_available(),
                    reason="runs the Triton tests in an interpreter subprocess when there is no GPU")
@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
           "-k", "test_triton_matches or test_triton_duplicate or test_triton_backward_head_splits"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    report = res.stdout[-6000:] + res.stderr[-2000:]
    assert res.returncode == 0, report
    assert f"{len(TRITON_CASES) + 4} passed" in res.stdout, report  # ran, not skipped


GPU_COMPILE = [  # (kernel, dtype, HAS_INDEX, d): every kernel, 16-bit and fp32, narrow and wide tiles
    ("_fwd_kernel", "bf16", True, 64),
    ("_scores_kernel", "fp16", True, 64),
    ("_bwd_dkdv_kernel", "bf16", True, 128),
    ("_bwd_dq_kernel", "fp32", False, 128),
]


@pytest.mark.skipif(not triton_available() or _interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("kernel,dtype,has_index,d", GPU_COMPILE)
def test_triton_kernels_compile_for_gpu(kernel, dtype, has_index, d):
    """Lowers the kernel for an sm_80 GPU down to a cubin (no GPU needed): the interpreter alone proves no compile."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from squad.kernels import triton_attention as ta

    fn = getattr(ta, kernel)
    torch_dtype = {"bf16": BF16, "fp16": F16, "fp32": F32}[dtype]
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
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(JITFunction(fn), signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 80, 32), options=options)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= 99 * 1024  # fits an sm_80/sm_86 block's shared memory
