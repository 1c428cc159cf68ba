"""Single-task extraction: exactness at θ = 0, monotone pruning, the saved file (fresh process, no DeepSpeed),
MAC counts of pruned models, and the tool's errors."""

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import squad
from squad.io import export_model, load_extracted, save_extracted
from squad.layers.experts import grouped_mm_flops
from squad.models.pruning import choose_experts, prunable_layers
from squad.posttrain.extract import collect_usage, extract
from tests.helpers import ROOT, tiny_model

HEADS = ["depth_euclidean", "normal", "class_scene"]
PLANS = {
    "moa_moe_mod_noop": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "learned"}],
                             moe={"num_experts": 6, "top_k": 2, "noop_experts": 1, "router": {"noise": True}}),
    "moe_inputs_mone": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"mone": True}], depth=4, task_embed="moe_inputs"),
    "attention_mod": dict(plan=[{"attn": "moa", "mlp": "dense"}, {"attn": "dense", "mlp": "moe", "mod": "attention"}]),
}

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_grouped_mm = torch.ops.aten._grouped_mm  # the routed layers' expert matmuls (squad.layers.experts)


def _cpu_flash_flops(q, k, v, *args, out_val=None, **kwargs):  # QKᵀ and AV, 2 FLOPs per MAC
    b, h, n, d = q.shape
    return 2 * 2 * b * h * n * k.shape[2] * d


@pytest.fixture
def count_cpu_attention():
    """Teaches the FLOP counter the CPU flash-attention and grouped-matmul ops for one test (test_profile registers
    them for good at import; registering twice is an error, so this only fills the gap and leaves no trace)."""
    added = [op for op in (_cpu_flash, _grouped_mm) if op not in flop_registry]
    formulas = {_cpu_flash: _cpu_flash_flops, _grouped_mm: grouped_mm_flops}
    for op in added:
        flop_registry[op] = formulas[op]
    yield
    for op in added:
        del flop_registry[op]


def _calibration(seed=0, batches=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 32, 32, generator=g) for _ in range(batches)]


def _flat_images(seed=0, batches=2):
    """Flat-colour images: their tokens are alike, so each task leaves some experts unused."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(2, 3, 1, 1, generator=g).expand(2, 3, 32, 32) * 2 for _ in range(batches)]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_theta_zero_reproduces_full_model_on_calibration_data(name):
    model = tiny_model(HEADS, **PLANS[name])
    images = _flat_images()
    removed = 0
    for task in ("depth", "class_scene"):
        usage = collect_usage(model, task, images)
        ext = extract(model, task, usage, theta=0.0)
        canonical = squad.tasks.get_task(task).name
        removed += sum(6 - len(kept) for kept in ext.kept.values())
        with torch.no_grad():
            for x in images:
                full = model(x, [canonical]).preds[canonical]
                torch.testing.assert_close(ext(x), full, rtol=1e-5, atol=1e-6)
        assert ext.task == canonical and ext.model.task_names == [canonical]
        assert set(ext.model.heads) == {canonical}
    assert removed > 0  # the equality is not the trivial one of an unpruned model


def test_theta_zero_removes_unused_experts_and_keeps_used_ones():
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", _calibration())
    ext = extract(model, "depth", usage, theta=0.0)
    freqs = usage.frequencies("depth_euclidean")
    for layer, kept in ext.kept.items():
        e = prunable_layers(model)[layer].num_experts
        used = [i for i in range(e) if freqs[layer][i] > 0]
        assert kept == used, layer


def test_parameters_fall_monotonically_with_theta():
    model = tiny_model(HEADS)
    usage = collect_usage(model, "normal", _calibration(batches=2))
    thetas = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.9]
    params = [squad.profile(extract(model, "normal", usage, theta=t).model)["params"] for t in thetas]
    assert all(a >= b for a, b in zip(params, params[1:], strict=False)), params
    assert params[0] > params[-1], params
    full = squad.profile(model)["params"]
    assert params[0] < full  # other tasks' heads and router rows are gone
    shares = [1.0, 0.75, 0.5, 0.25, 0.01]
    kept = [squad.profile(extract(model, "normal", usage, keep_top=h).model)["params"] for h in shares]
    assert all(a >= b for a, b in zip(kept, kept[1:], strict=False)), kept
    top = choose_experts(usage.frequencies("normal", ("moe", "moa")), keep_top=0.01)
    assert all(len(v) == 1 for v in top.values())  # at least one expert per layer always stays


def test_top_k_shrinks_when_fewer_experts_remain():
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", _calibration())
    ext = extract(model, "depth", usage, keep_top=0.1)  # one expert of six per layer
    for layer in prunable_layers(ext.model).values():
        assert layer.num_experts == 1 and layer.router.top_k == 1
    with torch.no_grad():
        assert ext(torch.randn(2, 3, 32, 32)).shape == (2, 1, 32, 32)


@pytest.mark.parametrize("renormalize", [False, True])
def test_profile_macs_of_pruned_models_match_flop_counter(renormalize, count_cpu_attention):
    # no MoD here: its router's cost is MoD's business (test_profile); this checks the pruned layers' counts
    model = tiny_model(HEADS, plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe"}])
    usage = collect_usage(model, "depth", _calibration())
    ext = extract(model, "depth", usage, theta=0.3, renormalize=renormalize)
    assert any(layer.num_experts < 6 for layer in prunable_layers(ext.model).values())
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        ext(torch.randn(1, 3, 32, 32))
    assert squad.profile(ext.model)["tasks"]["depth_euclidean"]["macs"] == counter.get_total_flops() // 2


def test_renormalized_routing_softmaxes_over_kept_experts():
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", _calibration())
    ext = extract(model, "depth", usage, theta=0.2, renormalize=True)
    layer = next(iter(prunable_layers(ext.model).values()))
    assert layer.router.kept is None and layer.router.num_experts == layer.num_experts
    ctx = squad.layers.routing.ForwardContext(torch.zeros(1, dtype=torch.long), 1)
    routing = layer.router(torch.randn(1, 5, 32), ctx)
    torch.testing.assert_close(routing.probs.sum(-1), torch.ones(5))


def test_renormalized_extraction_round_trips_through_its_file(tmp_path):
    model = tiny_model(HEADS)
    ext = extract(model, "depth", collect_usage(model, "depth", _calibration()), theta=0.2, renormalize=True)
    back = load_extracted(save_extracted(tmp_path / "depth.pt", ext))
    assert not back.exact and back.kept == ext.kept
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(back(x), ext(x))


@pytest.mark.slow
def test_saved_file_loads_in_a_fresh_process_without_deepspeed(tmp_path):
    model = tiny_model(HEADS)
    images = _calibration()
    ext = extract(model, "normal", collect_usage(model, "normal", images), theta=0.05)
    path = save_extracted(tmp_path / "normal.pt", ext)
    x = images[0]
    with torch.no_grad():
        torch.save(ext(x), tmp_path / "expected.pt")
    torch.save(x, tmp_path / "x.pt")
    code = (f"import sys, torch, squad\n"
            f"m = squad.load_extracted({str(path)!r})\n"
            f"x = torch.load({str(tmp_path / 'x.pt')!r})\n"
            f"with torch.no_grad():\n    y = m(x)\n"
            f"assert torch.equal(y, torch.load({str(tmp_path / 'expected.pt')!r}))\n"
            f"assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
            f"print('ok', tuple(y.shape))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ok (4, 3, 32, 32)" in res.stdout
    payload = torch.load(path, weights_only=True)
    assert payload["task"] == "normal" and payload["kept"] == ext.kept


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "model.pt"
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", _calibration())
    export_model(path, model, usage, {"trained_tasks": HEADS})
    return path


def test_extract_tool_writes_model_and_report(tmp_path, model_file, tiny_data, load_tool, capsys):
    tool = load_tool("tools/extract.py")
    out = tmp_path / "depth.pt"
    assert tool.main(["--checkpoint", str(model_file), "--task", "depth", "--theta", "0.05", "--data",
                      str(tiny_data), "--calib-batches", "2", "--eval-batches", "1", "--batch-size", "2", "--out",
                      str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["metrics"]["images"] == 2  # the images scored (1 batch of 2), not the split's 4
    printed = capsys.readouterr().out
    assert "(2 images)" in printed and "experts kept per layer" in printed
    assert report["task"] == "depth_euclidean" and report["usage"]["kind"] == "calibration"
    assert report["params"]["extracted"] < report["params"]["full"]
    assert set(report["metrics"]["full"]) == set(report["metrics"]["extracted"]) and "rmse" in report["metrics"]["full"]
    assert set(report["layers"]) == {"blocks.0.attn", "blocks.0.mlp", "blocks.1.block.mlp"}
    ext = squad.load_extracted(out)
    assert not ext.training and not squad.load(out).training  # eval mode, like every model squad.load returns
    assert ext(torch.randn(1, 3, 32, 32)).shape == (1, 1, 32, 32)
    # saved statistics instead of a calibration pass
    assert tool.main(["--checkpoint", str(model_file), "--task", "depth", "--saved-usage", "--out",
                      str(tmp_path / "saved.pt")]) == 0
    assert json.loads((tmp_path / "saved.json").read_text())["usage"]["kind"] == "saved statistics"


@pytest.mark.parametrize("args, message", [
    (["--task", "no_such_task"], "unknown task 'no_such_task': this model has depth_euclidean, normal, class_scene"),
    (["--task", "keypoints2d"], "unknown task 'keypoints2d'"),
    (["--task", "normal"], "saw no tokens of task 'normal'"),
    (["--task", "depth", "--theta", "1.0"], "theta must be in [0, 1)"),
    (["--task", "depth", "--theta", "-0.1"], "theta must be in [0, 1)"),
    (["--task", "depth", "--keep-top", "0"], "keep_top must be in (0, 1]"),
    (["--task", "depth", "--keep-top", "1.5"], "keep_top must be in (0, 1]"),
])
def test_extract_tool_rejects_bad_arguments(model_file, args, message, load_tool, capsys):
    assert load_tool("tools/extract.py").main(["--checkpoint", str(model_file), "--saved-usage", *args]) == 2
    assert message in capsys.readouterr().err


def test_extract_tool_rejects_checkpoints_of_other_models(tmp_path, model_file, load_tool, capsys):
    tool = load_tool("tools/extract.py")
    plain = tmp_path / "plain.pth"  # e.g. a timm state dict
    torch.save({"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}, plain)
    other = tmp_path / "other.pt"  # a squad file whose weights belong to a wider model
    payload = torch.load(model_file, weights_only=True)
    big = tiny_model(HEADS, embed_dim=64)
    payload["state_dict"] = big.state_dict()
    torch.save(payload, other)
    extracted = tmp_path / "ext.pt"
    args = ["--checkpoint", str(model_file), "--task", "depth", "--saved-usage", "--out", str(extracted)]
    assert tool.main(args) == 0
    capsys.readouterr()
    cases = [(plain, "not a squad model file"), (other, "has shape"), (extracted, "is an extracted single-task model"),
             (tmp_path / "missing.pt", "not found"), (tmp_path, "holds no model.pt")]
    for path, message in cases:
        assert tool.main(["--checkpoint", str(path), "--task", "depth", "--saved-usage"]) == 2, path
        assert message in capsys.readouterr().err, path
    with pytest.raises(ValueError, match="full multi-task model file"):
        load_extracted(model_file)
