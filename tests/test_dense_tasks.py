"""PASCAL-Context and NYUD-v2 tasks: names, decoding of the readers' raw arrays, losses, and every metric against a
hand computation (odsF's matching itself is in tests/test_edges.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from squad.data.transforms import SamplePipeline
from squad.eval.metrics import add_sums, delta_t
from squad.tasks import (
    BENCHMARK_ALIASES,
    DENSE_LABEL_TASKS,
    NYUD_TASKS,
    PASCAL_TASKS,
    TASK_NAMES,
    DecodeError,
    get_task,
    register_task,
    resolve_task_names,
)
from squad.tasks.base import Task

CHANNELS = {"semseg": 21, "human_parts": 7, "saliency": 1, "normals": 3, "edge": 1, "nyud_semseg": 40,
            "nyud_depth": 1}
PRIMARY = {"semseg": ("miou", False), "human_parts": ("miou", False), "saliency": ("maxf", False),
           "normals": ("angle_mean", True), "edge": ("odsf", False), "nyud_semseg": ("miou", False),
           "nyud_depth": ("rmse", True)}
SEGMENTATION = ("semseg", "human_parts", "nyud_semseg")


def random_raw(name: str, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    """A raw array as the readers hand it over (squad/data/pascal.py, nyud.py), with some invalid pixels."""
    if name in ("semseg", "human_parts"):
        raw = rng.integers(0, CHANNELS[name], size=(size, size)).astype(np.uint8)
        raw[0, :3] = 255
        return raw
    if name == "nyud_semseg":
        return rng.integers(0, 41, size=(size, size)).astype(np.uint8)  # 0 = unlabelled
    if name == "saliency":
        return rng.integers(0, 256, size=(size, size)).astype(np.uint8)
    if name == "normals":
        v = rng.normal(size=(size, size, 3))
        v /= np.linalg.norm(v, axis=-1, keepdims=True)
        raw = np.round((v + 1) * 127.5).astype(np.uint8)
        raw[1, :4] = 128
        return raw
    if name == "edge":
        return (rng.random((size, size)) < 0.1).astype(np.uint8)
    depth = rng.uniform(0.5, 8.0, size=(size, size)).astype(np.float32)
    depth[2, :3] = 0
    return depth


def batch_of(name: str, b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded values and masks as the data pipeline gives them (edge: thinned by its frame filter)."""
    rng = np.random.default_rng(seed)
    task = get_task(name)
    pairs = [task.decode(random_raw(name, rng)) for _ in range(b)]
    values = [task.filter_frame(v, m) for v, m in pairs]
    return torch.stack(values), torch.stack([p[1] for p in pairs])


def perfect_pred(name: str, value: torch.Tensor) -> torch.Tensor:
    """Head outputs that predict `value` exactly (logits for the classification tasks)."""
    task = get_task(name)
    if name in SEGMENTATION:
        ids = torch.where(value == 255, torch.zeros(()), value).long()[:, 0]
        return torch.nn.functional.one_hot(ids, task.channels).permute(0, 3, 1, 2).float() * 20
    return task.target(value)


def noisy_pred(name: str, value: torch.Tensor, scale: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = perfect_pred(name, value)
    return p + scale * torch.randn(p.shape, generator=g) * (20 if name in SEGMENTATION + ("saliency", "edge") else 1)


# ---------------------------------------------------------------------------------------------------- names


def test_names_groups_and_aliases():
    assert len(TASK_NAMES) == 13 and not set(TASK_NAMES) & set(DENSE_LABEL_TASKS)
    assert set(PASCAL_TASKS) | set(NYUD_TASKS) == set(DENSE_LABEL_TASKS)
    for name in DENSE_LABEL_TASKS:
        task = get_task(name)
        assert isinstance(task, Task) and task.name == name and task.head_kind == "dense"
        assert task.channels == CHANNELS[name]
        metric, lower = PRIMARY[name]
        assert task.primary_metric == metric and task.lower_is_better == lower
    assert get_task("sal").name == "saliency" and get_task("parts").name == "human_parts"
    assert get_task("edges").name == "edge"
    assert set(BENCHMARK_ALIASES.values()) <= set(DENSE_LABEL_TASKS)
    # Taskonomy's aliases keep their meaning
    assert get_task("depth").name == "depth_euclidean" and get_task("normal").name == "normal"
    assert get_task("normals") is not get_task("normal")
    assert resolve_task_names("pascal_context") == list(PASCAL_TASKS)
    assert resolve_task_names("nyud,sal") == [*NYUD_TASKS, "saliency"]
    assert resolve_task_names("all") == list(TASK_NAMES)
    with pytest.raises(ValueError, match="already registered"):
        register_task("sal", Task)
    with pytest.raises(ValueError) as err:
        get_task("semseg2")
    assert "nyud_depth" in str(err.value) and "sal→saliency" in str(err.value)


def test_metric_directions():
    sem, sal, nor, edge, dep = (get_task(n) for n in ("semseg", "saliency", "normals", "edge", "nyud_depth"))
    assert not sem.lower_is_better_for("miou_all") and not sem.lower_is_better_for("pixel_acc")
    assert not sal.lower_is_better_for("miou")
    assert nor.lower_is_better_for("angle_median") and not nor.lower_is_better_for("within_11_25")
    assert not edge.lower_is_better_for("ods_recall")
    assert dep.lower_is_better_for("log_rmse") and not dep.lower_is_better_for("delta1")


def test_delta_m_with_each_metric_direction():
    """Δm = mean over tasks of (−1)^l (M − M_stl) / M_stl, l = 1 when lower is better (Maninis et al.)."""
    stl = {"semseg": {"miou": 60.0}, "human_parts": {"miou": 50.0}, "saliency": {"maxf": 80.0, "miou": 60.0},
           "normals": {"angle_mean": 14.0}, "edge": {"odsf": 70.0}}
    mtl = {"semseg": {"miou": 66.0}, "human_parts": {"miou": 45.0}, "saliency": {"maxf": 80.0, "miou": 63.0},
           "normals": {"angle_mean": 15.4}, "edge": {"odsf": 77.0}}
    out = delta_t(mtl, stl)
    expect = {"semseg": 10.0, "human_parts": -10.0, "saliency": 0.0, "normals": -10.0, "edge": 10.0}
    for k, v in expect.items():
        assert out[k] == pytest.approx(v)
    assert out["mean"] == pytest.approx(0.0)
    assert delta_t(mtl, stl, metrics={"sal": "miou"})["saliency"] == pytest.approx(5.0)  # M3ViT's saliency metric
    nyud = delta_t({"nyud_depth": {"rmse": 0.55}, "nyud_semseg": {"miou": 44.0}},
                   {"nyud_depth": {"rmse": 0.5}, "nyud_semseg": {"miou": 40.0}})
    assert nyud["nyud_depth"] == pytest.approx(-10.0) and nyud["mean"] == pytest.approx(0.0)


# ------------------------------------------------------------------------------------------------ generic


@pytest.mark.parametrize("name", DENSE_LABEL_TASKS)
def test_roundtrip_and_perfect_prediction(name):
    task = get_task(name)
    value, mask = batch_of(name)
    assert value.dtype == torch.float32 and mask.dtype == torch.bool and mask.shape == (3, 1, 16, 16)
    m = mask.expand_as(value)
    torch.testing.assert_close(task.to_units(task.target(value))[m], value[m], atol=1e-6, rtol=0)
    pred = perfect_pred(name, value)
    assert float(task.loss(pred, task.target(value), mask)) == pytest.approx(0.0, abs=1e-5)
    final = task.metrics(task.metric_sums(pred, task.target(value), mask))
    metric, lower = PRIMARY[name]
    assert final[metric] == pytest.approx(0.0 if lower else 100.0, abs=1e-3)


@pytest.mark.parametrize("name", DENSE_LABEL_TASKS)
def test_masked_entries_do_not_count(name):
    task = get_task(name)
    value, mask = batch_of(name, b=4, seed=3)
    mask = mask.clone()
    mask[:, :, :, :5] = False
    target = task.target(value)
    pred = noisy_pred(name, value, 0.3)
    garbage = pred.clone()
    m = mask.expand_as(pred)
    garbage[~m] = torch.randn_like(pred)[~m] * 100
    assert float(task.loss(pred, target, mask)) > 0
    torch.testing.assert_close(task.loss(garbage, target, mask), task.loss(pred, target, mask))
    torch.testing.assert_close(task.metrics(task.metric_sums(garbage, target, mask)),
                               task.metrics(task.metric_sums(pred, target, mask)), equal_nan=True)


@pytest.mark.parametrize("name", DENSE_LABEL_TASKS)
def test_all_masked_batch_gives_zero_with_gradient(name):
    task = get_task(name)
    value, mask = batch_of(name, b=2)
    pred = noisy_pred(name, value, 0.5).requires_grad_(True)
    loss = task.loss(pred, task.target(value), torch.zeros_like(mask))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and float(pred.grad.abs().sum()) == 0


@pytest.mark.parametrize("name", DENSE_LABEL_TASKS)
def test_metric_sums_are_additive_scalars(name):
    task = get_task(name)
    value, mask = batch_of(name, b=4, seed=5)
    target = task.target(value)
    pred = noisy_pred(name, value, 0.4, seed=1)
    whole = task.metric_sums(pred, target, mask)
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in whole.values())
    parts: dict[str, torch.Tensor] = {}
    add_sums(parts, task.metric_sums(pred[:1], target[:1], mask[:1]))
    add_sums(parts, task.metric_sums(pred[1:], target[1:], mask[1:]))
    torch.testing.assert_close(task.metrics(parts), task.metrics(whole))


@pytest.mark.parametrize("name", DENSE_LABEL_TASKS)
def test_empty_batch_gives_zero_loss_and_nan_metrics(name):
    task = get_task(name)
    pred = torch.zeros((0, task.channels, 8, 8), requires_grad=True)
    target = torch.zeros((0, 1 if name in SEGMENTATION else task.channels, 8, 8))
    mask = torch.zeros((0, 1, 8, 8), dtype=torch.bool)
    loss = task.loss(pred, target, mask)
    assert loss.shape == () and float(loss.detach()) == 0.0
    loss.backward()
    sums = task.metric_sums(pred.detach(), target, mask)
    assert sums and all(float(v) == 0.0 for v in sums.values())
    assert all(math.isnan(v) for v in task.metrics(sums).values())


def test_shape_errors_name_the_task():
    with pytest.raises(ValueError, match="semseg"):
        get_task("semseg").loss(torch.zeros(2, 20, 4, 4), torch.zeros(2, 1, 4, 4), torch.ones(2, 1, 4, 4))
    with pytest.raises(ValueError, match="normals"):
        get_task("normals").loss(torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 4), torch.ones(2, 1, 4, 4))


# ---------------------------------------------------------------------------------------------- segmentation


def test_miou_by_hand():
    task = get_task("semseg")
    truth = torch.tensor([[0, 0, 1, 1], [2, 2, 255, 1]], dtype=torch.float32).view(1, 1, 2, 4)
    guess = torch.tensor([[0, 1, 1, 1], [2, 0, 3, 1]]).view(1, 2, 4)
    logits = torch.nn.functional.one_hot(guess, 21).permute(0, 3, 1, 2).float()
    _, mask = task.decode(truth[0, 0].numpy().astype(np.uint8))
    final = task.metrics(task.metric_sums(logits, task.target(truth), mask[None]))
    # valid pixels: 7 (the 255 one is ignored, so its prediction 3 never counts)
    # class 0: tp 1, fp 1 (truth 2 predicted 0), fn 1 (truth 0 predicted 1) → 1/3
    # class 1: tp 3, fp 1, fn 0 → 3/4;  class 2: tp 1, fp 0, fn 1 → 1/2
    ious = [1 / 3, 3 / 4, 1 / 2]
    assert final["miou"] == pytest.approx(100 * sum(ious) / 3)
    assert final["miou_all"] == pytest.approx(100 * sum(ious) / 21)  # the public formula: absent classes count 0
    assert final["pixel_acc"] == pytest.approx(100 * 5 / 7)


def test_human_parts_without_parts_have_no_target():
    task = get_task("human_parts")
    _, mask = task.decode(np.full((4, 5), 255, np.uint8))  # the reader's "no person" map
    assert not mask.any()
    _, mask = task.decode(np.zeros((4, 5), np.uint8))  # all background (e.g. a crop beside the person)
    assert not mask.any()
    raw = np.zeros((4, 5), np.uint8)
    raw[1, 1] = 3
    value, mask = task.decode(raw)
    assert mask.all() and value[0, 1, 1] == 3
    with pytest.raises(DecodeError, match="outside"):
        task.decode(np.full((2, 2), 7, np.uint8))


def test_nyud_semseg_shifts_labels_and_ignores_unlabelled():
    task = get_task("nyud_semseg")
    value, mask = task.decode(np.array([[0, 1, 40]], np.uint8))
    assert value[0, 0].tolist() == [255.0, 0.0, 39.0] and mask[0, 0].tolist() == [False, True, True]
    with pytest.raises(DecodeError, match="41"):
        task.decode(np.array([[41]], np.uint8))
    with pytest.raises(DecodeError):
        task.decode(np.zeros((2, 2, 3), np.uint8))  # a colour image is not a label map


# -------------------------------------------------------------------------------------------------- saliency


def test_saliency_maxf_and_miou_by_hand():
    task = get_task("saliency")
    truth = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32).view(2, 1, 1, 4)
    prob = torch.tensor([[0.95, 0.05, 0.95, 0.05], [0.95, 0.95, 0.05, 0.05]]).view(2, 1, 1, 4)
    logits = torch.logit(prob)
    mask = torch.ones_like(truth, dtype=torch.bool)
    sums = task.metric_sums(logits, task.target(truth), mask)
    # image 1: tp 1, fp 1, fn 1 → P ½, R ½, J ⅓;  image 2: tp 1, fp 1, fn 0 → P ½, R 1, J ½ (every threshold)
    p, r = 0.5, 0.75
    final = task.metrics(sums)
    assert final["maxf"] == pytest.approx(100 * 2 * p * r / (p + r), abs=1e-6)
    assert final["miou"] == pytest.approx(100 * (1 / 3 + 1 / 2) / 2, abs=1e-6)
    beta = get_task("saliency", beta2=0.3).metrics(sums)["maxf"]
    assert beta == pytest.approx(100 * 1.3 * p * r / (0.3 * p + r), abs=1e-6)


def test_saliency_threshold_and_empty_images():
    task = get_task("saliency")
    value, mask = task.decode(np.array([[0, 127, 128, 255]], np.uint8))
    assert value[0, 0].tolist() == [0.0, 0.0, 1.0, 1.0] and mask.all()  # raw / 255 > 0.5
    empty = torch.zeros(1, 1, 2, 2)
    all_valid = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    sums = task.metric_sums(torch.full((1, 1, 2, 2), -5.0), task.target(empty), all_valid)
    assert task.metrics(sums)["miou"] == pytest.approx(100.0)  # nothing salient, nothing predicted: Jaccard 1
    balanced = get_task("saliency", loss="balanced")
    pred = torch.zeros(1, 1, 2, 2, requires_grad=True)
    t = task.target(torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 2, 2))
    loss = balanced.loss(pred, t, torch.ones(1, 1, 2, 2, dtype=torch.bool))
    assert float(loss.detach()) == pytest.approx((0.75 * math.log(2) + 3 * 0.25 * math.log(2)) / 4)


# --------------------------------------------------------------------------------------------------- normals


def test_normals_angles_by_hand():
    task = get_task("normals")
    angles = [0.0, 10.0, 20.0, 45.0, 90.0]
    truth = torch.zeros(1, 3, 1, 6)
    truth[0, 2] = 1.0  # all along z
    pred = torch.zeros(1, 3, 1, 6)
    for i, a in enumerate(angles):
        pred[0, 0, 0, i] = math.sin(math.radians(a)) * 3  # scale does not matter
        pred[0, 2, 0, i] = math.cos(math.radians(a)) * 3
    pred[0, 0, 0, 5] = -1.0  # 90° off, but an invalid pixel
    mask = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    mask[..., 5] = False
    final = task.metrics(task.metric_sums(pred, truth, mask))
    assert final["angle_mean"] == pytest.approx(sum(angles) / 5, abs=1e-4)
    assert final["angle_rmse"] == pytest.approx(math.sqrt(sum(a * a for a in angles) / 5), abs=1e-4)
    assert final["angle_median"] == pytest.approx(20.0, abs=0.5)
    assert final["within_11_25"] == pytest.approx(40.0)
    assert final["within_22_5"] == pytest.approx(60.0) and final["within_30"] == pytest.approx(60.0)


def test_normals_decode_both_encodings_and_flip():
    task = get_task("normals")
    code = np.array([[[255, 128, 128], [128, 128, 128], [0, 128, 128]]], np.uint8)  # +x, fill, −x
    value, mask = task.decode(code)
    assert mask[0, 0].tolist() == [True, False, True]
    torch.testing.assert_close(value[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]), atol=0.01, rtol=0)
    np.testing.assert_array_equal(task.raw_valid(code), mask[0].numpy())
    vec = np.array([[[0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]], np.float32)  # NYUD's .npy: zero = invalid
    value, mask = task.decode(vec)
    assert mask[0, 0].tolist() == [True, False] and value[2, 0, 0] == 1.0
    flipped = task.hflip(value)
    torch.testing.assert_close(flipped[0], -torch.flip(value[0], dims=(-1,)))
    torch.testing.assert_close(flipped[1:], torch.flip(value[1:], dims=(-1,)))


# ------------------------------------------------------------------------------------------------------ edge


def test_edge_task_scores_and_options():
    task = get_task("edge")
    gt = torch.zeros(1, 1, 32, 32)
    gt[0, 0, 10, 4:28] = 1.0
    mask = torch.ones_like(gt, dtype=torch.bool)
    t = task.target(gt)
    perfect = task.metrics(task.metric_sums(t, t, mask))
    assert perfect == {"odsf": 100.0, "ods_precision": 100.0, "ods_recall": 100.0}
    nothing = task.metrics(task.metric_sums(torch.full_like(gt, -20.0), t, mask))
    assert nothing["odsf"] == 0.0
    shifted = torch.roll(t, 1, dims=2)  # one row down: 1 px > 0.0075 · 45 px, but < 0.05 · 45 px
    assert task.metrics(task.metric_sums(shifted, t, mask))["odsf"] == 0.0
    loose = get_task("edge", max_dist=0.05, thresholds=9)
    assert len(loose.thresholds) == 9 and loose.thresholds[0] == 0.1
    assert loose.metrics(loose.metric_sums(shifted, t, mask))["odsf"] == 100.0
    assert len(task.metric_sums(t, t, mask)) == 2 * 99 + 1
    with pytest.raises(ValueError, match="max_dist"):
        get_task("edge", max_dist=-1)


def test_edge_loss_weights_boundary_pixels():
    task = get_task("edge")
    t = task.target(torch.tensor([1.0, 0.0]).view(1, 1, 1, 2))
    loss = task.loss(torch.zeros(1, 1, 1, 2), t, torch.ones(1, 1, 1, 2, dtype=torch.bool))
    assert float(loss) == pytest.approx((0.95 * math.log(2) + 0.05 * math.log(2)) / 2)


def test_edge_raw_forms_and_thinning_filter():
    task = get_task("edge")
    for raw in (np.array([[0, 1]], np.uint8), np.array([[False, True]]), np.array([[0.0, 1.0]], np.float32)):
        compact = task.compact_raw(raw)
        assert compact.dtype == np.uint8 and compact.tolist() == [[0, 255]]
        np.testing.assert_array_equal(task.compact_raw(compact), compact)  # idempotent
    band = np.zeros((9, 12), np.uint8)
    band[3:6, 1:11] = 1
    value, _ = task.decode(band)
    thinned = task.filter_frame(value, None)
    assert thinned.shape == value.shape and thinned.sum(dim=-2).max() == 1


def test_pipeline_resizes_each_kind():
    """Through the shared sample pipeline (resize 96 → 48, centred crop): ids stay ids, a 1-px boundary survives
    the downscale as a thin line, normals keep their fill masked."""
    rng = np.random.default_rng(0)
    sem = np.zeros((96, 96), np.uint8)
    sem[:, 48:] = 15
    sem[:4] = 255
    edge = np.zeros((96, 96), np.uint8)
    edge[:, 48] = 1
    normals = np.full((96, 96, 3), 128, np.uint8)
    normals[:, :48] = (128, 128, 255)
    raws = {"rgb": rng.integers(0, 256, (96, 96, 3)).astype(np.uint8), "semseg": sem, "edge": edge,
            "saliency": np.where(sem == 15, 255, 0).astype(np.uint8), "normals": normals}
    pipe = SamplePipeline(["semseg", "edge", "saliency", "normals"], image_size=48)
    _, targets, masks = pipe(raws, None)
    assert set(torch.unique(targets["semseg"]).tolist()) == {0.0, 15.0, 255.0}
    assert not masks["semseg"][0, 0].any() and masks["semseg"][0, 2:].all()
    cols = targets["edge"][0].sum(dim=0)
    assert targets["edge"][0].sum(dim=1).max() == 1 and cols.sum() >= 46  # a 1-px line (thinning may shorten an end)
    assert int(cols.argmax()) in (23, 24)
    assert masks["normals"][0, :, :22].all() and not masks["normals"][0, :, 26:].any()
    assert targets["saliency"][0][:, :23].sum() == 0 and targets["saliency"][0][2:, 25:].all()


# ------------------------------------------------------------------------------------------------ NYUD depth


def test_nyud_depth_by_hand():
    task = get_task("nyud_depth")
    value, mask = task.decode(np.array([[1.0, 2.0, 4.0, 0.0]], np.float32))
    assert mask[0, 0].tolist() == [True, True, True, False]
    pred = torch.tensor([1.5, 2.0, 2.0, 7.0]).view(1, 1, 1, 4)
    final = task.metrics(task.metric_sums(pred, task.target(value[None]), mask[None]))
    assert final["rmse"] == pytest.approx(math.sqrt((0.25 + 0 + 4) / 3))
    assert final["log_rmse"] == pytest.approx(math.sqrt((math.log(1.5) ** 2 + math.log(2) ** 2) / 3))
    assert final["abs_rel"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert final["delta1"] == pytest.approx(100 / 3)  # ratios 1.5, 1, 2
    assert float(task.loss(pred, value[None], mask[None])) == pytest.approx((0.5 + 0 + 2) / 3)
    with pytest.raises(DecodeError, match="float"):
        task.decode(np.zeros((2, 2), np.uint16))


# ------------------------------------------------------------------------------------------------ with a model


@pytest.mark.parametrize("tasks", [PASCAL_TASKS, NYUD_TASKS], ids=["pascal_context", "nyud"])
def test_model_heads_losses_and_evaluate(tasks):
    """The dense heads' outputs ([B, C, H, W] at the image size) go through every task's loss (with gradients) and
    `squad.eval.evaluate` (the metric sums of a whole loader)."""
    from squad.eval import evaluate
    from tests.helpers import tiny_model

    heads = [{"name": t, "kind": "dense", "channels": get_task(t).channels} for t in tasks]
    model = tiny_model(heads, img_size=32)
    rng = np.random.default_rng(0)
    batches = []
    for seed in range(2):
        values = {t: batch_of(t, b=2, seed=seed) for t in tasks}
        size = 16  # batch_of's maps, upsampled to the model's 32 px (nearest: labels stay labels)
        up = {t: (torch.nn.functional.interpolate(v, scale_factor=32 // size, mode="nearest"),
                  torch.nn.functional.interpolate(m.float(), scale_factor=32 // size, mode="nearest").bool())
              for t, (v, m) in values.items()}
        batches.append({"rgb": torch.from_numpy(rng.random((2, 3, 32, 32), dtype=np.float32)),
                        "targets": {t: v for t, (v, _) in up.items()}, "masks": {t: m for t, (_, m) in up.items()}})
    model.train()
    out = model(batches[0]["rgb"], list(tasks))
    total = 0.0
    for t in tasks:
        task = get_task(t)
        assert out.preds[t].shape == (2, task.channels, 32, 32)
        total = total + task.loss(out.preds[t].float(), task.target(batches[0]["targets"][t]), batches[0]["masks"][t])
    total.backward()
    results = evaluate(model, batches, list(tasks))
    for t in tasks:
        metric, _ = PRIMARY[t]
        assert math.isfinite(results[t][metric]), (t, results[t])
