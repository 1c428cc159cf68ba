"""The kernel path's two expert-GEMM backends (``model.moe.kernel``) and MoNE's two inference backends
(``model.mone.kernel``), and the measured choice between them (`squad.kernels.choice`).

- ``grouped_mm`` (squad.layers.experts.permuted): torch's grouped GEMM on permuted rows, against the CPU algorithm in
  float64 (through its per-group reference: the library op has no float64 kernel) and float32 (the library's CPU
  kernel), with empty, no-op and dropped slots; no atomics and no host read in a forward/backward;
- the reference agrees with the library op in both of its forms;
- ``auto`` takes the library's backend until a choice file says otherwise, and the file's choice after;
- every shipped config trains a step on each backend (CUDA path forced on the CPU);
- on a GPU (``gpu``): each backend in bf16 against the CPU algorithm in float64.

The Triton backend's own tests (interpreter, float64 reference) are in tests/test_grouped_kernels.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import squad
from squad.config import ConfigError
from squad.kernels import choice
from squad.kernels.device import force_cuda_path
from squad.layers.experts import expert_mlp, plan_dispatch
from squad.layers.experts.grouped import library_grouped_mm
from squad.layers.experts.permuted import _tile_gates, grouped_gemm_reference, library_runs, token_tile
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import ExpertMLP
from squad.layers.mone import MoNEBlock
from tests.helpers import MODEL_CONFIGS, ROOT, tiny_config

CASES = [  # (tokens, k, experts, no-op experts, experts left empty, capacity drop: slots redirected to no-op)
    (29, 2, 5, 0, (1, 3), False),
    (33, 3, 4, 2, (), False),
    (40, 2, 3, 0, (), True),
    (7, 1, 6, 0, (0, 2, 5), False),
    (48, 3, 4, 1, (2,), False),  # two gate tiles of 24 tokens (`token_tile`), an odd k, a no-op expert
]


def _routes(m, k, e, noop, gen, empty):
    """[M, k] distinct experts per token from E real + ``noop`` no-op experts, never naming those in ``empty``."""
    allowed = torch.tensor([i for i in range(e + noop) if i not in empty])
    scores = torch.rand(m, allowed.numel(), generator=gen)
    return allowed[scores.topk(k, dim=1).indices]


def _problem(case, d, h):
    m, k, e, noop, empty, drop = case
    gen = torch.Generator().manual_seed(m)
    experts = _routes(m, k, e, noop, gen, empty)
    if drop:  # the capacity rule's outcome: some slots redirected to the no-op index e
        experts[::3, 0] = e
    leaves = [torch.randn(m, d, generator=gen), torch.randn(e, d, h, generator=gen) / 4,
              torch.randn(e, h, generator=gen), torch.randn(e, h, d, generator=gen) / 4,
              torch.randn(e, d, generator=gen), torch.rand(m, k, generator=gen)]
    return experts, e, leaves, torch.randn(m, d, generator=gen)


def _run(experts, e, leaves, grad, dtype, device, forced, backend):
    ins = [v.to(device, dtype).requires_grad_() for v in leaves]
    with force_cuda_path(forced):
        plan = plan_dispatch(experts.to(device), e, host_sizes=False, noop=True)
        assert plan.sync_free == (forced or torch.device(device).type == "cuda")  # CUDA tensors take it anyway
        y = expert_mlp(ins[0], *ins[1:5], ins[5], plan, backend)
        return [y, *torch.autograd.grad(y, ins, grad.to(device, dtype))]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_grouped_mm_backend_matches_the_cpu_algorithm(case, dtype):
    """Output, input, weight, bias and gate gradients of the ``grouped_mm`` backend (CUDA path forced) against the
    CPU algorithm in float64: float64 goes through the per-group reference, float32 (widths 16-byte aligned) through
    the library op's CPU kernel."""
    d, h = (19, 23) if dtype == torch.float64 else (16, 24)
    experts, e, leaves, grad = _problem(case, d, h)
    want = _run(experts, e, leaves, grad, torch.float64, "cpu", False, "grouped_mm")
    got = _run(experts, e, leaves, grad, dtype, "cpu", True, "grouped_mm")
    tol = {"rtol": 1e-9, "atol": 1e-9} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
    for name, w, g in zip(["y", "dx", "dw1", "db1", "dw2", "db2", "dgates"], want, got, strict=True):
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda msg, n=name: f"{n}: {msg}")


def test_grouped_mm_backend_without_biases_and_its_gate_tiles():
    """The ``grouped_mm`` backend without b1 / b2 (one and several gate tiles) against the CPU algorithm in
    float64, and the tile rule: the most tokens up to 32 dividing M with T·k rows a multiple of 8, else one."""
    assert [token_tile(m, k) for m, k in [(30732, 4), (40, 2), (48, 3), (29, 2), (33, 3), (7, 1), (64, 8)]] == [
        26, 20, 24, 1, 1, 1, 32]
    tiles = _tile_gates(torch.arange(1.0, 13.0).view(6, 2), 3)  # 2 tiles of 3 tokens, k = 2
    assert tiles.shape == (2, 3, 6)
    assert torch.equal(tiles[1, 2], torch.tensor([0.0, 0, 0, 0, 11, 12]))
    assert torch.equal(tiles[0, 0], torch.tensor([1.0, 2, 0, 0, 0, 0]))
    for case in (CASES[0], CASES[-1]):
        experts, e, leaves, grad = _problem(case, 19, 23)
        leaves = [leaves[0], leaves[1], leaves[3], leaves[5]]
        got, want = [], []
        for forced, out in ((True, got), (False, want)):
            ins = [v.double().requires_grad_() for v in leaves]
            with force_cuda_path(forced):
                plan = plan_dispatch(experts, e, host_sizes=False, noop=True)
                y = expert_mlp(ins[0], ins[1], None, ins[2], None, ins[3], plan, "grouped_mm")
                out += [y, *torch.autograd.grad(y, ins, grad.double())]
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(library_grouped_mm is None, reason="this torch has no grouped GEMM")
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7], [4]], ids=str)
def test_reference_is_what_the_library_op_computes(counts):
    """`grouped_gemm_reference` against the library op on the CPU (float32) in both forms, empty groups and rows
    past the last group included (which the op leaves unspecified and the reference zeroes)."""
    g = torch.Generator().manual_seed(len(counts))
    rows, k, n = sum(counts) + 3, 8, 16
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a, w = torch.randn(rows, k, generator=g), torch.randn(len(counts), k, n, generator=g)
    used = int(offs[-1])
    torch.testing.assert_close(grouped_gemm_reference(a, w, offs)[:used], library_grouped_mm(a, w, offs=offs)[:used])
    assert not grouped_gemm_reference(a, w, offs)[used:].any()
    b = torch.randn(rows, n, generator=g)
    torch.testing.assert_close(grouped_gemm_reference(a.t(), b, offs), library_grouped_mm(a.t(), b, offs=offs))


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_grouped_mm_backend_has_no_atomics_and_no_host_read():
    """The forward and backward of the ``grouped_mm`` backend call the library op and nothing that adds atomically
    on a GPU (index_add, index_put with accumulate, scatter_add, embedding backward), reduces bags of rows
    (``embedding_bag``: slow on a GPU, `squad.bench.costmodel`) or reads the device from the host (item/tolist:
    ``_local_scalar_dense``)."""
    experts, e, leaves, grad = _problem(CASES[1], 16, 24)
    ins = [v.requires_grad_() for v in leaves]
    with force_cuda_path(), _OpLog() as log:
        plan = plan_dispatch(experts, e, host_sizes=False, noop=True)
        y = expert_mlp(ins[0], *ins[1:5], ins[5], plan, "grouped_mm")
        torch.autograd.grad(y, ins, grad)
    assert "_grouped_mm" in log.ops, sorted(log.ops)
    bad = {"index_add", "index_add_", "index_put", "index_put_", "scatter_add", "scatter_add_", "embedding_backward",
           "embedding_dense_backward", "_local_scalar_dense", "_embedding_bag_backward", "_embedding_bag",
           "_embedding_bag_forward_only", "embedding_bag"}
    assert not log.ops & bad, sorted(log.ops & bad)


def test_auto_takes_the_library_op_until_a_gpu_has_measured(tmp_path, monkeypatch):
    """``auto``: the library's backend without a choice file (and ``triton`` where the library cannot run the
    operands), the recorded winner once `record` has written one for this GPU and shape; an explicit key wins."""
    path = tmp_path / "choices.json"
    monkeypatch.setenv(choice.ENV, str(path))
    monkeypatch.setattr(choice, "device_name", lambda device: "Test GPU")
    dims = {"E": 4, "D": 64, "H": 128, "k": 2}
    cpu = torch.device("cpu")
    assert choice.resolve("moe_mlp", "auto", dims, torch.bfloat16, cpu) == "grouped_mm"
    assert choice.resolve("moe_mlp", "auto", dims, torch.bfloat16, cpu, library_runs=False) == "triton"
    assert choice.resolve("mone", "auto", {"D": 64}, torch.bfloat16, cpu) == "cublas"
    heads = {"E": 24, "D": 768, "d": 64, "k": 12}  # MoE attention: the cost model's form until measured
    assert choice.resolve("moa", "auto", heads, torch.bfloat16, cpu) == "cublas"
    assert choice.resolve("moa", "auto", heads, torch.bfloat16, cpu, unmeasured="routed") == "routed"
    assert choice.record("moa", heads, torch.bfloat16, "Test GPU", {"cublas": 2.0, "heads": 3.0, "routed": 2.5}) == \
        "cublas"
    assert choice.resolve("moa", "auto", heads, torch.bfloat16, cpu, unmeasured="routed") == "cublas"
    with pytest.raises(ValueError, match="expected some of"):
        choice.record("moa", heads, torch.bfloat16, "Test GPU", {"triton": 1.0})
    assert choice.record("moe_mlp", dims, torch.bfloat16, "Test GPU", {"grouped_mm": 2.0, "triton": 1.5}) == "triton"
    assert choice.resolve("moe_mlp", "auto", dims, torch.bfloat16, cpu) == "triton"
    assert choice.resolve("moe_mlp", "auto", dims, torch.float32, cpu) == "grouped_mm"  # another shape key
    assert choice.resolve("moe_mlp", "grouped_mm", dims, torch.bfloat16, cpu) == "grouped_mm"
    entry = json.loads(path.read_text())["devices"]["Test GPU"][choice.shape_key("moe_mlp", dims, torch.bfloat16)]
    assert entry["backend"] == "triton" and entry["ms"] == {"grouped_mm": 2.0, "triton": 1.5}
    path.write_text("{not json")
    choice._measured.cache_clear()
    with pytest.raises(ValueError, match="choices.json"):
        choice.resolve("moe_mlp", "auto", dims, torch.bfloat16, cpu)
    choice._measured.cache_clear()


def test_a_gpu_of_a_name_that_measured_takes_that_measurement(tmp_path, monkeypatch):
    """`choice.SHIPPED` is what a committed `make gpu-check` measured (the H200 report's kernels rows, winner by
    winner); ``auto`` on a GPU of that name takes it until the machine records its own, which then wins."""
    report = json.loads((ROOT / "reports" / "bench" / "gpu_check_h200" / "gpu_check.json").read_text())
    rows = report["stages"]["kernels"]["rows"]
    gpu = report["environment"]["gpu"]
    assert choice.SHIPPED[gpu] == {choice.shape_key(r["op"], r["dims"], torch.bfloat16): min(r["ms"], key=r["ms"].get)
                                   for r in rows if "ms" in r}
    path = tmp_path / "choices.json"
    monkeypatch.setenv(choice.ENV, str(path))
    monkeypatch.setattr(choice, "device_name", lambda device: gpu)
    choice._measured.cache_clear()
    mone = {"D": 384, "H": 1536, "heads": 6}
    cpu = torch.device("cpu")
    assert choice.resolve("mone", "auto", mone, torch.bfloat16, cpu) == "triton"  # 10.97 against 17.02 ms
    assert choice.resolve("mone", "auto", mone, torch.float32, cpu) == "cublas"  # a shape nobody measured
    assert choice.resolve("mone", "cublas", mone, torch.bfloat16, cpu) == "cublas"  # an explicit key wins
    choice.record("mone", mone, torch.bfloat16, gpu, {"cublas": 1.0, "triton": 2.0})
    assert choice.resolve("mone", "auto", mone, torch.bfloat16, cpu) == "cublas"  # this machine's measurement wins
    monkeypatch.setattr(choice, "device_name", lambda device: "Another GPU")
    choice._measured.cache_clear()
    assert choice.resolve("mone", "auto", mone, torch.bfloat16, cpu) == "cublas"
    choice._measured.cache_clear()


def test_library_runs_follows_what_the_op_takes():
    assert library_runs(torch.device("cpu"), torch.float32, 64, 128) == (library_grouped_mm is not None)
    assert not library_runs(torch.device("cpu"), torch.float64, 64, 128)
    assert not library_runs(torch.device("cpu"), torch.bfloat16, 64, 12)  # 24-byte rows
    assert not library_runs(torch.device("cuda"), torch.float32, 64, 128)  # CUDA: bf16 only
    assert not library_runs(torch.device("meta"), torch.float32, 64, 128)  # meta tensors stand for CUDA ones


@pytest.mark.parametrize("section,value", [("moe", "cutlass"), ("mone", "grouped_mm"), ("moa", "dense")])
def test_kernel_keys_are_checked_with_their_names(section, value):
    with pytest.raises(ConfigError, match=f"model.{section}.kernel"):
        tiny_config(MODEL_CONFIGS[0], [f"model.{section}.kernel={value}"])


BACKENDS = [("grouped_mm", "cublas", "cublas"), ("triton", "triton", "heads"), ("grouped_mm", "cublas", "routed")]


@pytest.mark.slow
@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_every_config_trains_on_each_backend(path):
    """Each shipped config at test widths, one layer deep per kind, on the CUDA path (forced) with each backend (MoE
    MLP, MoNE, MoE attention): a training step gives finite gradients equal across the backends, and evaluation
    (MoNE's inference backends) gives equal outputs."""
    results = []
    for moe, mone, moa in BACKENDS:
        cfg = tiny_config(path, ["model.depth=2", f"model.moe.kernel={moe}", f"model.mone.kernel={mone}",
                                 f"model.moa.kernel={moa}"]).model
        torch.manual_seed(0)
        model = squad.build_model(cfg).train()
        if not any(isinstance(m, ExpertMLP | MoNEBlock | MoEAttention) for m in model.modules()):
            pytest.skip("no MoE MLP, MoE attention or MoNE block: nothing takes a backend")
        x = torch.randn(2, 3, cfg.img_size, cfg.img_size)
        tasks = model.task_names[:2]
        with force_cuda_path():
            torch.manual_seed(1)
            out = model(x, tasks)
            loss = sum(p.float().square().mean() for p in out.preds.values())
            loss.backward()
            with torch.no_grad():
                model.eval()
                preds = model(x, tasks).preds
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert all(torch.isfinite(g).all() for g in grads.values())
        results.append((loss.detach(), grads, preds))
    loss_a, grads_a, preds_a = results[0]
    for loss_b, grads_b, preds_b in results[1:]:
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
        for name, g in grads_a.items():
            torch.testing.assert_close(g, grads_b[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for name, p in preds_a.items():
            torch.testing.assert_close(p, preds_b[name], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_backend_on_a_gpu_matches_the_cpu_algorithm(case, backend):
    """Each expert-GEMM backend in bf16 on the GPU (the library's CUTLASS kernel, squad's Triton kernels) against the
    CPU algorithm in float64."""
    experts, e, leaves, grad = _problem(case, 64, 128)
    leaves, grad = [v.to(torch.bfloat16).double() for v in leaves], grad.to(torch.bfloat16).double()  # same inputs
    want = _run(experts, e, leaves, grad, torch.float64, "cpu", False, backend)
    got = _run(experts, e, leaves, grad, torch.bfloat16, "cuda", False, backend)
    for name, w, g in zip(["y", "dx", "dw1", "db1", "dw2", "db2", "dgates"], want, got, strict=True):
        # bf16 results of sums over up to 40 rows: an H200 gave 2 of 24,576 weight-gradient entries 0.14 off (on
        # values near 30, one bf16 step) against an absolute 0.1; the tolerance scales with the tensor
        torch.testing.assert_close(g.double().cpu(), w, rtol=4e-2, atol=2e-2 * float(w.abs().max()),
                                   msg=lambda msg, n=name: f"{backend} {n}: {msg}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_mone_backend_on_a_gpu_gives_the_same_inference():
    """MoNE inference through the width slices (cuBLAS) and the Triton nested kernels agree in bf16."""
    path = next(p for p in MODEL_CONFIGS if p.stem.startswith("mone"))
    outs = []
    for kernel in ("cublas", "triton"):
        cfg = tiny_config(path, [f"model.mone.kernel={kernel}"]).model
        torch.manual_seed(0)
        model = squad.build_model(cfg).eval().cuda().to(torch.bfloat16)
        x = torch.randn(2, 3, cfg.img_size, cfg.img_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outs.append(model(x.cuda().to(torch.bfloat16), model.task_names[:1]).preds)
    for name, p in outs[0].items():
        torch.testing.assert_close(p.float(), outs[1][name].float(), rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cublas", "heads", "routed"])
def test_each_moa_backend_on_a_gpu_matches_the_cpu_algorithm(backend):
    """MoE attention's three projection backends in float32 on the GPU (plain GEMMs with gathers, the Triton head
    kernels, routed grouped GEMMs) against its CPU algorithm in float32, on one routing: output and every gradient
    (float32: no bf16 route flips, reports/bench/gpu_check_h200)."""
    from squad.config.model import MoAConfig, RouterConfig
    from squad.layers.context import ForwardContext
    from squad.layers.routing import Routing

    torch.manual_seed(0)
    cfg = MoAConfig(num_experts=24, top_k=12, head_dim=64, router=RouterConfig(noise=False))
    ctx = ForwardContext(task_ids=torch.tensor([0, 0, 1]), num_tasks=2, segments=[(0, 0, 2), (1, 2, 3)])
    x0 = torch.randn(3, 197, 256)
    results = []
    for device, kernel in (("cpu", "auto"), ("cuda", backend)):
        torch.manual_seed(1)
        layer = MoEAttention(256, dataclasses.replace(cfg, kernel=kernel), num_tasks=2).to(device)
        if not results:
            with torch.no_grad():
                decided = layer.router(x0, ctx)
        c = ForwardContext(task_ids=ctx.task_ids.to(device), num_tasks=2, segments=ctx.segments)
        gates = decided.gates.to(device).requires_grad_()
        routing = Routing(gates, decided.experts.to(device), decided.probs.to(device))
        layer.router.forward = lambda *a, r=routing: r
        x = x0.to(device).requires_grad_()
        y = layer(x, c)
        leaves = [x, layer.q, layer.kv.weight, layer.o, layer.proj_bias, gates]
        results.append([y, *torch.autograd.grad(y, leaves, torch.linspace(-1, 1, y.numel(), device=device).view_as(y))])
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-4)


def test_cpu_algorithm_ignores_the_backend():
    """Off the CUDA path the key changes nothing: both backends run the CPU algorithm."""
    experts, e, leaves, grad = _problem(CASES[0], 16, 24)
    a = _run(experts, e, leaves, grad, torch.float32, "cpu", False, "grouped_mm")
    b = _run(experts, e, leaves, grad, torch.float32, "cpu", False, "triton")
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_grouped_mm_backend_compiles_to_one_graph_in_bf16():
    """The ``grouped_mm`` backend forward and backward under ``torch.compile(fullgraph=True)`` in bf16 (what the
    library op's meta kernel takes) on the CUDA path: one graph with no host read, eager's outputs and gradients."""
    experts, e, leaves, grad = _problem(CASES[1], 16, 24)

    def step(x, w1, b1, w2, b2, gates):
        plan = plan_dispatch(experts, e, host_sizes=False, noop=True)
        return expert_mlp(x, w1, b1, w2, b2, gates, plan, "grouped_mm")

    results = []
    with force_cuda_path():
        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):  # the backward: AOT autograd's
            ins = [v.to(torch.bfloat16).requires_grad_() for v in leaves]
            y = fn(*ins)
            results.append([y, *torch.autograd.grad(y, ins, grad.to(torch.bfloat16))])
    torch._dynamo.reset()
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
