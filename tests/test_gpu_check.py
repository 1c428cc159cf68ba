"""make gpu-check on a machine without a GPU: the refusal, the stage runner (limits, crashes), the report, the join of
measured GPU rows with the traffic model's figures, and the parsers of its stages' outputs."""

import json
import sys
import textwrap

import pytest
import torch

from squad.bench import gpucheck
from squad.bench.gpucheck import Stage
from tests.helpers import ROOT

WRITE = [sys.executable, "-c", "import json, sys; json.dump({{'status': 'ok', 'stage': sys.argv[1]}}, "
         "open(sys.argv[2], 'w'))"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_the_check_refuses_before_it_starts(tmp_path, load_tool, capsys):
    assert load_tool("tools/gpu_check.py").main(["--out", str(tmp_path / "check")]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "docs/gpu.md" in err
    assert not (tmp_path / "check").exists()


def test_stages_run_in_order_within_their_limits_and_the_report_is_written(tmp_path):
    stages = [Stage("tests", 30), Stage("bench", 1.5), Stage("step", 30), Stage("deepspeed", 30)]
    commands = {"tests": [*WRITE, "tests", "{result}"],
                "bench": [sys.executable, "-c", "import time; time.sleep(30)"],
                "step": [sys.executable, "-c", "raise SystemExit(3)"],
                "deepspeed": [*WRITE, "deepspeed", "{result}"]}
    report = gpucheck.run_check(tmp_path, stages, total_s=120, commands=commands)
    status = {name: r["status"] for name, r in report["stages"].items()}
    assert status == {"tests": "ok", "bench": "timeout", "step": "crashed", "deepspeed": "ok"}
    assert report["stages"]["step"]["returncode"] == 3 and not report["ok"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["tests"]["stage"] == "tests"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| bench | timeout |" in md and "NOT all stages passed" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*gpucheck.FILES, *(f"{s.name}.log" for s in stages)])
    late = gpucheck.run_check(tmp_path / "late", stages, total_s=10, commands=commands)  # too little time left
    assert {r["status"] for r in late["stages"].values()} == {"skipped"}


def test_measured_rows_are_joined_with_the_modelled_figures():
    measured = [
        {"case": "moe_mlp_fwd_bwd_vs_dense_gpu", "value": 2.0, "unit": "x time", "target": "<= 1.3", "ok": False,
         "details": {"candidate_s": 0.004, "baseline_s": 0.002}},
        {"case": "attention_fwd_bwd_n197_vs_sdpa", "value": 1.01, "unit": "x time", "target": "<= 1.02", "ok": True,
         "details": {}},
    ]
    predicted = {"moe_mlp_fwd_bwd_vs_dense_gpu": {"modelled": 2.5, "low": 1.5, "high": 3.5, "traffic_row": "x",
                                                  "unit": "x time (H100 model)"}}
    traffic = [{"case": "traffic_moe_mlp_bytes_vs_dense_mlp", "details": {
        "gpu_case": "moe_mlp_fwd_bwd_vs_dense_gpu", "layer": {"model_ms": {"low": 4.0, "central": 5.0, "high": 6.0}},
        "twin": {"model_ms": {"low": 1.0, "central": 2.0, "high": 3.0}}}}]
    moe, attention = gpucheck.join_predictions(measured, predicted, traffic)
    assert moe["modelled"] == 2.5 and moe["model_error"] == pytest.approx(0.25)
    assert (moe["modelled_low"], moe["modelled_high"], moe["inside"]) == (1.5, 3.5, True)
    assert moe["measured_ms"] == (4.0, 2.0) and moe["modelled_ms"] == (5.0, 2.0)
    assert attention["modelled"] is None and attention["model_error"] is None
    report = gpucheck.assemble({"bench": {"status": "ok", "joined": [moe, attention], "wall_s": 3.0}},
                               {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc"}, 3.0)
    md = gpucheck.markdown(report)
    assert "NVIDIA H100" in md and "| moe_mlp_fwd_bwd_vs_dense_gpu | 2.000 | 2.500 | 1.50–3.50 (inside) | +25 % |" in md
    assert "| 4.00 / 2.00 | 5.00 / 2.00 |" in md


def test_stage_outputs_are_parsed(tmp_path):
    log = textwrap.dedent("""\
        [squad] step 10/60 loss 3.2100 mi 0.0100 lr 1.000e-03 55.0 img/s 3520 tok/s
        [squad] step 60/60 loss 2.5000 mi 0.0090 lr 1.000e-05 410.5 img/s 26272 tok/s
        """)
    assert gpucheck.parse_train_log(log) == {"steps": 60, "total_steps": 60, "final_loss": 2.5, "last_img_s": 410.5,
                                             "best_img_s": 410.5, "finite": True}
    assert gpucheck.parse_train_log("no steps") == {"steps": 0}
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="2"/></testsuites>')
    assert gpucheck.junit_counts(xml) == {"tests": 5, "failures": 1, "errors": 0, "skipped": 2, "passed": 2}


def test_kernel_backends_are_measured_at_the_shipped_shapes_and_reported():
    """The ``kernels`` stage's shapes come from the shipped configs (modsquad_vit_b's MoE MLP, mone_vit_s), and its
    rows (milliseconds per backend, the choice ``auto`` will take) reach the markdown report."""
    from squad.bench import backends

    assert "modsquad_vit_b" in backends.moe_shapes()[(16, 768, 768, 4)]
    assert "mone_vit_s" in backends.mone_configs()
    assert [s.name for s in gpucheck.STAGES][:2] == ["tests", "kernels"]  # measured before the bench runs `auto`
    rows = [{"op": "moe_mlp", "dims": {"E": 16, "D": 768, "H": 768, "k": 4}, "configs": ["modsquad_vit_b"],
             "ms": {"grouped_mm": 1.0, "triton": 2.0}, "choice": "grouped_mm"},
            {"op": "mone", "dims": {"D": 384, "H": 1536, "heads": 6}, "configs": ["mone_vit_s"], "error": "OOM"}]
    report = gpucheck.assemble({"kernels": {"status": "failed", "rows": rows, "choices": "/c.json"}}, {}, 1.0)
    md = gpucheck.markdown(report)
    assert "| moe_mlp | E16,D768,H768,k4 | modsquad_vit_b | grouped_mm 1.000, triton 2.000 | grouped_mm |" in md
    assert "| mone | D384,H1536,heads6 | mone_vit_s | OOM | — |" in md and "/c.json" in md


def test_moa_backends_are_timed_on_one_routing_at_the_shipped_shapes():
    """The ``kernels`` stage times MoE attention's three backends (``model.moa.kernel``) at every shipped config's
    (E, D, d, k), each forward + backward on the same routing; the same code runs here on the CPU with the CUDA path
    forced (a call counter for the timer), so a GPU session meets no untried code."""
    from squad.bench import backends
    from squad.kernels.device import force_cuda_path

    shapes = backends.moa_shapes()
    assert "modsquad_vit_b" in shapes[(24, 768, 64, 12)] and "moe_attn_only_vit_b" in shapes[(24, 768, 64, 12)]
    assert "modsquad_vit_s" in shapes[(15, 384, 64, 6)]
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return float(len(calls))

    with force_cuda_path():
        ms = backends._moa_times(6, 32, 8, 2, images=2, tasks=3, device="cpu", timer=timer)
    assert ms == {"cublas": 1.0, "heads": 2.0, "routed": 3.0}


def test_measure_records_each_shape_and_keeps_going_past_a_failing_one(tmp_path, monkeypatch):
    """`backends.measure` with the GPU's timings stubbed: one row per shipped shape of each op, each winner written
    to the choice file, a shape that fails reported in its row while the others are recorded."""
    import json

    import torch

    from squad.bench import backends

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Test GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(backends, "_moe_times", lambda *a: {"grouped_mm": 2.0, "triton": 1.0})
    monkeypatch.setattr(backends, "_moa_times", lambda *a: {"cublas": 1.0, "heads": 3.0, "routed": 2.0})

    def oom(name):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(backends, "_mone_times", oom)
    path = tmp_path / "choices.json"
    rows = backends.measure(path)
    assert [r["op"] for r in rows] == ["moe_mlp"] * len(backends.moe_shapes()) + ["moa"] * len(
        backends.moa_shapes()) + ["mone"] * len(backends.mone_configs())
    assert {r["choice"] for r in rows if r["op"] == "moe_mlp"} == {"triton"}
    assert {r["choice"] for r in rows if r["op"] == "moa"} == {"cublas"}
    assert all(r["error"] == "RuntimeError: CUDA out of memory" and "choice" not in r for r in rows
               if r["op"] == "mone")
    recorded = json.loads(path.read_text())["devices"]["Test GPU"]
    assert len(recorded) == len(backends.moe_shapes()) + len(backends.moa_shapes())


def test_a_stage_stopped_at_its_limit_takes_what_it_started_along_and_keeps_its_log(tmp_path):
    """At the limit the stage's whole process group is stopped (a launcher's ranks would hold the GPU into the next
    stage) and what it printed before is in its log (`gpucheck.stream` prints a command's lines as they come)."""
    marker = tmp_path / "grandchild-lived"
    (tmp_path / "rank.py").write_text(textwrap.dedent(f"""\
        import pathlib, subprocess, sys, time
        print("rank 0 starting", flush=True)
        time.sleep(3)
        pathlib.Path({str(marker)!r}).touch()
        """))
    (tmp_path / "stage.py").write_text(textwrap.dedent(f"""\
        import sys
        from squad.bench.gpucheck import stream
        stream([sys.executable, {str(tmp_path / "rank.py")!r}])
        """))
    report = gpucheck.run_check(tmp_path, [Stage("deepspeed", 1.5)], total_s=60,
                                commands={"deepspeed": [sys.executable, str(tmp_path / "stage.py")]})
    assert report["stages"]["deepspeed"]["status"] == "timeout"
    assert "rank 0 starting" in (tmp_path / "deepspeed.log").read_text()
    import time

    time.sleep(3.5)
    assert not marker.exists()


def test_only_runs_the_stages_named_and_judges_them_alone(tmp_path, load_tool, capsys):
    tool = load_tool("tools/gpu_check.py")
    assert tool.main(["--only", "tests,warp", "--out", str(tmp_path / "c")]) == 2
    assert "unknown stage(s) warp" in capsys.readouterr().err and not (tmp_path / "c").exists()
    report = gpucheck.run_check(tmp_path, [Stage("tests", 30)], total_s=60,
                                commands={"tests": [*WRITE, "tests", "{result}"]})
    assert report["ok"] and list(report["stages"]) == ["tests"]
    assert not gpucheck.assemble({"tests": {"status": "ok"}}, {}, 1.0)["ok"]  # all stages by default


def test_rejoin_prices_a_committed_report_by_the_model_of_its_gpu(tmp_path, load_tool, capsys):
    """No GPU needed: the H200's committed report joined again with today's model for an H200 (its own constants,
    `costmodel.GPU_CONSTANTS`); a report without bench rows, or no JSON at all, is refused naming the file."""
    from squad.bench import costmodel

    tool = load_tool("tools/gpu_check.py")
    report = ROOT / "reports" / "bench" / "gpu_check_h200" / "gpu_check.json"
    assert tool.main(["--rejoin", str(report), "--out", str(tmp_path / "r")]) == 0
    again = json.loads((tmp_path / "r" / "gpu_check.json").read_text())
    assert again["rejoined"]["model_gpu"] == again["stages"]["bench"]["model_gpu"] == "H200"
    moe = next(j for j in again["stages"]["bench"]["joined"] if j["case"] == "moe_mlp_fwd_bwd_vs_dense_gpu")
    assert moe["measured"] == pytest.approx(1.787, abs=1e-3) and moe["modelled_low"] < moe["modelled"]
    assert "beside the H200 cost model" in (tmp_path / "r" / "gpu_check.md").read_text()
    (tmp_path / "empty.json").write_text(json.dumps({"environment": {"gpu": "NVIDIA H200"}, "stages": {}}))
    assert tool.main(["--rejoin", str(tmp_path / "empty.json"), "--out", str(tmp_path / "e")]) == 2
    assert "no measured bench rows" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert tool.main(["--rejoin", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a readable gpu_check.json" in capsys.readouterr().err
    # the H200's model: the H100's but for its memory; a memory-bound kernel is priced faster there
    assert costmodel.gpu_model_name("NVIDIA H200") == "H200" and costmodel.gpu_model_name("NVIDIA H100 80GB") == "H100"
    h100, h200 = costmodel.KernelModel.at(), costmodel.KernelModel.at(gpu="H200")
    assert h200.bandwidth_tbs > h100.bandwidth_tbs and h200.cublas_tflops == h100.cublas_tflops
    with pytest.raises(ValueError, match="no cost model for GPU 'A100'"):
        costmodel.constants_for("A100")


@pytest.mark.parametrize("case", ["moe_mlp", "moa", "mone"])
def test_gpu_bench_rows_time_each_routed_one_against_its_eager_and_compiled_twin(case):
    """The ``bench`` stage's MoE MLP, MoE attention and MoNE cases (MoD's share MoNE's code), run here on the CPU
    with the CUDA path forced, at the tests' widths (the ``aot_eager`` backend: dynamo's graphs, no code generation):
    the eager row, the row against the compiled twin (the twin the cost model prices: it carries the target) and the
    both-compiled row; the traffic profile predicts the compiled-twin row and the eager one, marked as such. On the
    CPU the rows' names lack the GPU rows' ``_gpu``."""
    from squad.bench import cases, traffic_profile
    from squad.kernels.device import force_cuda_path
    from tests.helpers import TINY

    tiny = [*TINY, "model.head_dim=null"]
    with force_cuda_path():
        if case == "mone":
            mone = cases._build("mone_vit_s", tiny).eval()
            dense = cases._build("mod_vit_s", [*tiny, "model.plan=[{attn: dense, mlp: dense}]",
                                               "model.task_embed=none"]).eval()
            rows = cases._forward_speedup("mone_vit_s_forward_vs_dense", mone, dense, ">= 1.7", True, "cpu",
                                          compiled="both", compile_backend="aot_eager")
        else:
            bench = {"moe_mlp": cases.bench_moe_mlp_gpu, "moa": cases.bench_moa_gpu}[case]
            rows = bench(quick=True, device="cpu", compiled="both", overrides=tiny, compile_backend="aot_eager")
    name, twin = {"moe_mlp": ("moe_mlp_fwd_bwd", "dense"), "moa": ("moa_fwd_bwd", "mqa"),
                  "mone": ("mone_vit_s_forward", "dense")}[case]
    names = [f"{name}_vs_{twin}", f"{name}_vs_compiled_{twin}", f"compiled_{name}_vs_compiled_{twin}"]
    assert [r.case for r in rows] == names
    unit = "x faster" if case == "mone" else "x time"
    assert all(r.unit == unit and r.value > 0 for r in rows), [(r.case, r.unit, r.details) for r in rows]
    assert [r.target for r in rows] == ["", {"moe_mlp": "<= 1.3", "moa": "<= 1.4", "mone": ">= 1.7"}[case], ""]
    assert rows[1].details["compile_backend"] == "aot_eager"
    layer = next(x for x in traffic_profile.LAYERS if x.name == {"mone": "mone_vit_s"}.get(case, case))
    assert (layer.gpu_case, layer.eager_case) == (names[1] + "_gpu", names[0] + "_gpu")


def test_a_twin_that_fails_to_compile_leaves_the_eager_row(monkeypatch):
    """A compile failure becomes the compiled rows' error, naming the backend; the eager row is still measured."""
    from squad.bench import cases
    from squad.kernels.device import force_cuda_path
    from tests.helpers import TINY

    class Broken(torch.nn.Module):  # what torch.compile gives, failing at its first call as a compile error does
        def __init__(self, module):
            super().__init__()
            self.inner = module

        def forward(self, *args):
            raise RuntimeError("no compiler here")

    def broken(module, backend="inductor"):
        return Broken(module)

    monkeypatch.setattr(cases.torch, "compile", broken)
    with force_cuda_path():
        rows = cases.bench_moe_mlp_gpu(quick=True, device="cpu", compiled="both",
                                       overrides=[*TINY, "model.head_dim=null"])
    assert [r.case for r in rows] == ["moe_mlp_fwd_bwd_vs_dense", "moe_mlp_fwd_bwd_vs_compiled_dense",
                                      "compiled_moe_mlp_fwd_bwd_vs_compiled_dense"]
    assert [r.unit for r in rows] == ["x time", "error", "error"]
    assert "torch.compile (inductor) of the twin: RuntimeError: no compiler here" in rows[1].details["error"]
    with force_cuda_path():  # 'twins' (a GPU's default) leaves the both-compiled row out, 'none' every compiled one
        twins = cases.bench_moa_gpu(quick=True, device="cpu", overrides=[*TINY, "model.head_dim=null"])
        eager = cases.bench_moa_gpu(quick=True, device="cpu", compiled="none", overrides=[*TINY, "model.head_dim=null"])
    assert [r.case for r in twins] == ["moa_fwd_bwd_vs_mqa", "moa_fwd_bwd_vs_compiled_mqa"]
    assert [r.unit for r in twins] == ["x time", "error"] and [r.case for r in eager] == ["moa_fwd_bwd_vs_mqa"]
    with pytest.raises(ValueError, match="compiled='all': expected one of none, twins, both"):
        cases.bench_moa_gpu(quick=True, device="cpu", compiled="all", overrides=[*TINY, "model.head_dim=null"])
