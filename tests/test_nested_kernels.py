"""MoNE's inference ops (squad.kernels.nested): the reference against nested.py's autograd ops and plain layer norm,
the ops' schemas and fake kernels, the Triton kernels against the reference (in the interpreter subprocess of
tests/test_grouped_kernels.py, or on a GPU) on odd widths, empty groups, two-level rows and per-row embeddings, the
kernels compiled for sm_80/sm_90, and a MoNE model's inference on the kernel path against its CPU path."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from squad.kernels import nested as NS
from squad.kernels.device import force_cuda_path, triton_available, triton_interpreting
from squad.kernels.tiles import launch_settings
from squad.layers.nested import nested_linear_in, nested_linear_out
from tests.helpers import compile_triton_for_gpu, routed_inference_model

RUNNABLE = triton_available() and (torch.cuda.is_available() or triton_interpreting())
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
R, TOKENS, D, H = 3, 7, 24, 40
BLOCKS = [(0, 2 * R, 24), (2 * R, 2 * R, 12), (2 * R, 5 * R, 6), (5 * R, 7 * R, 3)]  # one empty group


def _layout(device="cpu"):
    ends, widths = [e for _, e, _ in BLOCKS], [w for _, _, w in BLOCKS]
    return torch.tensor([ends, widths], dtype=torch.int32, device=device), ends + widths


def _tensors(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    shapes = {"x": (R * TOKENS, D), "w_in": (H, D), "b_in": (H,), "a3": (R, TOKENS, H), "w_out": (D, H),
              "b_out": (D,), "res": (R * TOKENS, D), "emb": (R, D), "scale": (R * TOKENS,), "gw": (D,), "gb": (D,)}
    t = {k: torch.randn(*s, generator=g).to(device, dtype) for k, s in shapes.items()}
    t["a3"] = t["a3"].transpose(0, 1)  # [N, R, H]: row t = n·R + r is a3[n, r] (SDPA's output, token-major)
    # [N, R, 4, H / 4] of a [R, 4, N, H / 4] tensor: attention heads laid out head-major (SDPA's output on a CPU)
    t["a4"] = torch.randn(R, 4, TOKENS, H // 4, generator=g).to(device, dtype).permute(2, 0, 1, 3)
    return t


def test_reference_matches_the_autograd_ops_and_layer_norm():
    """In float64: the input projection (with and without GELU) equals `nested_linear_in`, the output projection
    into a residual (with embedding and scale) equals `nested_linear_out` plus the residual, and the norm is
    LayerNorm of the embedded rows."""
    t = _tensors(torch.float64)
    _, groups = _layout()
    for gelu in (False, True):
        want = nested_linear_in(t["x"], t["w_in"], t["b_in"], BLOCKS)
        got = NS.nested_linear_reference(t["x"], t["w_in"], t["b_in"], groups, R, "in", gelu, None, None, None)
        torch.testing.assert_close(got, F.gelu(want) if gelu else want, rtol=1e-12, atol=1e-12)
    rows = t["a3"].reshape(-1, H)
    embedded = t["res"] + t["emb"].repeat(TOKENS, 1)
    want = nested_linear_out(rows, t["w_out"], t["b_out"], BLOCKS, residual=embedded, scale=t["scale"].view(-1, 1))
    got = NS.nested_linear_reference(t["a3"], t["w_out"], t["b_out"], groups, R, "out", False, t["res"], t["emb"],
                                     t["scale"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    heads = NS.nested_linear_reference(t["a4"], t["w_out"], t["b_out"], groups, R, "out", False, t["res"], None, None)
    torch.testing.assert_close(heads, nested_linear_out(t["a4"].reshape(-1, H), t["w_out"], t["b_out"], BLOCKS,
                                                        residual=t["res"]), rtol=1e-12, atol=1e-12)
    got = NS.nested_norm_reference(t["res"], t["emb"], t["gw"], t["gb"], 1e-6, R)
    torch.testing.assert_close(got, F.layer_norm(embedded, (D,), t["gw"], t["gb"], 1e-6), rtol=1e-12, atol=1e-12)


def _mlp_args(t, layout, groups):
    """``squad::nested_mlp_``'s arguments after x: the norm, fc1 [H, D], fc2 [D, H], the layout, gate [R, N], α."""
    return (t["gw"], t["gb"], 1e-6, t["w_in"], t["b_in"], t["w_out"], t["b_out"], layout, groups,
            t["scale"].view(TOKENS, R).t(), t["scale"][:1] + 0.5)


def test_fused_mlp_reference_is_the_unfused_sublayer():
    """In float64 the fused MLP sublayer equals its pieces: LayerNorm, the nested first projection, GELU, the nested
    second projection scaled by α · gate + 1 and added into the residual's first w features."""
    t = _tensors(torch.float64)
    layout, groups = _layout()
    args = _mlp_args(t, layout, groups)
    got = NS.nested_mlp_reference(t["res"], *args[:7], groups, *args[9:])
    h = F.layer_norm(t["res"], (D,), t["gw"], t["gb"], 1e-6)
    hidden = F.gelu(nested_linear_in(h, t["w_in"], t["b_in"], BLOCKS))
    scale = (args[-1] * args[-2].t().reshape(-1) + 1).view(-1, 1)
    want = nested_linear_out(hidden, t["w_out"], t["b_out"], BLOCKS, residual=t["res"], scale=scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    x = t["res"].clone()
    NS.nested_mlp_(x, *args)  # the op on CPU tensors: its reference, in place
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)


def test_ops_pass_opcheck():
    t = _tensors(torch.float32)
    layout, groups = _layout()
    torch.library.opcheck(torch.ops.squad.nested_linear.default,
                          (t["x"], t["w_in"], t["b_in"], layout, groups, R, "in", True, None, None, None))
    torch.library.opcheck(torch.ops.squad.nested_linear.default,
                          (t["a3"], t["w_out"], t["b_out"], layout, groups, R, "out", False, t["res"], t["emb"],
                           t["scale"]))
    torch.library.opcheck(torch.ops.squad.nested_linear.default,
                          (t["a4"], t["w_out"], t["b_out"], layout, groups, R, "out", False, t["res"], None, None))
    torch.library.opcheck(torch.ops.squad.nested_linear_.default,
                          (t["a3"].reshape(-1, H), t["w_out"], t["b_out"], layout, groups, t["res"].clone(),
                           t["scale"]))
    torch.library.opcheck(torch.ops.squad.nested_norm.default,
                          (t["res"], t["emb"], t["gw"], t["gb"], 1e-6, layout, groups, R))
    torch.library.opcheck(torch.ops.squad.nested_mlp_.default, (t["res"].clone(), *_mlp_args(t, layout, groups)))
    with pytest.raises(ValueError, match="residual"):
        NS.nested_linear(t["a3"], t["w_out"], None, layout, groups, R, "out", False, None, None, None)
    with pytest.raises(ValueError, match="w1"):
        NS.nested_mlp_(t["res"].clone(), *_mlp_args(t, layout, groups)[:3], t["w_out"], *_mlp_args(t, layout,
                                                                                                    groups)[4:])


TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 3e-2, "atol": 8e-2}}


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_nested_ops_match_reference(dtype):
    """Input projections (GELU, bias), output projections into a new residual (two-level rows, two-level features,
    embedding, scale)
    and in place, and the norm (only each row's width compared: the kernel writes nothing past it), with the
    ops' tiles and with 16-wide tiles (groups cut into several tiles)."""
    from squad.kernels import triton_nested as T

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = _tensors(dtype, device)
    layout, groups = _layout(device)
    for config in (NS.nested_config(D, H, dtype), SMALL):
        for gelu, bias in itertools.product([False, True], repeat=2):
            b = t["b_in"] if bias else None
            got = T.nested_mm(t["x"], t["w_in"], b, layout, R, True, gelu, None, None, None, None, config)
            want = NS.nested_linear_reference(t["x"], t["w_in"], b, groups, R, "in", gelu, None, None, None)
            torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        for rows, emb, scale in itertools.product([t["a3"], t["a4"]], [None, t["emb"]], [None, t["scale"]]):
            got = T.nested_mm(rows, t["w_out"], t["b_out"], layout, R, False, False, t["res"], emb, scale, None,
                              config)
            want = NS.nested_linear_reference(rows, t["w_out"], t["b_out"], groups, R, "out", False, t["res"], emb,
                                              scale)
            torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        own, rows = t["res"].clone(), t["a3"].reshape(-1, H)
        T.nested_mm(rows, t["w_out"], t["b_out"], layout, 1, False, False, own, None, t["scale"], own, config)
        want = NS.nested_linear_reference(rows, t["w_out"], t["b_out"], groups, 1, "out", False, t["res"], None,
                                          t["scale"])
        torch.testing.assert_close(own.float(), want.float(), **TOL[dtype])
    for emb in (None, t["emb"]):
        got = T.nested_norm(t["res"], emb, t["gw"], t["gb"], 1e-6, layout, R)
        want = NS.nested_norm_reference(t["res"], emb, t["gw"], t["gb"], 1e-6, R)
        for first, end, width in BLOCKS:
            torch.testing.assert_close(got[first:end, :width].float(), want[first:end, :width].float(), **TOL[dtype])


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_nested_mlp_matches_reference(dtype):
    """The fused MLP kernel against the reference, in place: odd widths (not multiples of its tiles), an empty group,
    with the op's tiles and with tiles that cut groups into several row tiles and the output into three chunks."""
    from squad.kernels import triton_nested_mlp as T

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = _tensors(dtype, device)
    t["w_in"], t["w_out"] = t["w_in"] / 4, t["w_out"] / 4  # keep the hidden layer in GELU's curved range
    layout, groups = _layout(device)
    args = _mlp_args(t, layout, groups)
    config = NS.nested_mlp_config(D, H, dtype)
    for scaled in (True, False):  # α · gate + 1, or 1 (a plain MLP sublayer: MoD's inner block)
        scale = args[9:] if scaled else (None, None)
        want = NS.nested_mlp_reference(t["res"], *args[:7], groups, *scale)
        for cfg in (config, {**config, "BLOCK_M": 16, "BLOCK_H": 16, "BLOCK_W": 16, "W_CHUNKS": 2}):
            got = t["res"].clone()
            T.nested_mlp_(got, *args[:8], *scale, cfg)
            torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("tasks", [1, 2], ids=["one_task", "two_tasks"])
def test_mone_inference_on_the_kernel_path_equals_the_cpu_path(tasks):
    """A MoNE model (task embeddings every block: fused into the MoNE kernels there) in inference: the kernel path
    (the ops' reference on the CPU) gives the CPU path's predictions, the routed layers' records and A-MoD-free
    statistics."""
    model = routed_inference_model("mone_vit_s")
    images = torch.randn(3, 3, 32, 32)
    names = model.task_names[:tasks]
    with torch.no_grad():
        want = model(images, names)
        with force_cuda_path():
            got = model(images, names)
    for name in names:
        torch.testing.assert_close(got.preds[name], want.preds[name], rtol=1e-5, atol=1e-5)
    for a, b in zip(got.stats, want.stats, strict=True):
        torch.testing.assert_close(a.counts, b.counts)


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
def test_triton_mone_inference_matches_the_cpu_path():
    """The same through the Triton kernels (fp32)."""
    model = routed_inference_model("mone_vit_s")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model.forward_features(images, model.task_names[0])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with force_cuda_path():
            got = model.to(device).forward_features(images.to(device), model.task_names[0])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


GPU_COMPILE = [("_nested_mm_kernel", "bf16", {"IN_MODE": True, "GELU": True, "RESIDUAL": 0}, 80),
               ("_nested_mm_kernel", "bf16", {"IN_MODE": False, "GELU": False, "RESIDUAL": 1}, 90),
               ("_nested_mm_kernel", "fp32", {"IN_MODE": False, "GELU": False, "RESIDUAL": 2}, 80),
               ("_nested_norm_kernel", "bf16", {}, 90), ("_nested_mlp_kernel", "bf16", {}, 80),
               ("_nested_mlp_kernel", "bf16", {}, 90), ("_nested_mlp_kernel", "fp32", {}, 80)]


@pytest.mark.skipif(not triton_available() or triton_interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("case", GPU_COMPILE, ids=lambda c: f"{c[0]}-{c[1]}-{sorted(c[2].items())}-sm{c[3]}")
def test_triton_nested_kernels_compile_for_gpu(case):
    """Each kernel lowered for sm_80 / sm_90 down to a cubin with every feature on, at ViT-S widths."""
    from squad.kernels import triton_nested as T
    from squad.kernels import triton_nested_mlp

    kernel, dtype, flags, sm = case
    if kernel == "_nested_mlp_kernel":
        T = triton_nested_mlp  # noqa: N806
        cfg = NS.nested_mlp_config(384, 1536, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
        cfg, options = launch_settings(cfg)
        constexprs = {"HAS_SCALE": True, "UPCAST": False, "PRECISION": "ieee", **cfg}
    elif kernel == "_nested_mm_kernel":
        cfg = NS.nested_config(384, 1536, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])
        cfg, options = launch_settings(cfg)
        constexprs = {"HAS_BIAS": True, "HAS_EMB": True, "HAS_SCALE": True, "UPCAST": False, "PRECISION": "ieee",
                      **flags, **cfg}
    else:
        options = {"num_warps": 4, "num_stages": 1}
        constexprs = {"HAS_EMB": True, "BLOCK_M": 8, "BLOCK_D": 512}
    types = {"LAYOUT": "*i32", "eps": "fp32",
             **{n: f"*{dtype}" for n in ("A", "W", "BIAS", "RES", "EMB", "SCALE", "OUT", "X", "WEIGHT", "LN_W", "LN_B",
                                         "W1", "B1", "W2", "B2", "GATE", "ALPHA", "NORMED")}}
    compiled = compile_triton_for_gpu(getattr(T, kernel), types, constexprs, options, sm)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= 99 * 1024
