"""The training-step benchmark and the capacity plan (issue 20): `squad.bench.step` (tools/bench.py --only
train_step) and `squad.bench.plan` (tools/bench.py --plan). No assertion on a timing: the tests check what the rows
and the plan hold and the arithmetic that connects them.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import squad
from squad.analysis.flops import backbone_macs, profile
from squad.bench import step as bench_step
from squad.bench.plan import capacity_plan, dataset_images, format_plan
from tests import test_profile  # noqa: F401 - registers FLOP formulas (CPU flash attention, grouped_mm)
from tests.helpers import ROOT, run_command, tool_env
from tests.test_shared_rows import _model

TOOL = ROOT / "tools/bench.py"


def _tool(*args, cwd):
    return run_command([sys.executable, str(TOOL), *args], cwd, tool_env(), 600)


# ---------------------------------------------------------------------------------------------- step MACs
def test_step_macs_count_shared_blocks_once():
    tasks = ["a", "b", "c"]
    mtl = _model("dense_mtl")
    prof = profile(mtl, tasks)
    bb = backbone_macs(mtl)
    heads = sum(prof["tasks"][t]["macs"] - bb for t in tasks)
    assert bench_step.step_macs(mtl, tasks) == bb + heads  # one backbone pass, three heads
    routed = _model("every_block_embedding")  # every block task-specific: a backbone pass per task
    assert bench_step.step_macs(routed, tasks) == sum(e["macs"] for e in profile(routed, tasks)["tasks"].values())
    for model in (mtl, routed):
        single = bench_step.step_macs(model, ["b"])
        assert single == profile(model, ["b"])["tasks"]["b"]["macs"]


@pytest.mark.parametrize("name", ["dense_mtl", "moa_late"])
def test_step_macs_match_the_fused_forward_flops(name):
    """PyTorch's FLOP counter on the fused forward agrees with the step's MACs: the shared blocks ran once."""
    model = _model(name).eval()
    b, tasks = 3, ["a", "b", "c"]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(b, 3, 32, 32), tasks)
    counted = counter.get_total_flops() / 2 / b
    assert counted == bench_step.step_macs(model, tasks)
    if name == "dense_mtl":  # the old layout ran the backbone three times
        assert counted < 0.5 * len(tasks) * backbone_macs(model)


# ------------------------------------------------------------------------------------------- train_step case
def test_train_step_case_at_quick_sizes(tmp_path):
    out = tmp_path / "bench.json"
    proc = _tool("--quick", "--only", "train_step", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    for name in bench_step.STEP_CONFIGS:
        eager, ckpt = rows[f"train_step_{name}_eager"], rows[f"train_step_{name}_eager_ckpt_blocks"]
        for row in (eager, ckpt):
            d = row["details"]
            assert row["unit"] == "img/s" and row["value"] > 0
            assert 0 < d["mfu"] and d["macs_per_image"] > 0 and d["matmul_flops"] > 0 and d["images"] == 4
            assert math.isclose(row["value"], d["images"] / d["step_s"])
            assert math.isclose(d["mfu"], 6 * d["macs_per_image"] * d["images"] / d["step_s"] / d["matmul_flops"])
            assert d["width"].startswith("shrunken") and d["dtype"] == "float32"
        assert ckpt["details"]["activation_checkpointing"] == "blocks"
        # at these tiny widths the optimizer step (parameter-sized temporaries) can set the peak
        assert ckpt["details"]["peak_memory_bytes"] <= eager["details"]["peak_memory_bytes"]
    assert rows["train_step_modsquad_vit_b_mfu"]["unit"] == "MFU"
    ratio = rows["train_step_mtl_vit_b_13_tasks_vs_1_task"]
    assert ratio["unit"] == "x time" and ratio["value"] > 0 and ratio["target"] == "<= 2"
    shared = rows["train_step_mtl_vit_b_shared_vs_copied_rows"]
    assert shared["unit"] == "x faster" and shared["value"] > 0 and shared["target"] == ">= 5"


def test_copied_rows_baseline_is_the_old_layout():
    """The shared-rows row's baseline computes what the model computes, with the rows copied per task."""
    model = _model("dense_mtl").eval()
    images = torch.randn(3, 3, 32, 32)
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    with torch.no_grad():
        old = bench_step.copied_rows_forward(model, images, ["a", "b", "c"])
        new = model(images, ["a", "b", "c"])
    hook.remove()
    assert seen == [9, 3]
    for t in "abc":
        assert torch.equal(old.preds[t], new.preds[t]) and torch.equal(old.image_index[t], new.image_index[t])


def test_failed_compile_is_a_row_saying_why(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("inductor says no\nmore lines")

    monkeypatch.setattr(torch, "compile", broken)
    cfg, loss = bench_step.load_step_config("mtl_vit_b", bench_step.QUICK_WIDTH + ["model.depth=1"])
    setups = [bench_step.StepSetup(cfg, loss, 2, torch.device("cpu"), torch.float32, compiled=c) for c in (True, False)]
    (failed, ok), rate = bench_step.measure_steps(setups, repeats=1, warmup=0, tasks=["depth_euclidean"], quick=True)
    assert failed == "RuntimeError: inductor says no"
    assert isinstance(ok, bench_step.StepResult) and ok.peak_bytes > ok.resident_bytes > 0
    assert rate["flops"] > 0 and rate["n"] == 512 and ok.matmul_flops == rate["flops"]


@pytest.mark.slow
def test_compiled_step_runs():
    """torch.compile of a tiny dense step on the CPU (inductor); its peak memory is not followed on the CPU."""
    cfg, loss = bench_step.load_step_config("mtl_vit_b", bench_step.QUICK_WIDTH + ["model.depth=1"])
    setup = bench_step.StepSetup(cfg, loss, 2, torch.device("cpu"), torch.float32, compiled=True,
                                 checkpointing="blocks")
    (res,), _ = bench_step.measure_steps([setup], repeats=1, warmup=0, tasks=["depth_euclidean", "normal"], quick=True)
    assert isinstance(res, bench_step.StepResult), res
    assert res.images_per_s > 0 and res.peak_bytes is None


# ------------------------------------------------------------------------------------------------------- plan
def test_plan_of_a_local_dataset(tmp_path, tiny_data):
    out = tmp_path / "plan.json"
    proc = _tool("--plan", str(ROOT / "configs/demo.yaml"), "--gpus", "3", "--batch-per-gpu", "4", "--epochs", "5",
                 "--quick", "--set", f"data.root={tiny_data}", "--set", "data.tasks=[depth_euclidean, normal]",
                 "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "capacity plan (ESTIMATE)" in proc.stdout and "loader must sustain" in proc.stdout
    plan = json.loads(out.read_text())["plan"]
    e, m = plan["estimate"], plan["measured"]
    assert plan["gpus"] == 3 and plan["batch_per_gpu"] == 4 and plan["tasks"] == 2
    assert e["dataset_images"] == 24 and e["dataset_source"].startswith("counted")
    assert e["steps_per_epoch"] == 24 // (3 * 4) and e["total_steps"] == 10 and e["epochs"] == 5
    assert math.isclose(e["wall_s"], 10 * e["step_s"])
    assert math.isclose(e["images_per_s"], 3 * 4 / e["step_s"]) and e["files_per_image"] == 3
    assert math.isclose(e["loader_files_per_s"], 3 * e["images_per_s"])
    assert e["memory_per_gpu_bytes"] == pytest.approx(e["model_state_bytes"] + e["activation_bytes"])
    assert m["images"] == 4 and m["step_s"] > 0 and m["activation_bytes"] > 0
    with pytest.raises(ValueError, match="24 training images are fewer than one batch"):
        capacity_plan(ROOT / "configs/demo.yaml", 2, overrides=[f"data.root={tiny_data}"], quick=True)


def test_plan_of_the_paper_run_at_tiny_size():
    plan = capacity_plan(ROOT / "configs/taskonomy/modsquad_vit_b.yaml", 240, quick=True)
    e = plan["estimate"]
    assert plan["global_batch"] == 2880 and plan["zero_stage"] == 1 and e["epochs"] == 100
    assert e["dataset_images"] == round(4_000_000 * 344 / 537) and "estimate" in e["dataset_source"]
    assert e["steps_per_epoch"] == e["dataset_images"] // 2880 and e["total_steps"] == 100 * e["steps_per_epoch"]
    # the config's own MACs: 13 tasks × ~19.5 GMACs per image (Table 2's figure, counted by squad.profile)
    assert 13 * 19e9 < e["macs_per_image"] < 13 * 20e9
    # step time scaled from the measured one at equal FLOP rate
    m = plan["measured"]
    rate = 6 * m["macs_per_image"] * m["images"] / m["step_s"]
    assert math.isclose(e["step_s"], 6 * e["macs_per_image"] * 12 / rate)
    # fp32 on the CPU, ZeRO-1 over 240: 4 + 4 + 8/240 bytes per parameter
    assert math.isclose(e["model_state_bytes"], e["params"] * (8 + 8 / 240))
    text = format_plan(plan)
    assert "240 devices like this one" in text and "not included" in text and "days" in text


def test_plan_bad_input(tmp_path):
    proc = _tool("--plan", str(ROOT / "configs/demo.yaml"), "--gpus", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--gpus must be >= 1" in proc.stderr
    proc = _tool("--plan", str(tmp_path / "none.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and "no such config file" in proc.stderr
    with pytest.raises(ValueError, match="model config"):
        capacity_plan(ROOT / "configs/model/mtl_vit_b.yaml", 8, quick=True)
    cfg = squad.load_config(ROOT / "configs/taskonomy/modsquad_vit_b.yaml", ["data.split_csv=mine.csv"])
    with pytest.raises(ValueError, match="--images"):
        dataset_images(cfg)
    assert dataset_images(cfg, 1000) == (1000, "--images")


def test_compile_probe_sorts_kernels_and_prints_both_modes():
    """`squad.bench.compile_probe` (the GPU diagnostic of a compiled step that loses time): device kernels sorted
    into kinds by name, the way the profiler names them on a GPU, and both modes side by side in its text."""
    from squad.bench.compile_probe import ModeReport, format_reports, kernel_kind

    kinds = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>": "attention: flash",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80": "attention: mem-efficient",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention: cuDNN",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float>": "softmax (ATen)",
        "_grouped_mm_kernel": "squad Triton kernels",
        "triton_red_fused__to_copy_add_native_layer_norm_3": "inductor Triton kernels",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM (cuBLAS / CUTLASS)",
        "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NTN": "GEMM (cuBLAS / CUTLASS)",
        "void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>": (
            "index / scatter / gather (ATen)"),
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": (
            "elementwise / copy / reduce (ATen)"),
        "Memcpy HtoD (Pageable -> Device)": "other",
    }
    for name, kind in kinds.items():
        assert kernel_kind(name) == kind, name
    eager = ModeReport("eager", 100.0, 13.0, {"attention: flash": 10.0}, [("flash_fwd", 10.0, 6)])
    compiled = ModeReport("compiled", 200.0, 16.4, {"softmax (ATen)": 30.0, "attention: flash": 1.0},
                          [("softmax", 30.0, 6)], {"frames": 1, "graphs": 1, "graph_breaks": 0, "recompiles": 0})
    text = format_reports([eager, compiled], "title")
    assert "compiled  step    200.00 ms  peak 16.40 GiB  dynamo: frames 1, graphs 1" in text
    assert "softmax (ATen)" in text and text.index("softmax (ATen)") < text.index("attention: flash       ")
