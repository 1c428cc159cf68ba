"""tools/export.py: squad models as torch.export programs that run where squad cannot be imported, equal to squad's
outputs; the models it refuses; and ``--format model.pt`` (a checkpoint tag as squad's model.pt).

The programs run in a fresh ``python -I`` whose import system refuses squad (a meta-path blocker) and that checks
afterwards that nothing from the checkout was imported; they are compared there with outputs squad computed here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import squad
from squad.deploy.export import ExportError, export_program, program_info
from squad.io import export_model, save_extracted
from squad.io.checkpoints import load_checkpoint_file
from squad.posttrain.extract import collect_usage, extract
from tests.helpers import ROOT, run_command, tiny_model

HEADS = ["depth_euclidean", "normal", "class_scene"]
PLANS = {  # the model kinds of the tests: a dense MTL ViT, MoD, A-MoD, Mod-Squad (MoE attention + MoE MLP), MoNE
    "dense": dict(plan=[{"attn": "dense", "mlp": "dense"}]),
    "mod": dict(plan=[{"attn": "dense", "mlp": "dense"}, {"attn": "dense", "mlp": "dense", "mod": "learned"}]),
    "amod": dict(plan=[{"attn": "dense", "mlp": "dense"}, {"attn": "dense", "mlp": "dense", "mod": "attention"}]),
    "modsquad": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe"}]),
    "mone": dict(plan=[{"attn": "dense", "mlp": "dense"}, {"mone": True}], depth=4),
}

# Runs in `python -I` (no PYTHONPATH, no script folder on sys.path) with squad's imports refused: loads each program,
# runs it on the saved images and prints the max |diff| against squad's saved outputs, per program and task.
RUNNER = r"""
import importlib.abc, json, sys

class NoSquad(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("squad", "kernels", "tasks", "configs"):
            raise ImportError(f"squad is not installed here ({name})")
        return None

sys.meta_path.insert(0, NoSquad())
import torch

root = sys.argv[1]
result = {}
for name in json.loads(sys.argv[2]):
    net = torch.export.load(f"{root}/{name}.pt2").module()
    case = torch.load(f"{root}/{name}.expected.pt", weights_only=True)
    diffs = {}
    for i, (images, want) in enumerate(case):
        with torch.no_grad():
            got = net(images)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for task in want:
            assert got[task].shape == want[task].shape, (task, got[task].shape, want[task].shape)
            diffs[f"{task}@{images.shape[0]}"] = float((got[task] - want[task]).abs().max())
    result[name] = diffs
def from_checkout(mod):  # a file of the checkout itself (its .venv, where torch lives, is not squad)
    file = str(getattr(mod, "__file__", "") or "")
    return file.startswith(sys.argv[3]) and not file.startswith(sys.prefix)

leaked = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "squad" or from_checkout(mod))
print(json.dumps({"diffs": result, "leaked": leaked}))
"""


def _run_without_squad(folder: Path, names: list[str]) -> dict:
    res = subprocess.run([sys.executable, "-I", "-c", RUNNER, str(folder), json.dumps(names), str(ROOT)],
                         cwd=folder, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["leaked"] == [], f"the runner imported from the checkout: {out['leaked']}"
    return out["diffs"]


def _images(b: int, seed: int) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _save_expected(folder: Path, name: str, model, tasks: list[str], batches=(3, 5, 1)) -> None:
    """squad's own outputs on image batches of several sizes (the program was traced at batch 2)."""
    inner = getattr(model, "model", model)
    case = [(x, inner(x, tasks).preds) for x in (_images(b, seed=10 + b) for b in batches)]
    torch.save(case, folder / f"{name}.expected.pt")


@pytest.fixture(scope="module")
def exported(tmp_path_factory, load_tool) -> tuple[Path, dict[str, list[str]]]:
    """Every kind exported through tools/export.py from the file squad writes for it (model.pt, extracted .pt)."""
    folder = tmp_path_factory.mktemp("export")
    tool = load_tool("tools/export.py")
    tasks = {}
    for name, plan in PLANS.items():
        export_model(folder / f"{name}_model.pt", tiny_model(HEADS, **plan), usage=None)
        assert tool.main(["--checkpoint", str(folder / f"{name}_model.pt"), "--out", str(folder / f"{name}.pt2"),
                          "--check-images", "0"]) == 0
        _save_expected(folder, name, squad.load(folder / f"{name}_model.pt"), list(HEADS))
        tasks[name] = list(HEADS)
    # the README's case: an extracted single-task Mod-Squad model (pruned MoE layers), the one task in the dict
    full = tiny_model(HEADS, **PLANS["modsquad"])
    usage = collect_usage(full, "depth", [_images(4, seed=s) for s in range(2)])
    save_extracted(folder / "depth.pt", extract(full, "depth", usage, keep_top=0.5))
    assert tool.main(["--checkpoint", str(folder / "depth.pt"), "--out", str(folder / "depth.pt2")]) == 0
    _save_expected(folder, "depth", squad.load_extracted(folder / "depth.pt"), ["depth_euclidean"])
    tasks["depth"] = ["depth_euclidean"]
    # a task subset of a full model
    assert tool.main(["--checkpoint", str(folder / "mod_model.pt"), "--tasks", "depth,class_scene",
                      "--out", str(folder / "mod_subset.pt2")]) == 0
    _save_expected(folder, "mod_subset", squad.load(folder / "mod_model.pt"), ["depth_euclidean", "class_scene"])
    tasks["mod_subset"] = ["depth_euclidean", "class_scene"]
    return folder, tasks


def test_programs_run_without_squad_and_equal_its_outputs(exported):
    folder, tasks = exported
    diffs = _run_without_squad(folder, sorted(tasks))
    assert sorted(diffs) == sorted(tasks)
    for name, per_task in diffs.items():
        # every task at batch sizes 3, 5 and 1: the batch dimension is dynamic
        assert sorted(per_task) == sorted(f"{t}@{b}" for t in tasks[name] for b in (1, 3, 5)), name
        worst = max(per_task.values())
        assert worst <= 1e-5, f"{name}: max |program - squad| = {worst:.2e} ({per_task})"


def test_program_records_its_signature(exported):
    folder, _ = exported
    extra = {"squad.json": ""}
    torch.export.load(folder / "depth.pt2", extra_files=extra)
    assert json.loads(extra["squad.json"]) == {"format": "squad.export/1", "tasks": ["depth_euclidean"],
                                               "input": ["B", 3, 32, 32], "dtype": "float32"}


@pytest.mark.slow
def test_program_routes_each_input_like_squad():
    """The MoE program's routing is data dependent: inputs routed differently from the traced example still match."""
    model = tiny_model(HEADS, **PLANS["modsquad"])
    program = export_program(model, ["normal"])
    for seed in range(3):
        x = _images(4, seed=100 + seed) * (1 + seed)
        with torch.no_grad():
            got, want = program.module()(x)["normal"], model(x, ["normal"]).preds["normal"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_static_batch(tmp_path, load_tool):
    export_model(tmp_path / "model.pt", tiny_model(HEADS, **PLANS["dense"]), usage=None)
    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--static-batch", "4",
                      "--out", str(tmp_path / "m.pt2")]) == 0
    program = torch.export.load(tmp_path / "m.pt2")
    assert program_info(program)["input"] == [4, 3, 32, 32]
    with pytest.raises(Exception, match="4"):  # torch.export's input guard names the expected size
        program.module()(_images(3, seed=0))


@pytest.mark.slow
def test_mod_threshold_inference_is_refused(tmp_path, load_tool, capsys):
    model = tiny_model(HEADS, **PLANS["mod"], mod={"capacity": 0.5, "aux_loss": True, "inference": "threshold"})
    export_model(tmp_path / "model.pt", model, usage=None)
    tool = load_tool("tools/export.py")
    code = tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "m.pt2")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "blocks.1" in err and "Mixture-of-Depths" in err and "threshold" in err and "--mod-inference topk" in err
    assert not (tmp_path / "m.pt2").exists()
    # the same model at top-k inference exports
    assert tool.main(["--checkpoint", str(tmp_path / "model.pt"), "--mod-inference", "topk", "--check-images", "2",
                      "--out", str(tmp_path / "m.pt2")]) == 0


def test_bad_requests_are_refused(tmp_path, load_tool, capsys):
    ext = extract(tiny_model(HEADS, **PLANS["dense"]), "depth", None)
    save_extracted(tmp_path / "depth.pt", ext)
    with pytest.raises(ExportError, match="predicts depth_euclidean only"):
        export_program(ext, ["normal"])
    with pytest.raises(ExportError, match="unknown task 'sky'"):
        export_program(tiny_model(HEADS, **PLANS["dense"]), ["sky"])
    with pytest.raises(ExportError, match="squad model"):
        export_program(torch.nn.Linear(2, 2))
    tool = load_tool("tools/export.py")
    for args, words in ((["--static-batch", "1"], "--static-batch"), (["--format", "model.pt"], "extracted")):
        assert tool.main(["--checkpoint", str(tmp_path / "depth.pt"), "--out", str(tmp_path / "x"), *args]) == 2
        assert words in capsys.readouterr().err


# ------------------------------------------- DeepSpeed's zero_to_fp32.py and --format model.pt on ZeRO checkpoints
WEIGHTINGS = ("uncertainty", "uncertainty_log1p", "equal")  # every loss.weighting (squad.config.model.LossConfig)


def _train_tiny(base: Path, weighting: str, zero_stage: int, precision: str) -> Path:
    """A one-rank run of 2 steps on tiny data (its config's loss weighting, ZeRO stage and precision given)."""
    from squad.data.synthetic.taskonomy import render_dataset
    from tests.helpers import PY, tool_env, write_run_config

    render_dataset(base / "data", n=12, image_size=32, seed=0, buildings=3)
    config = write_run_config(base / "tiny.yaml", base / "data", ["depth_euclidean", "class_scene"],
                              loss={"weighting": weighting},
                              optim={"warmup_steps": 1, "steps": 2},
                              train={"ckpt_every": 2, "zero_stage": zero_stage, "precision": precision})
    res = run_command([PY, "tools/train.py", "--config", str(config), "--out", str(base / "run")], ROOT,
                      tool_env(), 300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return base / "run"


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """``zero_runs(weighting)``: a one-rank bf16 ZeRO-2 run of 2 steps with that loss weighting (its fp32 master
    weights differ from the bf16 module weights), trained once per module."""
    made: dict[str, Path] = {}

    def get(weighting: str) -> Path:
        if weighting not in made:
            made[weighting] = _train_tiny(tmp_path_factory.mktemp(f"zero_{weighting}"), weighting, 2, "bf16")
        return made[weighting]

    return get


@pytest.fixture(scope="module")
def zero_run(zero_runs) -> Path:
    return zero_runs("uncertainty")  # what the shipped Mod-Squad / MTL configs and the demo use


def test_every_shipped_config_uses_a_tested_loss_weighting():
    """`test_zero_to_fp32_output_loads_into_squad` covers each weighting; every shipped config uses one of them."""
    from squad.config.base import read_yaml
    from squad.config.loading import load_config
    from squad.config.run import RunConfig

    configs = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not p.name.startswith("_"))
    used = {p.name: load_config(p, ["optim.steps=1"], cls=RunConfig).loss.weighting for p in configs
            if "model" in (read_yaml(p) or {})}
    assert len(used) >= 15 and set(used.values()) <= set(WEIGHTINGS), used
    assert {"uncertainty", "equal"} <= set(used.values())


@pytest.mark.slow
@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_zero_to_fp32_output_loads_into_squad(weighting, zero_runs, tmp_path, load_tool):
    """DeepSpeed's own script, as it sits in every ZeRO run's checkpoints/, recovers the fp32 master weights of every
    parameter (experts included) under the engine's names ('model.' + squad's, and the uncertainty weighting's
    'weighting.log_vars'); --weights makes them a model.pt, the task log-variances kept in its extra."""
    from tests.helpers import PY, tool_env

    run = zero_runs(weighting)
    script = run / "checkpoints" / "zero_to_fp32.py"
    assert script.is_file()
    res = subprocess.run([PY, str(script), str(run / "checkpoints"), str(tmp_path / "fp32")], cwd=tmp_path,
                         env=tool_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    master = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)  # tensors requiring grad
    master = {k: v.detach() for k, v in master.items()}
    module = squad.load(run / "checkpoints")  # the latest tag's bf16 module weights, as fp32
    names = module.state_dict()
    weighted = weighting != "equal"
    assert ("weighting.log_vars" in master) == weighted
    assert {k.removeprefix("model.") for k in master if k != "weighting.log_vars"} == set(names)
    assert all(k.startswith("model.") for k in master if k != "weighting.log_vars")
    assert any("experts.w1" in k for k in master) and any("attn.q" in k for k in master)
    assert all(v.dtype == torch.float32 for v in master.values())
    assert max(float((master["model." + k] - v).abs().max()) for k, v in names.items()) > 0  # ≠ bf16 copy

    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", str(run / "checkpoints"), "--format", "model.pt",
                      "--weights", str(tmp_path / "fp32"), "--out", str(tmp_path / "fp32.pt")]) == 0
    loaded = squad.load(tmp_path / "fp32.pt")
    assert all(torch.equal(loaded.state_dict()[k], master["model." + k]) for k in names)
    extra = loaded.meta["extra"]
    assert extra["step"] == 2 and loaded.usage is not None
    if weighted:  # the fp32 master copy, not the tag's bf16 one
        assert torch.equal(extra["task_log_vars"], master["weighting.log_vars"])
        assert not torch.equal(master["weighting.log_vars"], torch.zeros(2))  # trained
    else:
        assert extra["task_log_vars"] is None
    # a tensor of neither the model nor the objective is refused, naming it
    torch.save({**master, "optimizer.step": torch.ones(1)}, tmp_path / "odd.bin")
    assert tool.main(["--checkpoint", str(run / "checkpoints"), "--format", "model.pt",
                      "--weights", str(tmp_path / "odd.bin"), "--out", str(tmp_path / "odd.pt")]) == 2


@pytest.mark.slow
def test_zero_stage_0_fp32_runs_need_no_zero_to_fp32(tmp_path, load_tool):
    """As the README says: at ZeRO stage 0 in fp32 (the demo on CPUs) DeepSpeed copies no zero_to_fp32.py (there are
    no optimizer shards to merge): each tag's module weights are the fp32 weights, and --format model.pt writes them
    with the task log-variances."""
    run = _train_tiny(tmp_path, "uncertainty", 0, "fp32")
    assert not (run / "checkpoints" / "zero_to_fp32.py").exists()
    tag = run / "checkpoints" / "step00000002"
    states = load_checkpoint_file(tag / "mp_rank_00_model_states.pt")["module"]
    assert load_tool("tools/export.py").main(["--checkpoint", str(run / "checkpoints"), "--format", "model.pt",
                                              "--out", str(tmp_path / "m.pt")]) == 0
    loaded = squad.load(tmp_path / "m.pt")
    assert all(torch.equal(v, states["model." + k]) for k, v in loaded.state_dict().items())
    assert torch.equal(loaded.meta["extra"]["task_log_vars"], states["weighting.log_vars"])
    assert all(v.dtype == torch.float32 for v in states.values())


def test_model_pt_from_any_checkpoint_tag(zero_run, tmp_path, load_tool):
    tool = load_tool("tools/export.py")
    tag = zero_run / "checkpoints" / "step00000002"
    assert tool.main(["--checkpoint", str(tag), "--format", "model.pt", "--out", str(tmp_path / "m.pt")]) == 0
    got, want = squad.load(tmp_path / "m.pt"), squad.load(tag)
    assert got.meta["format"] == "squad.model/1" and got.meta["extra"]["tag"] == "step00000002"
    assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    # a weights file of another model is refused naming the tensor
    export_model(tmp_path / "other.pt", tiny_model(HEADS, **PLANS["dense"]), usage=None)
    torch.save(torch.load(tmp_path / "other.pt", weights_only=True)["state_dict"], tmp_path / "other.bin")
    assert tool.main(["--checkpoint", str(tag), "--format", "model.pt", "--weights", str(tmp_path / "other.bin"),
                      "--out", str(tmp_path / "x.pt")]) == 2


@pytest.mark.parametrize("fmt,out,meant", [("pt2", "x.onnx", "onnx"), ("onnx", "x.pt2", "pt2"),
                                           ("pt2", "model.pt", "model.pt"), ("model.pt", "x.safetensors", "hf")])
def test_an_out_named_for_another_format_is_refused_before_loading(fmt, out, meant, tmp_path, load_tool, capsys):
    """--out x.onnx with the default --format pt2 wrote a torch.export program under an ONNX name (ONNX Runtime then
    refused it): a file name of another format's kind is refused, naming the format it means, before any load."""
    tool = load_tool("tools/export.py")
    assert tool.main(["--checkpoint", str(tmp_path / "none"), "--format", fmt, "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err
    assert f"is a {Path(out).suffix} file name but --format is {fmt}: pass --format {meant}" in err, err
    assert not (tmp_path / out).exists()
