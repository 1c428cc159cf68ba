"""Every shipped model config, shrunk, down every documented path: train, resume, then each post-training tool.

For each ``configs/model/*.yaml`` (not the ``_`` parts), at the widths of `tests.helpers.TINY`, on three tasks
(single-task configs keep their one; ``class_scene`` is never trained, so finetune_router has a new task to add):

- ``tools/train.py`` trains 2 steps, then the same command with ``optim.steps=3`` resumes (``--resume auto``) from
  the step-2 checkpoint and finishes. One config of each layer family (`DEEPSPEED`: dense, MoE, MoD/A-MoD, MoNE)
  runs under ``deepspeed --num_gpus 2``; the others as plain ``python`` (one process, world size 1).
- evaluate, extract, visualize and finetune_router run on every trained run (in this process, through
  ``tools/<name>.py``): each either does its documented thing (exit 0 and its files) or refuses clearly (exit 2, an
  ``error: ...`` line saying why). A traceback is a failure.

A new config is walked without any change here; a config of a new layer family fails
`test_families_have_a_deepspeed_run` until it gets a representative in `DEEPSPEED`.

Configs of the other benchmarks (heads of PASCAL-Context or NYUD-v2 tasks, `dataset_of`) are not walked: their layer
families are the Taskonomy configs', and tests/test_pascal_nyud_training.py runs every tool on their Mod-Squad models.
Each still trains here, shrunk the same way, for 2 steps on its own dataset's synthetic data
(`test_other_benchmark_config_trains`, one plain process each).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import squad
from squad.config.base import read_yaml
from tests.helpers import MODEL_CONFIGS, PY, ROOT, TINY, launcher, run_command, tiny_config, tool_env
from tests.test_pascal_nyud_training import BENCHMARK_TASKS, benchmark_data

CONFIGS = {p.stem: p for p in MODEL_CONFIGS}
HEADS = ["depth_euclidean", "normal", "class_object"]  # a dense regression, a dense vector field, a class task
NEW_TASK = "class_scene"  # never trained: finetune_router adds it
STEPS, RESUMED_STEPS = 2, 3
TRAIN_TIMEOUT = 300  # a hang (a collective only some ranks reach) fails the test instead of waiting for gloo's 600 s

# The config of each layer family that trains under `deepspeed --num_gpus 2` (2 CPU ranks).
DEEPSPEED = {"dense": "mtl_vit_b", "moe": "modsquad_vit_s", "mod": "mod_vit_s", "mone": "mone_vit_s"}


def dataset_of(name: str) -> str:
    """The dataset a shipped config trains on: ``pascal_context`` or ``nyud`` when every head is one of that
    benchmark's tasks (PASCAL-Context first: both have normals and edge), else ``taskonomy``."""
    heads = {h if isinstance(h, str) else h["name"] for h in read_yaml(CONFIGS[name])["model"]["heads"]}
    for dataset, tasks in BENCHMARK_TASKS.items():
        if heads <= set(tasks):
            return dataset
    return "taskonomy"


WALKED = sorted(n for n in CONFIGS if dataset_of(n) == "taskonomy")
OTHER_BENCHMARKS = sorted(n for n in CONFIGS if dataset_of(n) != "taskonomy")


def family(name: str) -> str:
    """The layer family of a shipped config: mone, mod (MoD or A-MoD), moe (MoE attention / MLP) or dense."""
    kinds = set()
    for block in tiny_config(CONFIGS[name]).model.plan:
        kinds |= {"mone"} if block.mone else set()
        kinds |= {"mod"} if block.mod else set()
        kinds |= {"moe"} & {block.attn.replace("moa", "moe"), block.mlp}
    for f in ("mone", "mod", "moe"):
        if f in kinds:
            return f
    return "dense"


def _heads(name: str) -> list[str]:
    """The heads a config trains here: three Taskonomy tasks, or a single-task config's one, or every head of a
    config of another benchmark."""
    heads = [h if isinstance(h, str) else h.name for h in tiny_config(CONFIGS[name]).model.heads]
    return HEADS if len(heads) > 1 and dataset_of(name) == "taskonomy" else heads


def _train_args(name: str, out: Path, data: Path, steps: int) -> list[str]:
    """``tools/train.py`` arguments: the shipped config, shrunk by `TINY` and a few run keys."""
    heads = _heads(name)
    sets = [*TINY, "model.head_dim=null", f"model.heads=[{', '.join(heads)}]", f"data.root={data}",
            "data.workers=0", "data.val_batches=1", f"optim.steps={steps}", "optim.batch_per_rank=4",
            "optim.warmup_steps=1", "train.progress=false", "train.log_every=1"]
    return ["--config", str(CONFIGS[name]), "--out", str(out), *[a for s in sets for a in ("--set", s)]]



def _run(cmd: list[str], timeout: int = TRAIN_TIMEOUT) -> dict:
    """Runs a command in its own process group (killed whole on timeout: the launcher's ranks included)."""
    try:
        proc = run_command(cmd, ROOT, tool_env(), timeout)
    except subprocess.TimeoutExpired as e:
        return {"rc": "timeout", "stderr": f"timed out after {timeout} s\n{(e.stdout or '')[-2000:]}"
                                          f"{(e.stderr or '')[-3000:]}"}
    return {"rc": proc.returncode, "stderr": (proc.stdout[-2000:] + proc.stderr[-4000:])}


@dataclass
class Trained:
    name: str
    out: Path
    train: dict  # {"rc", "stderr"} of the first run
    resume: dict  # ... of the rerun with more steps

    def require(self) -> None:
        if self.train["rc"] != 0 or self.resume["rc"] != 0:
            pytest.skip(f"{self.name} did not train (see test_trains_and_resumes[{self.name}])")


@pytest.fixture(scope="module", params=WALKED)
def trained(request, tmp_path_factory, tiny_data) -> Trained:
    """One config, trained then resumed (under the deepspeed launcher for the configs in `DEEPSPEED`)."""
    name = request.param
    out = tmp_path_factory.mktemp("walk") / name
    prefix = launcher(2 if name in DEEPSPEED.values() else 1)
    runs = [_run([*prefix, "tools/train.py", *_train_args(name, out, tiny_data, steps)])
            for steps in (STEPS, RESUMED_STEPS)]
    return Trained(name, out, *runs)


# The family of every shipped config, as the walk sees it (a config added or removed must be added here too).
EXPECTED_FAMILIES = {
    "amod_vit_s": "mod", "m3vit_vit_b": "moe", "mod_vit_s": "mod", "modsquad_vit_b": "moe", "modsquad_vit_s": "moe",
    "modsquad_vit_l": "moe", "moe_attn_only_vit_b": "moe", "moe_mlp_only_vit_b": "moe", "mone_vit_s": "mone",
    "mtl_vit_b": "dense",
    "stl_vit_b": "dense",
    # the other benchmarks' configs (trained by test_other_benchmark_config_trains, tools in test_pascal_nyud_training)
    "modsquad_vit_s_nyud": "moe", "modsquad_vit_s_pascal": "moe", "mtl_vit_s_pascal": "dense",
    "stl_vit_s_pascal": "dense",
}
EXPECTED_DATASETS = {"modsquad_vit_s_nyud": "nyud", "modsquad_vit_s_pascal": "pascal_context",
                     "mtl_vit_s_pascal": "pascal_context", "stl_vit_s_pascal": "pascal_context"}


def test_every_shipped_config_is_walked():
    assert {n: family(n) for n in CONFIGS} == EXPECTED_FAMILIES
    assert {n: dataset_of(n) for n in OTHER_BENCHMARKS} == EXPECTED_DATASETS
    assert set(WALKED) | set(OTHER_BENCHMARKS) == set(CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_BENCHMARKS)
def test_other_benchmark_config_trains(name, tmp_path_factory):
    """A PASCAL-Context / NYUD-v2 config, shrunk by `TINY`, trains 2 steps on its dataset's synthetic data, every
    head at once, and the run loads with a prediction per head at the data's resolution."""
    dataset = dataset_of(name)
    data = benchmark_data(tmp_path_factory, dataset)
    out = tmp_path_factory.mktemp("other") / name
    r = _run([PY, "tools/train.py", *_train_args(name, out, data, STEPS), "--set", f"data.dataset={dataset}"])
    assert r["rc"] == 0, f"{name}: exit {r['rc']}\n{r['stderr']}"
    model = squad.load(out)
    assert list(model.task_names) == _heads(name)
    with torch.no_grad():
        preds = model(torch.randn(2, 3, 32, 32)).preds
    assert all(p.shape[-2:] == (32, 32) and torch.isfinite(p).all() for p in preds.values())


def test_families_have_a_deepspeed_run():
    families = {n: family(n) for n in CONFIGS}
    assert set(DEEPSPEED.values()) <= set(CONFIGS), "a DeepSpeed representative is not a shipped config"
    assert all(family(n) == f for f, n in DEEPSPEED.items()), {f: family(n) for f, n in DEEPSPEED.items()}
    assert set(families.values()) <= set(DEEPSPEED), f"a family without a DeepSpeed run: {families}"


def test_trains_and_resumes(trained):
    for what in ("train", "resume"):
        r = getattr(trained, what)
        assert r["rc"] == 0, f"{trained.name} {what}: exit {r['rc']}\n{r['stderr']}"
    out = trained.out
    log = (out / "train.log").read_text()
    assert f"resumed from {out / 'checkpoints' / f'step{STEPS:08d}'} at step {STEPS}" in log, log[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == RESUMED_STEPS, steps  # one row per validation, in order
    model = squad.load(out)
    assert model.meta and list(model.task_names) == _heads(trained.name)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        preds = model(x).preds
    assert set(preds) == set(_heads(trained.name))
    assert all(torch.isfinite(p).all() for p in preds.values())


def _tool(load_tool, capsys, tool: str, argv: list[str]) -> tuple[int, str]:
    """Runs ``tools/<tool>.py`` in this process; returns (exit status, stderr). A traceback fails the test."""
    capsys.readouterr()
    rc = load_tool(f"tools/{tool}.py").main(argv)
    err = capsys.readouterr().err
    assert rc in (0, 2), f"{tool} {' '.join(argv)}: exit {rc}\n{err[-3000:]}"
    if rc == 2:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("error: ") and len(lines[-1]) > 20, f"unclear refusal: {err[-2000:]}"
    return rc, err


def _refused(rc: int, err: str) -> bool:
    if rc == 2:
        print(f"refused: {err.strip().splitlines()[-1]}")  # shown with -rA; the refusal is an allowed outcome
    return rc == 2


@pytest.fixture
def tools_env(monkeypatch):
    """In-process tools see a CPU machine and no launcher."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_evaluate(trained, tiny_data, load_tool, capsys, tools_env):
    trained.require()
    out = trained.out / "eval_walk.json"
    rc, err = _tool(load_tool, capsys, "evaluate", ["--checkpoint", str(trained.out), "--data", str(tiny_data),
                                                    "--split", "val", "--batches", "1", "--out", str(out)])
    if _refused(rc, err):
        return
    metrics = json.loads(out.read_text())["metrics"]
    assert set(metrics) == set(_heads(trained.name)), metrics


def test_evaluate_at_inference_settings(trained, tiny_data, load_tool, capsys, tools_env):
    """MoNE's capacity and MoD's threshold routing set at evaluation time, where the tool offers them.

    A MoNE model evaluates at any capacity; threshold routing may be refused (with a reason) for MoD routers not
    trained for it.
    """
    from squad.cli.evaluate import build_parser

    options = {o for a in build_parser()._actions for o in a.option_strings}
    kind = family(trained.name)
    extra = {"mone": ["--mone-capacity", "0.5"], "mod": ["--mod-inference", "threshold"]}.get(kind)
    if extra is None:
        pytest.skip(f"{kind}: no inference-time routing setting")
    if extra[0] not in options:
        pytest.skip(f"evaluate has no {extra[0]} yet")
    trained.require()
    out = trained.out / "eval_walk_inference.json"
    rc, err = _tool(load_tool, capsys, "evaluate", ["--checkpoint", str(trained.out), "--data", str(tiny_data),
                                                    "--batches", "1", "--out", str(out), *extra])
    if kind == "mod" and _refused(rc, err):
        return  # threshold routing needs routers trained for it (model.mod.aux_loss) and learned routing
    assert rc == 0, err[-2000:]  # any capacity applies to any MoNE model
    assert set(json.loads(out.read_text())["metrics"]) == set(_heads(trained.name))


def test_extract(trained, tiny_data, load_tool, capsys, tools_env):
    trained.require()
    out = trained.out / "walk_depth.pt"
    rc, err = _tool(load_tool, capsys, "extract", ["--checkpoint", str(trained.out), "--task", "depth_euclidean",
                                                   "--theta", "0.01", "--data", str(tiny_data), "--calib-batches",
                                                   "1", "--eval-batches", "1", "--batch-size", "4", "--out",
                                                   str(out)])
    if _refused(rc, err):
        return
    report = json.loads(out.with_suffix(".json").read_text())
    assert report, "empty report"
    assert "nan" not in json.dumps(report).lower(), report  # e.g. "ratio nan": nothing was extracted (item 14)
    model = squad.load(out)
    with torch.no_grad():
        pred = model(torch.randn(2, 3, 32, 32))
    assert torch.is_tensor(pred) and torch.isfinite(pred).all()


def test_extract_refuses_an_untrained_task(trained, tiny_data, load_tool, capsys, tools_env):
    trained.require()
    rc, err = _tool(load_tool, capsys, "extract", ["--checkpoint", str(trained.out), "--task", NEW_TASK,
                                                   "--data", str(tiny_data), "--calib-batches", "1",
                                                   "--eval-split", "none", "--out",
                                                   str(trained.out / "walk_untrained.pt")])
    assert rc == 2 and NEW_TASK in err.strip().splitlines()[-1], err[-2000:]
    assert not (trained.out / "walk_untrained.pt").exists()


def test_visualize(trained, tiny_data, load_tool, capsys, tools_env):
    trained.require()
    out = trained.out / "walk_figures"
    rc, err = _tool(load_tool, capsys, "visualize", ["--checkpoint", str(trained.out), "--data", str(tiny_data),
                                                     "--batches", "1", "--batch-size", "4", "--out", str(out)])
    if _refused(rc, err):
        assert not out.exists(), "a refusal left a figure folder behind"
        return
    assert sorted(out.glob("*.png")), f"no figures in {out}"
    assert sorted(out.glob("*.json")), f"no numbers in {out}"


def test_finetune_router(trained, tiny_data, load_tool, capsys, tools_env):
    trained.require()
    out = trained.out / "walk_finetune.json"
    rc, err = _tool(load_tool, capsys, "finetune_router", [
        "--checkpoint", str(trained.out), "--task", NEW_TASK, "--data", str(tiny_data), "--fractions", "0.5",
        "--mode", "router,head", "--steps", "2", "--batch-size", "4", "--eval-batches", "1", "--out", str(out)])
    if _refused(rc, err):
        return
    result = json.loads(out.read_text())
    assert result["task"] == NEW_TASK and set(result["table"]) == {"router", "head"}, result
