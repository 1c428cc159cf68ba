"""The traffic profile of tools/bench.py: the H100 cost model's arithmetic and fit, the profile's rows and table, and
the calibration on 84de653's code (counts are exact and asserted; no timing is)."""

import math

import pytest

from squad.bench import costmodel, traffic_profile
from squad.bench.costmodel import CostModel, Measured
from squad.bench.traffic import OpRecord

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
    assert dense["kernels"] == 11 and dense["host_syncs"] == 0
    assert dense["gflop"] * 1e9 == pytest.approx(3 * 2 * 2 * tokens * d * hidden, rel=1e-3)  # fwd + 2 × bwd
    for layer in traffic_profile.LAYERS:  # the CUDA path's contract: no host sync, no large atomic
        assert by_case[f"traffic_{layer.name}_syncs_and_large_atomics"].value == 0
    moe = by_case["traffic_moe_mlp_bytes_vs_dense_mlp"].details["layer"]
    assert moe["gflop"] == pytest.approx(dense["gflop"], rel=0.02)  # equal active FLOPs (+ the routers)
    sdpa = by_case["traffic_attention_scores_n4096_bytes_vs_sdpa"].details["twin"]
    assert sdpa["kernels"] == 1 and sdpa["gflop"] * 1e9 == 4 * 8 * 12 * 4096 ** 2 * 64
    for r in rows:
        if "(H100 model)" in r.unit:
            assert math.isfinite(r.value) and r.value > 0
    table = traffic_profile.format_traffic(rows)
    for layer in traffic_profile.LAYERS:
        assert layer.name in table and layer.twin in table
    assert "a MODEL" in table
    predicted = traffic_profile.predictions(rows)
    assert set(predicted) == {layer.gpu_case for layer in traffic_profile.LAYERS}


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
