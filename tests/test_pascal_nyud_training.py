"""PASCAL-Context and NYUD-v2 end to end, on the synthetic data of ``tools/make_data.py synthetic --dataset ...``.

Per dataset (`CASES`): 24 synthetic images at 48 px are written once per session (`benchmark_data`); the shipped
Mod-Squad config, shrunk by `tests.helpers.TINY` to 32 px, trains 3 steps with ``tools/train.py`` (``data.dataset``)
on every task but one (`Case.held_out`; on PASCAL-Context the semseg head uses the light decoder); then, in this
process, ``tools/evaluate.py`` (Δm against a baseline results file, each metric's direction), ``tools/extract.py``
(one task's pruned subnetwork, the paper's Table 3 "w/ pruning" model), ``tools/visualize.py`` and
``tools/finetune_router.py`` (the held-out task learned from half the training images, router + head).
Also: the shipped configs' sizes against Table 3, and every run config of configs/pascal_context and configs/nyud.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import squad
from squad.config.run import RunConfig, deepspeed_config
from squad.tasks import get_task
from tests.helpers import PY, ROOT, TINY, run_command, tool_env

# The tasks of each benchmark, their head channels and the direction of their primary metric (the table).
BENCHMARK_TASKS = {"pascal_context": ["semseg", "human_parts", "saliency", "normals", "edge"],
                   "nyud": ["nyud_semseg", "nyud_depth", "normals", "edge"]}
CHANNELS = {"semseg": 21, "human_parts": 7, "saliency": 1, "normals": 3, "edge": 1, "nyud_semseg": 40,
            "nyud_depth": 1}
HIGHER_IS_BETTER = {"semseg": True, "human_parts": True, "saliency": True, "normals": False, "edge": True,
                    "nyud_semseg": True, "nyud_depth": False}
N_IMAGES, IMAGE_SIZE = 24, 48  # synthetic data; the tiny models run at 32 px (the readers resize)
STEPS = 3
TIMEOUT = 300


def benchmark_data(tmp_path_factory: pytest.TempPathFactory, dataset: str) -> Path:
    """The synthetic ``dataset`` (``pascal_context`` or ``nyud``), written once per test session by
    ``tools/make_data.py synthetic --dataset`` (in this process)."""
    from squad.cli.make_data import main

    root = tmp_path_factory.getbasetemp() / f"synth_{dataset}"
    if not (root / "done").is_file():
        shutil.rmtree(root, ignore_errors=True)
        rc = main(["synthetic", "--dataset", dataset, "--out", str(root / "data"), "--n", str(N_IMAGES),
                   "--image-size", str(IMAGE_SIZE), "--seed", "0"])
        assert rc == 0, f"make_data.py synthetic --dataset {dataset}: exit {rc}"
        (root / "done").write_text("")
    return root / "data"


@dataclass(frozen=True)
class Case:
    dataset: str
    config: str  # configs/model/<config>.yaml
    held_out: str  # never trained: finetune_router learns it
    extract: str  # the task extract.py prunes out
    light: str | None = None  # a task trained with the light decoder head

    @property
    def trained(self) -> list[str]:
        return [t for t in BENCHMARK_TASKS[self.dataset] if t != self.held_out]

    def heads(self) -> str:
        """``model.heads`` as a YAML list (the light task as a mapping)."""
        items = [f"{{name: {t}, kind: dense, channels: {CHANNELS[t]}, decoder: light, decoder_width: 16}}"
                 if t == self.light else t for t in self.trained]
        return f"[{', '.join(items)}]"


CASES = [Case("pascal_context", "modsquad_vit_s_pascal", held_out="saliency", extract="semseg", light="semseg"),
         Case("nyud", "modsquad_vit_s_nyud", held_out="edge", extract="nyud_depth")]


@dataclass
class Run:
    case: Case
    data: Path
    out: Path
    rc: int | str
    log: str

    def require(self) -> None:
        if self.rc != 0:
            pytest.skip(f"{self.case.dataset}: the run did not train (see test_trains)")


def _run(cmd: list[str]) -> tuple[int | str, str]:
    try:
        proc = run_command(cmd, ROOT, tool_env(), TIMEOUT)  # forked from the worker's preloaded interpreter
    except subprocess.TimeoutExpired as e:
        return "timeout", f"{e.stdout or ''}{e.stderr or ''}"[-6000:]
    return proc.returncode, (proc.stdout + proc.stderr)[-6000:]


@pytest.fixture(scope="module", params=CASES, ids=[c.dataset for c in CASES])
def run(request, tmp_path_factory) -> Run:
    """A tiny Mod-Squad trained `STEPS` steps on the dataset's synthetic data (one plain process)."""
    case: Case = request.param
    data = benchmark_data(tmp_path_factory, case.dataset)
    out = tmp_path_factory.mktemp("bench") / case.config
    sets = [*TINY, "model.head_dim=null", f"model.heads={case.heads()}", f"data.dataset={case.dataset}",
            f"data.root={data}", "data.workers=0", "data.val_batches=1", f"optim.steps={STEPS}",
            "optim.batch_per_rank=4", "optim.warmup_steps=1", "train.progress=false", "train.log_every=1"]
    rc, log = _run([PY, "tools/train.py", "--config", str(ROOT / "configs" / "model" / f"{case.config}.yaml"),
                    "--out", str(out), *[a for s in sets for a in ("--set", s)]])
    return Run(case, data, out, rc, log)


@pytest.fixture
def tools_env(monkeypatch):
    """In-process tools see a CPU machine and no launcher."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def _tool(load_tool, capsys, tool: str, argv: list[str]) -> tuple[int, str]:
    """Runs ``tools/<tool>.py`` in this process; returns (exit status, stdout + stderr)."""
    capsys.readouterr()
    rc = load_tool(f"tools/{tool}.py").main(argv)
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_trains(run):
    assert run.rc == 0, f"{run.case.dataset}: exit {run.rc}\n{run.log}"
    steps = [json.loads(line)["step"] for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == STEPS, steps
    model = squad.load(run.out)
    assert list(model.task_names) == run.case.trained
    assert model.meta["extra"]["trained_tasks"] == run.case.trained
    with torch.no_grad():
        preds = model(torch.randn(2, 3, 32, 32)).preds
    for task, pred in preds.items():
        assert pred.shape == (2, CHANNELS[task], 32, 32) and torch.isfinite(pred).all(), (task, pred.shape)
    if run.case.light:
        assert model.heads[run.case.light].decoder == "light"


def test_evaluate_delta_m(run, tmp_path, load_tool, capsys, tools_env):
    """Every trained task's metrics; Δm against a baseline results file counts each metric in its direction."""
    run.require()
    first = tmp_path / "eval.json"
    rc, log = _tool(load_tool, capsys, "evaluate", ["--checkpoint", str(run.out), "--data", str(run.data),
                                                    "--batches", "2", "--batch-size", "4", "--out", str(first)])
    assert rc == 0, log[-3000:]
    metrics = json.loads(first.read_text())["metrics"]
    assert set(metrics) == set(run.case.trained), metrics
    primary = {t: metrics[t][get_task(t).primary_metric] for t in metrics}
    assert all(v == v and abs(v) < float("inf") for v in primary.values()), primary
    # a baseline 1.25× below the model (an STL/MTL results file in tools/evaluate.py's layout)
    base = {t: (v / 1.25 if v else 0.5) for t, v in primary.items()}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"metrics": {t: {get_task(t).primary_metric: b}
                                                for t, b in base.items()}}))
    out = tmp_path / "eval_delta.json"
    rc, log = _tool(load_tool, capsys, "evaluate", ["--checkpoint", str(run.out), "--data", str(run.data),
                                                    "--batches", "2", "--batch-size", "4", "--baseline",
                                                    str(baseline), "--out", str(out)])
    assert rc == 0, log[-3000:]
    result = json.loads(out.read_text())
    assert result["metrics"] == metrics  # evaluation is deterministic
    expected = {t: (1 if HIGHER_IS_BETTER[t] else -1) * 100 * (primary[t] - base[t]) / base[t] for t in primary}
    assert result["delta_t"]["per_task"] == pytest.approx(expected, abs=1e-6), (result["delta_t"], expected)
    assert result["delta_t"]["mean"] == pytest.approx(sum(expected.values()) / len(expected), abs=1e-6)
    assert "Δt" in log


def test_extract(run, tmp_path, load_tool, capsys, tools_env):
    """One task's pruned subnetwork: smaller, loads alone, predicts the task at full resolution; an untrained task
    is refused."""
    run.require()
    task, out = run.case.extract, tmp_path / "single.pt"
    rc, log = _tool(load_tool, capsys, "extract", ["--checkpoint", str(run.out), "--task", task, "--theta", "0.01",
                                                   "--data", str(run.data), "--calib-batches", "2",
                                                   "--eval-batches", "1", "--batch-size", "4", "--out", str(out)])
    assert rc == 0, log[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["task"] == task and report["pruned"] is True
    assert report["params"]["extracted"] < report["params"]["full"], report["params"]
    assert report["experts"]["extracted"] <= report["experts"]["full"], report["experts"]
    assert set(report["metrics"]["extracted"]) >= {get_task(task).primary_metric}, report["metrics"]
    single = squad.load(out)
    assert single.task == task and list(single.model.heads) == [task]
    if task == run.case.light:
        assert single.model.heads[task].decoder == "light"
    with torch.no_grad():
        pred = single(torch.randn(2, 3, 32, 32))
    assert pred.shape == (2, CHANNELS[task], 32, 32) and torch.isfinite(pred).all()

    rc, log = _tool(load_tool, capsys, "extract", ["--checkpoint", str(run.out), "--task", run.case.held_out,
                                                   "--data", str(run.data), "--eval-split", "none", "--out",
                                                   str(tmp_path / "untrained.pt")])
    assert rc == 2 and run.case.held_out in log.strip().splitlines()[-1], log[-2000:]


def test_visualize(run, tmp_path, load_tool, capsys, tools_env):
    run.require()
    out = tmp_path / "figures"
    rc, log = _tool(load_tool, capsys, "visualize", ["--checkpoint", str(run.out), "--data", str(run.data),
                                                     "--batches", "1", "--batch-size", "4", "--tb", "none",
                                                     "--out", str(out)])
    assert rc == 0, log[-3000:]
    assert sorted(out.glob("*.png")) and sorted(out.glob("*.json")), sorted(p.name for p in out.iterdir())


def test_finetune_router_learns_the_held_out_task(run, tmp_path, load_tool, capsys, tools_env):
    """The task the run never saw (PASCAL-Context: saliency; NYUD-v2: edge), from half of the training images."""
    run.require()
    task, out = run.case.held_out, tmp_path / "finetune.json"
    rc, log = _tool(load_tool, capsys, "finetune_router", [
        "--checkpoint", str(run.out), "--task", task, "--data", str(run.data), "--fractions", "0.5",
        "--mode", "router,head", "--steps", "2", "--batch-size", "4", "--eval-batches", "1", "--out", str(out)])
    assert rc == 0, log[-3000:]
    result = json.loads(out.read_text())
    assert result["task"] == task and set(result["table"]) == {"router", "head"}, result
    assert result["metric"] == get_task(task).primary_metric
    assert result["lower_is_better"] is not HIGHER_IS_BETTER[task]
    values = [v for row in result["table"].values() for v in row.values()]
    assert len(values) == 2 and all(isinstance(v, float) and v == v for v in values), result["table"]


# ------------------------------------------------------------------------------------------- configs and sizes
def _meta_profile(path: Path | str, overrides: list[str] | None = None) -> tuple[squad.SquadViT, dict]:
    torch.set_default_device("meta")  # parameter shapes only: nothing is allocated
    try:
        model = squad.build_model(squad.load_config(path, overrides).model)
        return model, squad.profile(model)
    finally:
        torch.set_default_device("cpu")


def test_table3_size():
    """Mod-Squad ViT-S on PASCAL-Context, Table 3: 50 M parameters, 5.2 GMACs (ViT-S's nominal 224 px); the MTL
    ViT-S baseline 4.6 GMACs (21 M backbone, the linear heads add 3.2 M)."""
    model_dir = ROOT / "configs" / "model"
    _, msq = _meta_profile(model_dir / "modsquad_vit_s_pascal.yaml")
    assert 48e6 <= msq["params"] <= 53e6, msq["params"]
    assert abs(msq["backbone_macs"] - 5.2e9) <= 0.1e9, msq["backbone_macs"]
    assert list(msq["tasks"]) == BENCHMARK_TASKS["pascal_context"]
    _, mtl = _meta_profile(model_dir / "mtl_vit_s_pascal.yaml")
    assert abs(mtl["backbone_macs"] - 4.6e9) <= 0.1e9 and 21e6 <= mtl["params"] <= 26e6, mtl
    _, nyud = _meta_profile(model_dir / "modsquad_vit_s_nyud.yaml")
    assert nyud["backbone_macs"] == msq["backbone_macs"] and list(nyud["tasks"]) == BENCHMARK_TASKS["nyud"]


def test_light_decoder_run_config_cost():
    """The light-decoder run config: every head decodes with convolutions, each counted by profile, each a small
    share of the 512 px backbone."""
    model, prof = _meta_profile(ROOT / "configs" / "pascal_context" / "modsquad_vit_s_light.yaml")
    for task, entry in prof["tasks"].items():
        head = model.heads[task]
        assert head.decoder == "light" and head.channels == CHANNELS[task], task
        extra = entry["macs"] - prof["backbone_macs"]
        assert extra == head.macs(model.cfg.grid ** 2) and 0 < extra < 0.05 * prof["backbone_macs"], (task, extra)


RUN_CONFIGS = sorted([*(ROOT / "configs" / "pascal_context").glob("*.yaml"),
                      *(ROOT / "configs" / "nyud").glob("*.yaml")])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_run_configs_load(path):
    cfg = squad.load_config(path)
    assert isinstance(cfg, RunConfig)
    dataset = {"pascal_context": "pascal_context", "nyud": "nyud"}[path.parent.name]
    assert cfg.data.dataset == dataset and cfg.model.img_size == 512 and cfg.optim.epochs == 100
    tasks = cfg.train_tasks()
    assert set(tasks) <= set(BENCHMARK_TASKS[dataset]) and len(tasks) in (1, len(BENCHMARK_TASKS[dataset])), tasks
    assert all(h.channels == CHANNELS[h.name] for h in cfg.model.head_configs())
    ds = deepspeed_config(cfg, cuda=False)
    assert ds["train_micro_batch_size_per_gpu"] == cfg.optim.batch_per_rank == 8
