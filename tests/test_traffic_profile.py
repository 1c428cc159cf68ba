"""The traffic profile of tools/bench.py: the H100 cost model's arithmetic and fit, the profile's rows and table, and
the calibration on 84de653's code (counts are exact and asserted; no timing is)."""

import dataclasses

import pytest
import torch

from squad.bench import costmodel, traffic_profile
from squad.bench.costmodel import CONSTANTS, SMS, CostModel, KernelModel, Measured
from squad.bench.traffic import OpRecord
from squad.bench.traffic import record as record_traffic
from squad.layers.experts.permuted import token_tile

pytest.importorskip("triton")  # the attention rows record squad's Triton wrappers (their launches are not run)

MODEL = CostModel(gemm_tflops=500.0, attention_tflops=250.0, triton_tflops=100.0, bandwidth_tbs=2.0, launch_us=5.0,
                  scatter_penalty=10.0)


def test_each_kernel_costs_the_longer_of_arithmetic_and_bytes_plus_a_launch():
    gemm = OpRecord("mm", flops=1e12, bytes_read=1e9, kind="gemm")  # 2 ms of arithmetic, 0.5 ms of bytes
    copy = OpRecord("add", bytes_read=2e9, bytes_written=2e9)  # 2 ms of bytes
    atomic = OpRecord("index_add_", bytes_written=1e8, atomic=True)  # 0.05 ms × 10
    bag = OpRecord("_embedding_bag_forward_only", bytes_read=1e8)
    triton = OpRecord("triton_fwd_kernel", flops=1e11, kind="triton")  # 1 ms at 100 TFLOP/s
    expected = [2e-3, 2e-3, 0.5e-3, 0.5e-3, 1e-3]
    for record, seconds in zip([gemm, copy, atomic, bag, triton], expected, strict=True):
        assert MODEL.op_seconds(record) == pytest.approx(seconds + 5e-6)
    parts = MODEL.breakdown([gemm, copy, atomic])
    assert parts == pytest.approx({"compute": 2.0, "memory": 2.0, "scatter": 0.5, "launch": 0.015})


def test_the_fit_recovers_constants_that_generated_the_measurements():
    recordings = {
        "gemm": [OpRecord("mm", flops=2e12, bytes_read=1e8, kind="gemm")],
        "copies": [OpRecord("add", bytes_read=4e9, bytes_written=4e9)] * 3,
        "many_small": [OpRecord("add", bytes_read=1e5)] * 400,
        "scatter": [OpRecord("index_add_", bytes_written=5e8, atomic=True), OpRecord("add", bytes_read=1e9)],
        "flash": [OpRecord("flash_attention_forward", flops=5e11, bytes_read=1e8, kind="attention")],
        "triton": [OpRecord("triton_fwd_kernel", flops=5e11, bytes_read=1e8, kind="triton")],
        "mixed": [OpRecord("mm", flops=1e11, kind="gemm"), OpRecord("add", bytes_read=1e9)] * 5,
    }
    truth = CostModel(600.0, 300.0, 150.0, 2.5, 6.0, 15.0)
    cases = [Measured(name, (name,), truth.seconds(recs) * 1e3, "ms", "synthetic") for name, recs in recordings.items()]
    cases.append(Measured("triton_vs_flash", ("triton", "flash"), 2.0, "ratio", "synthetic"))
    fitted = costmodel.fit(recordings, cases)
    for row in costmodel.residual_rows(fitted, recordings, cases):
        assert abs(row["error"]) < 1e-3, row


def test_measured_cases_name_the_recorded_cases_of_the_legacy_script():
    from squad.bench import cuda_path, legacy

    assert {c for m in costmodel.MEASURED_CASES for c in m.cases} <= {
        "moe_mlp", "dense_mlp", "moa", "mqa", "dense_vit_s", "mod_vit_s", "mone_vit_s",
        *(f"attention_{kind}_n{n}" for kind in ("sdpa_fwd", "sdpa_fwd_bwd", "triton_fwd", "triton_fwd_bwd",
                                               "scores_fwd") for n in (197, 1024, 4096))}
    assert set(legacy.old_kernels(cuda_path)) == {
        "_fwd_kernel", "_scores_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"}


def test_profile_rows_counts_and_table():
    rows = [row for layer in traffic_profile.LAYERS for row in traffic_profile.profile_layer(layer)]
    assert len(rows) == 3 * len(traffic_profile.LAYERS)
    by_case = {r.case: r for r in rows}
    dense = by_case["traffic_moe_mlp_bytes_vs_dense_mlp"].details["twin"]
    tokens, d, hidden = 12 * 13 * 197, 768, 4 * 768
    # the fused twin on its own input: 2 forward GEMMs (bias + GELU in the first's epilogue), 4 backward (GELU's
    # derivative and both bias gradients in epilogues); no gradient-accumulation add from the layer's own pass
    assert dense["kernels"] == 6 and dense["host_syncs"] == 0
    assert dense["gflop"] * 1e9 == pytest.approx(3 * 2 * 2 * tokens * d * hidden, rel=1e-3)  # fwd + 2 × bwd
    for layer in traffic_profile.LAYERS:  # the CUDA path's contract: no host sync, no large atomic
        assert by_case[f"traffic_{layer.name}_syncs_and_large_atomics"].value == 0
    moe = by_case["traffic_moe_mlp_bytes_vs_dense_mlp"].details["layer"]
    tiles = 3 * 2 * tokens * d * token_tile(tokens, 4) * 4  # the combine's gate tiles, forward and backward
    assert moe["gflop"] * 1e9 == pytest.approx(dense["gflop"] * 1e9 + tiles, rel=0.02)  # equal active FLOPs (+ the
    # routers and the zeros of the gate tiles)
    sdpa = by_case["traffic_attention_scores_n4096_bytes_vs_sdpa"].details["twin"]
    assert sdpa["kernels"] == 1 and sdpa["gflop"] * 1e9 == 4 * 8 * 12 * 4096 ** 2 * 64
    for r in rows:
        if "(H100 model)" in r.unit:
            ratio = r.details["model_ratio"]
            assert 0 < ratio["low"] <= ratio["central"] == r.value <= ratio["high"]
    for side in ("layer", "twin"):
        for r in rows:
            ms = r.details[side]["model_ms"]
            assert 0 < ms["low"] <= ms["central"] <= ms["high"]
    triton = by_case["traffic_moe_mlp_triton_bytes_vs_dense_mlp"].details["layer"]
    assert triton["by_kind_ms"]["squad_gemm"] > 0 and "squad_gemm" not in dense["by_kind_ms"]  # their own rate
    assert moe["by_kind_ms"]["grouped_gemm"] > 0  # auto: the library's grouped GEMM until a GPU has measured
    assert triton["tile_gbytes"] > 3 * triton["gbytes"]  # the Triton kernels' tiles re-read their inputs
    mone = by_case["traffic_mone_vit_s_bytes_vs_dense_vit_s"].details["layer"]
    assert mone["model_breakdown_ms"]["compute"] > 0
    table = traffic_profile.format_traffic(rows)
    for layer in traffic_profile.LAYERS:
        assert layer.name in table and layer.twin in table
    assert "a MODEL" in table and "low/central/high" in table
    predicted = traffic_profile.predictions(rows)
    assert set(predicted) == {case for layer in traffic_profile.LAYERS
                              for case in (layer.gpu_case, layer.eager_case) if case}
    assert predicted["moe_mlp_fwd_bwd_vs_dense_gpu"]["twin"] == "eager"  # the model prices the fused twin
    assert predicted["moe_mlp_fwd_bwd_vs_compiled_dense_gpu"]["twin"] == "as priced"


@pytest.mark.slow
def test_calibration_on_84de653_reproduces_the_stored_fit():
    """Records 84de653's code (git history) and refits: the stored constants predict what the refit does."""
    from squad.bench import calibrate

    try:
        report = calibrate.fit_report()
    except calibrate.CalibrationUnavailable as e:
        pytest.skip(str(e))
    cases = report["cases"]
    assert cases["moe_mlp"]["host_syncs"] == 1 and cases["moa"]["host_syncs"] == 1  # CUDA's bincount
    assert cases["dense_mlp"]["host_syncs"] == 0 and cases["moe_mlp"]["kernels"] == 186
    assert cases["attention_scores_fwd_n197"]["kernels"] == 4  # forward, score pass, partial sum, divide
    for name, value in report["fitted"].items():  # the fit is deterministic: costmodel.FITTED is its result
        assert report["stored"][name] == pytest.approx(value, rel=0.01), name
    for stored, refit in zip(report["stored_residuals"], report["residuals"], strict=True):
        assert stored["modelled"] == pytest.approx(refit["modelled"], rel=0.02), stored["name"]
    assert max(abs(r["error"]) for r in report["residuals"][:7]) < 0.2  # the absolute H100 times within 20 %
    kernel = report["kernel_model_residuals"]  # the kernel model, not fitted: every measured figure inside its range
    assert [r["name"] for r in kernel] == [m.name for m in costmodel.MEASURED_CASES]
    assert all(r["inside"] for r in kernel), [r for r in kernel if not r["inside"]]


def test_each_gemm_kind_is_priced_at_its_own_rate_and_cuda_core_work_as_such():
    """cuBLAS, the library's grouped GEMM and squad's Triton GEMMs each at their own constant (the Triton kernels not
    at the cuBLAS fit); element-wise work inside a kernel at the CUDA-core rate, added to its tensor-core time."""
    model = KernelModel.at()
    flops = 1e12
    for kind, name in costmodel.RATE_OF_KIND.items():
        t = model.op_seconds(OpRecord("k", flops=flops, kind=kind)) - model.launch_us * 1e-6
        assert t == pytest.approx(flops / (CONSTANTS[name].central * 1e12))
    assert CONSTANTS["squad_gemm_tflops"].slow < CONSTANTS["squad_gemm_tflops"].fast < CONSTANTS["cublas_tflops"].slow
    core = OpRecord("nested_mlp_", flops=flops, kind="squad_gemm", cuda_core_ops=2e11)
    assert model.compute_seconds(core) == pytest.approx(flops / 367e12 + 2e11 / 33.5e12)


def test_the_wave_term_grows_past_one_wave():
    """A grid of P equal programs on 132 SMs runs ceil(P / 132) rounds: 132 programs are one wave, 133 nearly two
    rounds of the work of one (head_wgrad's 144 programs: 1.83x)."""
    assert KernelModel.waves(SMS) == 1.0 and KernelModel.waves(2 * SMS) == 1.0
    assert KernelModel.waves(SMS + 1) == pytest.approx(2 * SMS / (SMS + 1))
    assert KernelModel.waves(144) == pytest.approx(264 / 144)
    model = KernelModel.at()
    one, past = (OpRecord("head_wgrad", flops=1e11, kind="squad_gemm", programs=p) for p in (SMS, SMS + 1))
    assert model.compute_seconds(past) > 1.9 * model.compute_seconds(one)


def test_cuda_core_work_counts_each_hidden_chunks_renormalisation():
    """MoNE's fused MLP normalises a token's w features once per hidden chunk: the CUDA-core count grows with the
    chunks, and a config that normalises once (NORM_ONCE) drops that term."""
    from squad.bench.launches import NORMALISE_OPS, nested_mlp_row_ops

    cfg = {"BLOCK_K": 16, "BLOCK_W": 64, "BLOCK_H": 64}
    d, hidden, width = 384, 1536, 128
    per_chunk = NORMALISE_OPS * width
    ops = nested_mlp_row_ops(width, d, hidden, cfg)
    assert ops - nested_mlp_row_ops(width, d, hidden, {**cfg, "BLOCK_H": 128}) == 12 * per_chunk  # 24 chunks vs 12
    assert ops - nested_mlp_row_ops(width, d, hidden, {**cfg, "NORM_ONCE": True}) == 23 * per_chunk


def test_ranges_hold_every_end_and_every_constant_has_a_source():
    """Times at the fast ends <= central <= the slow ends; a ratio's low / high take each constant at the end that
    moves the ratio that way, so they hold every one-constant variation."""
    for name, c in CONSTANTS.items():
        assert c.source and min(c.fast, c.slow) <= c.central <= max(c.fast, c.slow), name
    layer = [OpRecord("grouped_mm", flops=3e11, bytes_read=4e8, kind="squad_gemm", programs=5000,
                      reloads=[[2e8, 5.0, 9e7]]), OpRecord("add", bytes_read=2e8, bytes_written=1e8)]
    twin = [OpRecord("addmm", flops=3e11, bytes_read=2e8, kind="gemm"),
            OpRecord("flash", flops=1e10, kind="attention")]
    times = costmodel.time_range(layer)
    assert times["low"] < times["central"] < times["high"]
    ratio = costmodel.ratio_range(layer, twin)
    for name in CONSTANTS:
        for end in ("fast", "slow"):
            model = KernelModel.at({name: end})
            value = model.seconds(layer) / model.seconds(twin)
            assert ratio["low"] <= value * (1 + 1e-12) and value <= ratio["high"] * (1 + 1e-12), (name, end)
    far = dataclasses.replace(KernelModel.at(), l2_retention=0.0, l2_mb=10.0)
    assert far.dram_bytes(layer[0]) == 4e8 + 5 * 2e8  # a re-read 90 MB apart misses a 10 MB L2 (LRU)


def test_fused_twins_equal_the_plain_layers_and_record_the_epilogue_kernels():
    """The dense twins with cuBLASLt's epilogues: the same values and gradients as the plain modules (real tensors,
    inside a recording), the MLP in 2 forward + 4 backward kernels with no separate GELU, GELU-backward or bias sum,
    each at its exact bytes; outside a recording the plain forward."""
    from squad.bench.cases import MultiQueryAttention
    from squad.bench.twins import FusedMlp, fuse_dense
    from squad.layers.mlp import Mlp

    torch.manual_seed(0)
    t, d, hidden = 10, 8, 32
    mlp = Mlp(d, hidden).double()
    fused = fuse_dense(mlp)
    assert isinstance(fused, FusedMlp)
    x = torch.randn(2, t // 2, d, dtype=torch.float64, requires_grad=True)
    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *mlp.parameters()])
    grad = 2 * ref.detach()
    recording = record_traffic(lambda: torch.autograd.backward(fused(x), grad))
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs)
    ops = [r.op for r in recording.records]
    assert ops == ["cublaslt_gemm_bias_gelu_aux", "cublaslt_gemm_bias", "cublaslt_gemm_bgradb",
                   "cublaslt_gemm_dgelu_bgrad", "cublas_gemm_wgrad", "cublas_gemm_dgrad"]
    first = recording.records[0]
    assert first.bytes_read == 8 * (t * d + hidden * d + hidden) and first.bytes_written == 8 * 2 * t * hidden
    assert all(r.kind == "gemm" and r.flops == 2 * t * d * hidden for r in recording.records)
    torch.testing.assert_close(fused(x), ref)  # no recorder: the plain module
    with torch.no_grad():
        inference = record_traffic(lambda: fused(x))
    assert [r.op for r in inference.records] == ["cublaslt_gemm_bias_gelu", "cublaslt_gemm_bias"]
    assert inference.records[0].bytes_written == 8 * t * hidden  # no pre-activation kept

    mqa = MultiQueryAttention(d, 2, 4).double()
    x2 = torch.randn(2, 5, d, dtype=torch.float64)
    plain = mqa(x2)
    fuse_dense(mqa)
    with torch.no_grad():
        inside = record_traffic(lambda: mqa(x2))
    assert [r.op for r in inside.records].count("cublaslt_gemm_bias") == 3
    torch.testing.assert_close(mqa(x2), plain)
