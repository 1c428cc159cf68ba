"""The inference path's row ops (squad.kernels.rows) and what they serve: a task embedding taken by the blocks in
passes they make anyway, and a Mixture-of-Depths block's fused routed tokens written back in place. The reference
against explicit PyTorch, the ops' schemas and fakes, the Triton kernels against the reference (in the interpreter
subprocess of tests/test_grouped_kernels.py, or on a GPU), the kernels compiled for sm_80/sm_90, and models on the
fused path (forced on the CPU) against their CPU path: MoD (learned and attention routing), MoE attention and MoNE
blocks with task embeddings, with hooks on (no in-place write, no skipped module call) and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from squad.kernels import rows as RW
from squad.kernels.device import force_cuda_path, triton_available, triton_interpreting
from tests.helpers import assert_compiles_for_gpu, routed_inference_model

RUNNABLE = triton_available() and (torch.cuda.is_available() or triton_interpreting())
R, N, D, K = 3, 11, 40, 5
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 3e-2, "atol": 6e-2}}


def _tensors(dtype, device="cpu"):
    g = torch.Generator().manual_seed(0)
    t = {"x": torch.randn(R, N, D, generator=g), "emb": torch.randn(R, D, generator=g),
         "w": torch.randn(D, generator=g), "b": torch.randn(D, generator=g), "y": torch.randn(R, N, D, generator=g),
         "a": torch.randn(R, K, D, generator=g), "z": torch.randn(R, K, D, generator=g),
         "s": torch.rand(R, K, generator=g), "shift": torch.randn(R, generator=g)}
    t = {k: v.to(device, dtype) for k, v in t.items()}
    t["idx"] = torch.stack([torch.randperm(N, generator=g)[:K].sort().values for _ in range(R)]).to(device)
    return t


def test_reference_equals_explicit_pytorch():
    """In float64: the norm of gathered rows plus the embedding, the three-way add, and the in-place write-back of
    ``lerp(a, b, s + shift) - emb`` at the indexed tokens (others untouched)."""
    t = _tensors(torch.float64)
    picked = t["x"].gather(1, t["idx"].unsqueeze(-1).expand(-1, -1, D)) + t["emb"].unsqueeze(1)
    h, rows = RW.row_norm(t["x"], t["idx"], t["emb"], t["w"], t["b"], 1e-6)
    torch.testing.assert_close(rows, picked, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, F.layer_norm(picked, (D,), t["w"], t["b"], 1e-6), rtol=1e-12, atol=1e-12)
    h, none = RW.row_norm(t["x"], None, None, t["w"], t["b"], 1e-6)
    torch.testing.assert_close(h, F.layer_norm(t["x"], (D,), t["w"], t["b"], 1e-6), rtol=1e-12, atol=1e-12)
    assert none.numel() == 0
    torch.testing.assert_close(RW.row_add(t["x"], t["y"], t["emb"]), t["x"] + t["y"] + t["emb"].unsqueeze(1))
    x = t["x"].clone()
    RW.row_scatter_lerp_(x, t["idx"], t["a"], t["z"], t["s"], t["shift"], t["emb"])
    want = t["x"].clone()
    weight = (t["s"] + t["shift"].unsqueeze(1)).unsqueeze(-1)
    for r in range(R):
        want[r, t["idx"][r]] = torch.lerp(t["a"][r], t["z"][r], weight[r]) - t["emb"][r]
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)


def test_ops_pass_opcheck_and_reject_bad_input():
    t = _tensors(torch.float32)
    torch.library.opcheck(torch.ops.squad.row_norm.default, (t["x"], t["idx"], t["emb"], t["w"], t["b"], 1e-6))
    torch.library.opcheck(torch.ops.squad.row_norm.default, (t["x"], None, t["emb"], t["w"], t["b"], 1e-6))
    torch.library.opcheck(torch.ops.squad.row_add.default, (t["x"], t["y"], t["emb"]))
    torch.library.opcheck(torch.ops.squad.row_scatter_lerp_.default,
                          (t["x"].clone(), t["idx"], t["a"], t["z"], t["s"], t["shift"], t["emb"]))
    with pytest.raises(ValueError, match="index must be int64"):
        RW.row_norm(t["x"], t["idx"].int(), None, t["w"], t["b"], 1e-6)
    with pytest.raises(ValueError, match="emb must be"):
        RW.row_add(t["x"], t["y"], t["emb"][:2])


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_row_kernels_match_reference(dtype):
    """Each kernel against the reference, with and without the index, the embedding, the router weight and its
    shift (D not a power of two; rows cut across tiles)."""
    from squad.kernels import triton_rows as T

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = _tensors(dtype, device)
    for index in (None, t["idx"]):
        for emb in (None, t["emb"]):
            got = T.row_norm(t["x"], index, emb, t["w"], t["b"], 1e-6)
            want = RW.row_norm_reference(t["x"], index, emb, t["w"], t["b"], 1e-6)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])
            torch.testing.assert_close(T.row_add(t["x"], t["y"], emb).float(),
                                       RW.row_add_reference(t["x"], t["y"], emb).float(), **TOL[dtype])
    spread = t["idx"].unsqueeze(-1).expand(-1, -1, D)
    for args in ((t["s"], t["shift"], t["emb"]), (None, None, None), (t["s"], None, t["emb"])):
        got = t["x"].clone()
        T.row_scatter_lerp_(got, t["idx"], t["a"], t["z"], *args)
        want = t["x"].clone().scatter_(1, spread, RW.row_scatter_lerp_reference(t["x"], t["idx"], t["a"], t["z"],
                                                                                 *args))
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def _hooked(model):
    """A forward hook on every block (what upcycling's comparison registers): the fused path's in-place writes and
    skipped module calls turn off."""
    return [b.register_forward_hook(lambda *_: None) for b in model.blocks]


@pytest.mark.parametrize("name", ["mod_vit_s", "amod_vit_s", "modsquad_vit_s", "mone_vit_s"])
@pytest.mark.parametrize("hooks", [False, True], ids=["owned", "hooked"])
def test_fused_inference_equals_the_cpu_path(name, hooks):
    """With task embeddings every block, inference on the CUDA path (forced; the ops' reference on the CPU) gives
    the CPU path's features and predictions (one task and two), statistics where they are collected, and never
    writes into the caller's tokens."""
    model = routed_inference_model(name)
    if model.task_embed is not None:
        with torch.no_grad():
            model.task_embed.normal_(0, 0.5)
    handles = _hooked(model) if hooks else []
    images = torch.randn(3, 3, model.cfg.img_size, model.cfg.img_size)
    task = model.task_names[0]
    with torch.no_grad():
        want = model.forward_features(images, task)
        want_out = model(images, model.task_names[:2])
        with force_cuda_path():
            got = model.forward_features(images, task)
            got_out = model(images, model.task_names[:2])
            x = model.embed(images)
            ids = torch.zeros(3, dtype=torch.long)
            kept = x.clone()
            model.forward_tokens(x, ids, [(0, 0, 3)])
    for hk in handles:
        hk.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name_ in want_out.preds:
        torch.testing.assert_close(got_out.preds[name_], want_out.preds[name_], rtol=1e-5, atol=1e-5)
    assert len(got_out.stats) == len(want_out.stats)
    for a, b in zip(got_out.stats, want_out.stats, strict=True):
        torch.testing.assert_close(a.counts, b.counts)
    torch.testing.assert_close(x, kept, rtol=0, atol=0)


def test_fused_inference_compiles_in_one_graph():
    """MoD ViT-S inference on the fused path (forced) under ``torch.compile(fullgraph=True)``: one graph (the in-place
    write-back and the ownership and hook checks trace), eager's features."""
    model = routed_inference_model("mod_vit_s")
    images = torch.randn(2, 3, model.cfg.img_size, model.cfg.img_size)
    task = model.task_names[0]
    torch._dynamo.reset()
    with torch.no_grad(), force_cuda_path():
        want = model.forward_features(images, task)
        got = torch.compile(model.forward_features, backend="aot_eager", fullgraph=True)(images, task)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not RUNNABLE, reason="needs CUDA or TRITON_INTERPRET=1 (see tests/test_grouped_kernels.py)")
def test_triton_mod_inference_matches_the_cpu_path():
    """MoD ViT-S (learned routing, task embeddings) through the Triton kernels (fp32) against the CPU path."""
    model = routed_inference_model("mod_vit_s")
    with torch.no_grad():
        model.task_embed.normal_(0, 0.5)
    images = torch.randn(2, 3, model.cfg.img_size, model.cfg.img_size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.no_grad():
        want = model.forward_features(images, model.task_names[0])
        with force_cuda_path():
            got = model.to(device).forward_features(images.to(device), model.task_names[0])
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


GPU_COMPILE = [("_row_norm_kernel", "bf16", 80), ("_row_add_kernel", "bf16", 90),
               ("_row_scatter_lerp_kernel", "bf16", 90), ("_row_norm_kernel", "fp32", 90)]


@pytest.mark.skipif(not triton_available() or triton_interpreting(), reason="needs triton in compiler mode")
@pytest.mark.parametrize("case", GPU_COMPILE, ids=lambda c: f"{c[0]}-{c[1]}-sm{c[2]}")
def test_triton_row_kernels_compile_for_gpu(case):
    """Each kernel lowered for sm_80 / sm_90 down to a cubin with every feature on, at ViT-S width."""
    from squad.kernels import triton_rows as T

    kernel, dtype, sm = case
    _, block_d, warps = T._tiles(384)
    constexprs = {"HAS_INDEX": True, "HAS_EMB": True, "HAS_S": True, "HAS_SHIFT": True, "BLOCK_M": 8,
                  "BLOCK_D": block_d}
    fn = getattr(T, kernel)
    constexprs = {k: v for k, v in constexprs.items() if k in fn.__code__.co_varnames}
    types = {"INDEX": "*i64", "eps": "fp32",
             **{n: f"*{dtype}" for n in ("X", "EMB", "WEIGHT", "BIAS", "OUT", "ROWS", "A", "B", "S", "SHIFT")}}
    assert_compiles_for_gpu(fn, types, constexprs, {"num_warps": warps, "num_stages": 1}, sm)
