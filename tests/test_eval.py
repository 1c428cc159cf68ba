"""Evaluation: `evaluate` on the metric accumulator, metric directions, Δt, and the results table."""

from __future__ import annotations

import math

import pytest
import torch

import squad.eval
from squad.data import build_dataset, eval_loader
from squad.eval import MetricAccumulator, delta_t, evaluate, format_results
from squad.eval.evaluate import delta_against, primary
from squad.tasks import TASK_NAMES, Task, get_task, register_task, unregister_task
from tests.helpers import tiny_model
from tests.test_tasks import batch_of

HEADS = [["depth_euclidean", "normal", "edge_texture"],
         ["class_object", "depth_zbuffer", "principal_curvature", "reshading", "keypoints2d", "segment_unsup2d"]]


@torch.no_grad()
def reference_evaluate(model, loader, tasks, max_batches=0):
    """`evaluate` as it was before it used `MetricAccumulator` (single process): sums on the CPU, then finalised."""
    model.eval()
    specs = {t: get_task(t) for t in tasks}
    sums = {t: {} for t in tasks}
    for i, batch in enumerate(loader):
        if max_batches and i >= max_batches:
            break
        out = model(batch["rgb"], list(tasks))
        for t, pred in out.preds.items():
            task = specs[t]
            part = task.metric_sums(pred.float(), task.target(batch["targets"][t]), batch["masks"][t])
            for k, v in part.items():
                sums[t][k] = sums[t].get(k, 0) + v.detach().double().cpu()
    return {t: specs[t].metrics(sums[t]) if sums[t] else {} for t in tasks}


# ------------------------------------------------------------------------------------------------ evaluate


@pytest.mark.parametrize("heads", HEADS, ids=["dense", "mixed"])
@pytest.mark.parametrize("max_batches", [0, 1])
def test_evaluate_matches_the_previous_implementation(tiny_data, heads, max_batches):
    ds = build_dataset(tiny_data, heads, "val", image_size=32, augment=False)
    model = tiny_model(heads)
    want = reference_evaluate(model, eval_loader(ds, 3), heads, max_batches)
    got = evaluate(model, eval_loader(ds, 3), heads, max_batches=max_batches)
    assert list(got) == heads and all(got[t] for t in heads)
    for t in heads:
        assert got[t].keys() == want[t].keys()
        for k, v in want[t].items():  # bit-identical: the same float64 sums in the same order
            assert got[t][k] == v or (math.isnan(v) and math.isnan(got[t][k])), (t, k)


def test_evaluate_keys_results_by_the_names_given(tiny_data):
    heads = ["depth_euclidean", "normal"]
    ds = build_dataset(tiny_data, heads, "val", image_size=32, augment=False)
    model = tiny_model(heads)
    canonical = evaluate(model, eval_loader(ds, 4), heads)
    aliased = evaluate(model, eval_loader(ds, 4), ["depth", "normal"])
    assert aliased == {"depth": canonical["depth_euclidean"], "normal": canonical["normal"]}
    assert evaluate(model, [], heads) == {"depth_euclidean": {}, "normal": {}}  # no batches: empty tables


def test_accumulator_and_delta_t():
    acc = MetricAccumulator(["depth", "object"])
    for seed in range(2):
        for name in acc.tasks:
            task = get_task(name)
            value, mask = batch_of(name, seed=seed)
            t = task.target(value)
            acc.update(name, task.metric_sums(t, t, mask))
    results = acc.compute()
    assert results["depth_euclidean"]["rmse"] == pytest.approx(0.0, abs=1e-4)
    assert results["class_object"]["accuracy"] == pytest.approx(100.0)
    # Paper Table 1 / 2: Mod-Squad vs STL, object accuracy 59.0 vs 56.5 → +4.4; depth RMSE 6.59 vs 6.94 → +5.0.
    out = delta_t({"object": {"accuracy": 59.0}, "depth": {"rmse": 6.59}},
                  {"class_object": {"accuracy": 56.5}, "depth_euclidean": {"rmse": 6.94}})
    assert out["class_object"] == pytest.approx(100 * 2.5 / 56.5)
    assert out["depth_euclidean"] == pytest.approx(100 * 0.35 / 6.94)
    assert out["mean"] == pytest.approx((out["class_object"] + out["depth_euclidean"]) / 2)
    with pytest.raises(KeyError, match="normal"):
        delta_t({"normal": {"l1": 0.3}}, {"depth": {"rmse": 1.0}})
    with pytest.raises(KeyError, match="rmse"):
        delta_t({"depth": {"l1": 0.3}}, {"depth": {"rmse": 1.0}})
    with pytest.raises(ValueError):
        delta_t({"depth": {"rmse": 1.0}}, {"depth": {"rmse": 0.0}})


# ---------------------------------------------------------------------------------------- metric direction


def test_every_metric_has_the_right_direction():
    higher = {}
    for name in TASK_NAMES:
        task = get_task(name)
        value, mask = batch_of(name)
        t = task.target(value)
        reported = set(task.metrics(task.metric_sums(t, t, mask)))
        assert task.higher_is_better <= reported, name  # no direction for a metric the task never reports
        assert task.primary_metric in reported
        assert task.lower_is_better == task.lower_is_better_for(task.primary_metric)
        higher.update({m: name for m in reported if not task.lower_is_better_for(m)})
    assert set(higher) == {"accuracy", "top5", "delta1", "delta2", "delta3"}
    assert get_task("depth").lower_is_better and not get_task("scene").lower_is_better


def test_delta_t_signs_for_classification():
    base = {"class_object": {"accuracy": 50.0, "top5": 80.0}}
    better = {"class_object": {"accuracy": 55.0, "top5": 88.0}}  # both accuracies up 10 %
    worse = {"class_object": {"accuracy": 45.0, "top5": 72.0}}
    assert delta_t(better, base)["class_object"] == pytest.approx(10.0)  # primary (top-1) only by default
    assert delta_t(better, base, {"object": "top5"})["class_object"] == pytest.approx(10.0)
    assert delta_t(worse, base, {"object": "top5"})["class_object"] == pytest.approx(-10.0)
    assert delta_t(better, base, {"object": ["accuracy", "top5"]})["mean"] == pytest.approx(10.0)


def test_delta_t_signs_for_depth():
    base = {"depth_euclidean": {"rmse": 2.0, "abs_rel": 0.25, "delta1": 80.0}}
    model = {"depth_euclidean": {"rmse": 1.5, "abs_rel": 0.30, "delta1": 84.0}}
    per_metric = {m: delta_t(model, base, {"depth": m})["depth_euclidean"] for m in ("rmse", "abs_rel", "delta1")}
    assert per_metric["rmse"] == pytest.approx(25.0)  # error down 25 % → +25
    assert per_metric["abs_rel"] == pytest.approx(-20.0)  # error up 20 % → −20
    assert per_metric["delta1"] == pytest.approx(5.0)  # share of good pixels up 5 % → +5 (was −5 before)
    both = delta_t(model, base, {"depth": ["rmse", "abs_rel", "delta1"]})
    assert both["depth_euclidean"] == pytest.approx((25.0 - 20.0 + 5.0) / 3)
    with pytest.raises(ValueError, match="empty metric list"):
        delta_t(model, base, {"depth": []})
    with pytest.raises(KeyError, match="delta2"):
        delta_t(model, base, {"depth": ["rmse", "delta2"]})


def test_delta_against_uses_primary_metrics_and_lists_missing_tasks():
    res = {"depth_euclidean": {"rmse": 1.5, "delta1": 10.0}, "normal": {"l1": 0.2}}
    out = delta_against(res, {"depth": {"rmse": 2.0, "delta1": 80.0}})
    assert out == {"per_task": {"depth_euclidean": pytest.approx(25.0)}, "mean": pytest.approx(25.0),
                   "tasks_without_baseline": ["normal"]}
    assert primary(res) == {"depth_euclidean": 1.5, "normal": 0.2}


def test_plug_in_task_declaring_only_lower_is_better():
    class Legacy(Task):
        name = domain = "legacy_eval_task"
        head_kind, channels, primary_metric, lower_is_better = "class", 4, "score", False

    register_task("legacy_eval_task", Legacy)
    try:
        task = get_task("legacy_eval_task")
        assert task.lower_is_better_for("score") is False and task.lower_is_better_for("loss") is True
        assert delta_t({"legacy_eval_task": {"score": 11.0}}, {"legacy_eval_task": {"score": 10.0}})["mean"] > 0
    finally:
        unregister_task("legacy_eval_task")


def test_format_results_marks_every_metric_direction():
    text = format_results({"a": {"depth_euclidean": {"rmse": 1.0, "abs_rel": 0.1, "delta1": float("nan")},
                                 "class_scene": {"accuracy": 50.0, "top5": 70.0}},
                           "b": {"depth_euclidean": {"rmse": 2.0}}})
    rows = {tuple(line.split()[:2]): line for line in text.splitlines()[1:-1]}
    assert set(rows) == {("depth_euclidean", "rmse"), ("depth_euclidean", "abs_rel"), ("depth_euclidean", "delta1"),
                         ("class_scene", "accuracy"), ("class_scene", "top5")}
    assert "rmse ↓*" in rows["depth_euclidean", "rmse"] and "abs_rel ↓ " in rows["depth_euclidean", "abs_rel"]
    assert "delta1 ↑ " in rows["depth_euclidean", "delta1"] and "top5 ↑ " in rows["class_scene", "top5"]
    assert "accuracy ↑*" in rows["class_scene", "accuracy"]
    assert rows["depth_euclidean", "delta1"].split()[-2:] == ["-", "-"]  # NaN and missing
    assert text.splitlines()[-1].startswith("↓ lower is better")
    short = format_results({"a": {"depth_euclidean": {"rmse": 1.0, "abs_rel": 0.1}}}, primary_only=True)
    assert len(short.splitlines()) == 3


def test_package_exports():
    assert set(squad.eval.__all__) == {"evaluate", "delta_t", "MetricAccumulator", "evaluate_model", "evaluate_run",
                                   "format_results"}
    assert all(getattr(squad.eval, name) is not None for name in squad.eval.__all__)
