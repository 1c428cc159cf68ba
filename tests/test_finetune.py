"""Router fine-tuning: adding a task to a trained model, truly frozen weights, learning from a subset, the table
of modes × sizes, and the tool's errors."""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

import squad
from squad.config.tools import FinetuneConfig
from squad.data import build_dataset, eval_loader
from squad.eval.evaluate import evaluate
from squad.io import export_model
from squad.models.surgery import add_task, added_task_parameters, merge_added_tasks, with_new_task
from squad.models.vit import build_model
from squad.posttrain.finetune import finetune_once, finetune_table, make_optimizer, select_trainable
from squad.posttrain.subsets import holdout_split, subset_indices
from tests.helpers import ROOT, run_command, tiny_model, tool_env

BASE = ["normal", "class_object"]
PLANS = {
    "moa_moe_mod": None,
    "mone_moe_inputs": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"mone": True}], depth=4, task_embed="moe_inputs"),
}


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "model.pt"
    export_model(path, tiny_model(BASE), None, {"trained_tasks": BASE})
    return path


@pytest.mark.parametrize("name", sorted(PLANS))
def test_add_task_keeps_old_tasks_and_merges_into_an_ordinary_model(name, tmp_path):
    model = tiny_model(BASE, **(PLANS[name] or {}))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x).preds
    grown = with_new_task(model, "class_scene")
    extra = added_task_parameters(grown)
    banks = [n for n, m in grown.named_modules() if isinstance(m, squad.layers.routing.TaskLinear)]
    assert set(extra) == {f"{b}.extra" for b in banks} | {f"{b}.extra_bias" for b in banks
                                                           if grown.get_submodule(b).bias is not None} | {
        "task_embed_extra"}
    with torch.no_grad():
        after = grown(x).preds
        for t in BASE:  # the old tasks compute what they did (to float rounding: the batch holds more rows now)
            torch.testing.assert_close(after[t], before[t], rtol=1e-5, atol=1e-6)
        assert after["class_scene"].shape == (2, 365)
        merge_added_tasks(grown)
        assert added_task_parameters(grown) == {}
        merged = grown(x).preds
    for t in [*BASE, "class_scene"]:
        torch.testing.assert_close(merged[t], after[t], rtol=1e-6, atol=1e-6)
    fresh = build_model(grown.cfg).state_dict()
    assert {k: v.shape for k, v in grown.state_dict().items()} == {k: v.shape for k, v in fresh.items()}
    export_model(tmp_path / "model.pt", grown, None)
    loaded = squad.load_model(tmp_path / "model.pt")
    assert loaded.task_names == [*BASE, "class_scene"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).preds["class_scene"], merged["class_scene"])


def test_add_task_rejects_a_task_the_model_has():
    with pytest.raises(ValueError, match="already has task 'normal'"):
        add_task(tiny_model(BASE), "normal")


def test_router_mode_trains_only_the_new_rows_and_leaves_the_rest_bitwise_unchanged(tiny_data):
    base = tiny_model(BASE)
    model = with_new_task(base, "depth_euclidean")
    trainable = select_trainable(model, "depth_euclidean", "router")
    assert set(trainable) == set(added_task_parameters(model)) | {
        f"heads.depth_euclidean.{n}" for n, _ in model.heads["depth_euclidean"].named_parameters()}
    opt = make_optimizer(trainable, FinetuneConfig())
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    frozen = {n: p for n, p in model.named_parameters() if n not in trainable}
    assert in_opt == {id(p) for p in trainable.values()}
    assert all(not p.requires_grad and id(p) not in in_opt for p in frozen.values())

    cfg = FinetuneConfig(steps=6, batch_size=4, lr=1e-2)
    train = build_dataset(tiny_data, ["depth_euclidean"], "train", image_size=32)
    loader = eval_loader(build_dataset(tiny_data, ["depth_euclidean"], "val", image_size=32), 4)
    snapshot = {n: p.detach().clone() for n, p in base.named_parameters()}
    row, tuned = finetune_once(base, "depth_euclidean", "router", train, range(8), loader, cfg)
    assert row["frozen_unchanged"] is True and row["train_images"] == 8
    assert row["trainable_params"] == sum(p.numel() for p in trainable.values())
    old = dict(tuned.named_parameters())
    for n, p in snapshot.items():
        assert torch.equal(old[n], p), n  # every original parameter, bit for bit
        assert torch.equal(dict(base.named_parameters())[n], p), n  # and the base model is untouched
    moved = [n for n, p in added_task_parameters(tuned).items()
             if not torch.equal(p, added_task_parameters(with_new_task(base, "depth_euclidean"))[n])]
    assert moved  # the new task's router rows / embedding did learn


def test_held_out_selection_keeps_the_best_lr_and_step(tiny_data):
    """The tool's held-out option (what the reproduction's router-finetune claim runs): each lr is tried, the held-out
    metric measured `evals` times, and the chosen lr's best evaluation is the model that comes back."""
    base = tiny_model(BASE)
    cfg = FinetuneConfig(steps=4, batch_size=4, lr=1e-6, lrs=(1e-6, 3e-2), holdout=0.25, evals=2)
    train = build_dataset(tiny_data, ["depth_euclidean"], "train", image_size=32)
    val = eval_loader(build_dataset(tiny_data, ["depth_euclidean"], "val", image_size=32), 4)
    row, tuned = finetune_once(base, "depth_euclidean", "router", train, range(8), val, cfg)
    assert (row["fit_images"], row["held_images"], row["train_images"]) == (6, 2, 8)
    assert set(row["held"]) == {"1e-06", "0.03"} and [s for s, _ in row["curve"]] == [2, 4]
    assert row["held"][f"{row['lr']:g}"] == min(row["held"].values())  # rmse: lower is better
    assert row["best_step"] in (2, 4) and row["frozen_unchanged"] is True
    _, held = holdout_split(list(range(8)), 0.25, 0)
    again = evaluate(tuned, eval_loader(Subset(train, held), 4), ["depth_euclidean"])["depth_euclidean"]["rmse"]
    assert again == pytest.approx(row["held"][f"{row['lr']:g}"], rel=1e-6)  # the kept weights are the chosen ones
    with pytest.raises(ValueError, match="give --holdout"):
        FinetuneConfig(lrs=(1e-3, 1e-2)).check()


def test_subsets_are_deterministic_and_nested():
    a = subset_indices(1000, fraction=0.01, seed=3)
    b = subset_indices(1000, fraction=0.05, seed=3)
    assert len(a) == 10 and len(b) == 50 and b[:10] == a and a == subset_indices(1000, fraction=0.01, seed=3)
    assert len(subset_indices(1000, fraction=0.0001)) == 1
    labels = torch.tensor([0, 1, 2, -1] * 5)
    shots = subset_indices(20, shots=2, labels=labels, seed=0)
    assert sorted(int(labels[i]) for i in shots) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="fraction must be in"):
        subset_indices(10, fraction=1.5)


def test_holdout_split_is_seeded_and_disjoint():
    idx = list(range(100, 150))
    fit, held = holdout_split(idx, 0.2, seed=3)
    assert len(held) == 10 and len(fit) == 40 and sorted(fit + held) == idx
    assert holdout_split(idx, 0.2, seed=3) == (fit, held) and holdout_split(idx, 0.2, seed=4) != (fit, held)
    assert holdout_split([7, 8], 0.01, 0) in (([8], [7]), ([7], [8]))  # at least one image on each side
    with pytest.raises(ValueError, match="cannot be split"):
        holdout_split([7], 0.2, 0)


@pytest.mark.slow
def test_router_finetuning_beats_the_untrained_head_and_writes_json(base_file, tiny_data, tmp_path):
    out = tmp_path / "ft.json"
    cfg = FinetuneConfig(steps=80, batch_size=8, lr=1e-2)
    result = finetune_table(squad.load_model(base_file), "depth", tiny_data, ["router", "head"], fractions=[0.5, 1.0],
                            cfg=cfg, save_dir=tmp_path / "models", out=out)
    untrained = result["untrained"]["rmse"]
    for row in result["runs"]:
        assert row["frozen_unchanged"] is True
        assert row["primary"] < 0.8 * untrained, (row["mode"], row["size"], row["primary"], untrained)
    assert set(result["table"]) == {"router", "head"} and set(result["table"]["router"]) == {"0.5", "1"}
    assert json.loads(out.read_text())["table"] == result["table"]
    saved = squad.load_model(result["runs"][0]["saved"])
    assert saved.task_names == [*BASE, "depth_euclidean"]


@pytest.mark.slow
def test_linear_probe_and_shots(base_file, tiny_data, caplog):
    cfg = FinetuneConfig(steps=10, batch_size=2, lr=1e-2, eval_batches=1)
    with caplog.at_level(logging.WARNING, logger="squad"):
        result = finetune_table(squad.load_model(base_file), "scene", tiny_data, ["linear-probe", "full"], shots=[1],
                                cfg=cfg)
    assert result["eval_images"] == 2  # the images scored (--eval-batches 1 of 2), not the split's size
    few = [r.getMessage() for r in caplog.records if "metrics from so few are noisy" in r.getMessage()]
    assert len(few) == 1 and "fine-tuning class_scene on" in few[0]
    rows = {r["mode"]: r for r in result["runs"]}
    assert set(rows) == {"linear-probe", "full"}
    assert rows["linear-probe"]["trainable_params"] == (32 + 1) * 365
    assert rows["full"]["train_images"] == rows["linear-probe"]["train_images"] >= 1
    for r in rows.values():
        assert 0.0 <= r["metrics"]["accuracy"] <= 100.0


@pytest.mark.parametrize("args, message", [
    (["--task", "not_a_task"], "unknown task 'not_a_task'; valid names: class_object"),
    (["--task", "normal"], "the model was trained with normal"),
    (["--task", "depth", "--mode", "linear-probe"], "linear-probe needs a class task"),
    (["--task", "depth", "--mode", "routers"], "unknown mode 'routers'"),
    (["--task", "depth", "--fractions", "0"], "fraction must be in (0, 1]"),
    (["--task", "depth", "--fractions", "1.5"], "fraction must be in (0, 1]"),
])
def test_tool_rejects_bad_arguments(base_file, tiny_data, args, message, load_tool, capsys):
    tool = load_tool("tools/finetune_router.py")
    assert tool.main(["--checkpoint", str(base_file), "--data", str(tiny_data), "--steps", "1", *args]) == 2
    assert message in capsys.readouterr().err


def test_tool_rejects_checkpoints_of_other_models(tmp_path, tiny_data, load_tool, capsys):
    plain = tmp_path / "weights.pt"
    torch.save(tiny_model(BASE).state_dict(), plain)
    tool = load_tool("tools/finetune_router.py")
    assert tool.main(["--checkpoint", str(plain), "--data", str(tiny_data), "--task", "depth"]) == 2
    assert "not a squad model file" in capsys.readouterr().err


def test_other_ranks_of_a_launcher_do_nothing(base_file, tiny_data, tmp_path, load_tool, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "r1.json"
    tool = load_tool("tools/finetune_router.py")
    args = ["--checkpoint", str(base_file), "--data", str(tiny_data), "--task", "depth", "--out", str(out)]
    assert tool.main(args) == 0
    assert not out.exists()


@pytest.mark.slow
def test_runs_under_the_deepspeed_launcher(base_file, tiny_data, tmp_path):
    out = tmp_path / "ds.json"
    env = tool_env()
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "tools/finetune_router.py",
           "--checkpoint", str(base_file), "--data", str(tiny_data), "--task", "depth", "--steps", "2",
           "--fractions", "0.5", "--out", str(out)]
    res = run_command(cmd, ROOT, env, 300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert json.loads(out.read_text())["runs"][0]["frozen_unchanged"] is True


def test_missing_checkpoint_says_how_to_train_one_without_the_task(tmp_path, tiny_data, load_tool, capsys,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    tool = load_tool("tools/finetune_router.py")
    assert tool.main(["--checkpoint", "runs/no_scene", "--task", "scene", "--data", str(tiny_data)]) == 2
    err = capsys.readouterr().err
    assert "runs/no_scene" in err and "trained without class_scene" in err
    assert err.strip().splitlines()[-1].startswith("error: model file not found: runs/no_scene")  # one line
    command = err[err.index("python tools/train.py"):].strip()
    assert command.startswith("python tools/train.py --config configs/demo.yaml --out runs/no_scene "
                              "--set 'data.tasks=[")
    assert not (tmp_path / "runs").exists()
    # the command it gives is a valid run config: every task of the demo model but class_scene
    override = command.split("--set ", 1)[1].strip("'")
    cfg = squad.load_config(ROOT / "configs" / "demo.yaml", [override])
    assert "class_scene" not in cfg.train_tasks() and len(cfg.train_tasks()) == 12 == len(cfg.model.heads) - 1
