"""tools/bench.py end to end at --quick sizes, and the case registry's error handling (no assertions on timings)."""

import json
import math
import sys
import types

import pytest
import torch

from squad.bench import cases as bench_cases
from squad.timing import BenchResult, time_interleaved
from tests.helpers import ROOT, run_command, tool_env

TOOL = ROOT / "tools/bench.py"
ROW_FIELDS = {"case", "value", "target", "unit", "ok", "details"}


def run_tool(*args, cwd):
    return run_command([sys.executable, str(TOOL), *args], cwd, tool_env(), 300)


@pytest.mark.slow
def test_quick_case_writes_table_and_json(tmp_path):
    out = tmp_path / "res" / "bench.json"
    proc = run_tool("--quick", "--only", "mod", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("case"))
    assert header.split() == ["case", "value", "target", "unit", "ok"]
    assert "mod_vit_s_forward_vs_dense" in proc.stdout
    report = json.loads(out.read_text())
    assert report["quick"] is True
    assert {"torch", "threads", "load_average", "omp_wait_policy", "malloc_tuned"} <= set(report["environment"])
    (row,) = report["results"]
    assert set(row) == ROW_FIELDS
    assert row["case"] == "mod_vit_s_forward_vs_dense" and row["target"] == ">= 1.6" and row["unit"] == "x faster"
    assert isinstance(row["value"], float) and row["value"] > 0 and isinstance(row["ok"], bool)
    assert {"candidate_s", "baseline_s", "batch"} <= set(row["details"])


@pytest.mark.slow
def test_every_case_at_quick_sizes_in_one_run(tmp_path):
    """The README's ``python tools/bench.py`` (every case, one invocation) at --quick sizes: no case errors, the table
    and the traffic table reach stdout, the JSON goes where --json says and nothing else is written where it runs."""
    work, out = tmp_path / "work", tmp_path / "out" / "all.json"
    work.mkdir()
    proc = run_command([sys.executable, str(TOOL), "--quick", "--json", str(out)], work, tool_env(),
                       1200)  # ~2.5 min of CPU; 11 min on a 2-core machine at load 14
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR" not in proc.stdout and "traffic profile" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert all(r["unit"] != "error" for r in rows), [r for r in rows if r["unit"] == "error"]
    cases = [r["case"] for r in rows]
    for prefix in ("moe_mlp", "moa", "fused_13_task", "train_step", "mod_vit_s", "mone_vit_s", "routed_attention",
                   "traffic_", "hdf5", "engine", "extract_"):
        assert any(c.startswith(prefix) for c in cases), prefix
    assert list(work.iterdir()) == []


@pytest.mark.slow
def test_no_json_unless_asked_and_profile(tmp_path):
    proc = run_tool("--profile", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "modsquad_vit_b" in proc.stdout and "GMACs" in proc.stdout and "wrote" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # the table went to stdout; no unasked bench.json
    out = tmp_path / "profile.json"
    assert run_tool("--profile", "--json", str(out), cwd=tmp_path).returncode == 0
    report = json.loads(out.read_text())
    assert report["results"] == []
    names = [r["config"] for r in report["profile"]]
    assert names == bench_cases.PROFILE_CONFIGS


@pytest.mark.slow
def test_unknown_case_is_rejected(tmp_path):
    proc = run_tool("--only", "no_such_case", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no_such_case" in proc.stderr and "moe_mlp" in proc.stderr


def test_missing_or_failing_case_becomes_error_row():
    missing = bench_cases.Case("ghost", "squad.no_such_module:bench")
    (row,) = bench_cases.run_case(missing, quick=True)
    assert row.case == "ghost" and row.unit == "error" and row.ok is False and math.isnan(row.value)
    assert "squad.no_such_module" in row.details["error"]

    broken = bench_cases.Case("broken", "squad.bench.cases:get_case")  # raises: wrong arguments for a case
    (row,) = bench_cases.run_case(broken, quick=True)
    assert row.unit == "error" and "TypeError" in row.details["error"]

    table = bench_cases.format_table([row, BenchResult("fine", 1.0, "<= 2", "x time", True)])
    assert "ERROR" in table and "broken: TypeError" in table and "yes" in table
    assert bench_cases.result_dict(row)["value"] is None


def test_registry_names_every_case_once():
    names = bench_cases.case_names()
    assert len(names) == len(set(names))
    assert {"moe_mlp", "moa", "fused_step", "mod", "mone", "routed_attention", "data"} <= set(names)
    with pytest.raises(ValueError, match="known"):
        bench_cases.get_case("nope")


def test_device_option_and_gpu_name_in_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_tool("--quick", "--only", "mod", "--device", "cpu", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "device: cpu" in proc.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["device_name"] == "cpu"
    assert report["results"][0]["case"] == "mod_vit_s_forward_vs_dense"  # the CPU row, as before


def test_compiled_option_reaches_the_cases(tmp_path):
    """``--compiled`` reaches the cases that take it (on the CPU, mod and mone: ``none`` times the eager pair through
    the paired rows, which name the compile backend they would use); a value outside its choices is refused."""
    out = tmp_path / "bench.json"
    proc = run_tool("--quick", "--only", "mod", "--device", "cpu", "--compiled", "none", "--json", str(out),
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["results"]
    assert row["case"] == "mod_vit_s_forward_vs_dense" and row["details"]["compile_backend"] == "inductor"
    proc = run_tool("--only", "mod", "--compiled", "all", cwd=tmp_path)
    assert proc.returncode == 2 and "--compiled: invalid choice: 'all'" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_is_a_usage_error(tmp_path):
    proc = run_tool("--quick", "--only", "moe_mlp", "--device", "cuda", cwd=tmp_path)
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


def test_device_reaches_only_the_cases_that_take_it(monkeypatch):
    seen = {}

    def with_device(quick, device="cpu"):
        seen["with"] = device
        return [BenchResult("a", 1.0)]

    def without_device(quick):
        seen["without"] = quick
        return [BenchResult("b", 1.0)]

    module = types.ModuleType("squad_fake_bench_cases")
    module.with_device, module.without_device = with_device, without_device
    monkeypatch.setitem(sys.modules, "squad_fake_bench_cases", module)
    rows = bench_cases.run_case(bench_cases.Case("w", "squad_fake_bench_cases:with_device"), True, "cuda")
    rows += bench_cases.run_case(bench_cases.Case("o", "squad_fake_bench_cases:without_device"), True, "cuda")
    assert [r.case for r in rows] == ["a", "b"] and seen == {"with": "cuda", "without": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["moe_mlp", "moa", "mod", "mone"])
def test_gpu_rows_at_quick_sizes(name):
    """On a GPU each case gives its eager row, and with ``--compiled twins`` (the bench stage's setting, which
    compiles every case's twin) its row against the compiled twin: here the MoE MLP's only, whose twin compiles in
    seconds (the gpu-check tests stage has 120 s for every GPU test)."""
    compiled = "twins" if name == "moe_mlp" else "none"
    rows = [r for r in bench_cases.run_case(bench_cases.get_case(name), quick=True, device="cuda",
                                            options={"compiled": compiled}) if r.case.endswith("_gpu")]
    assert len(rows) == (2 if compiled == "twins" else 1) and "compiled" not in rows[0].case, rows
    assert compiled == "none" or "_vs_compiled_" in rows[1].case
    for row in rows:
        assert row.unit in ("x time", "x faster") and row.value > 0, row
        assert row.details["gpu"] == torch.cuda.get_device_name() and row.details["dtype"] == "bfloat16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_event_timing_orders_work():
    a = torch.randn(2048, 2048, device="cuda")
    small, big = time_interleaved([lambda: a[:256] @ a[:, :256], lambda: a @ a], repeats=5, device="cuda")
    assert 0 < small < big


@pytest.mark.slow
def test_engine_case_sets_the_engine_against_bare_steps(tmp_path):
    """The ``engine`` case at --quick sizes: a short and a long engine run beside bare steps (CPU time; no assertion
    on the figures, only that they are measured and consistent)."""
    out = tmp_path / "bench.json"
    proc = run_tool("--quick", "--only", "engine", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"engine_step_vs_bare", "engine_run_12_steps_vs_bare", "engine_fixed_cpu_s",
                         "engine_fixed_wall_s"}
    step, run = rows["engine_step_vs_bare"], rows["engine_run_12_steps_vs_bare"]
    assert step["target"] == run["target"] == "<= 1.5" and step["unit"] == "x CPU time"
    details = step["details"]
    assert details["bare_cpu_s"] > 0 and details["threads"] == 1
    assert step["value"] == pytest.approx(details["engine_step_cpu_s"] / details["bare_cpu_s"])
    assert run["value"] == pytest.approx(details["run_cpu_s"]["12"] / (12 * details["bare_cpu_s"]))
