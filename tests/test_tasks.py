"""The 13 Taskonomy tasks: names, decoding of files the test writes, targets, masked losses, metrics.

The metric accumulator, Δt and metric directions are tested in tests/test_eval.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from squad.data.taskonomy import read_raw
from squad.eval.metrics import add_sums
from squad.tasks import ALIASES, TASK_NAMES, DecodeError, get_task, register_task, resolve_task_names, unregister_task
from squad.tasks.base import Task

EXPECTED_CHANNELS = {
    "class_object": 1000, "class_scene": 365, "depth_euclidean": 1, "depth_zbuffer": 1, "normal": 3,
    "principal_curvature": 2, "reshading": 1, "edge_texture": 1, "edge_occlusion": 1, "keypoints2d": 1,
    "keypoints3d": 1, "segment_unsup2d": 1, "segment_unsup25d": 1,
}


def random_raw(name: str, rng: np.random.Generator, size: int = 12) -> np.ndarray:
    """A raw file array in the task's encoding, with some invalid pixels where the encoding has them."""
    task = get_task(name)
    if task.head_kind == "class":
        return rng.dirichlet(np.ones(task.channels)).astype(np.float32)
    if name == "normal":
        v = rng.normal(size=(size, size, 3))
        v /= np.linalg.norm(v, axis=-1, keepdims=True)
        raw = np.round((v + 1) * 127.5).astype(np.uint8)
        raw[0, :3] = 128
        return raw
    if task.bits == 16:
        raw = rng.integers(0, 30000, size=(size, size), dtype=np.uint16)
        if name.startswith("depth"):
            raw[1, :4] = 65535
        return raw
    channels = 3 if name in ("principal_curvature", "reshading") else 1
    hi = 64 if name.startswith("segment") else 256
    raw = rng.integers(0, hi, size=(size, size, channels), dtype=np.uint8)
    return raw[..., 0] if channels == 1 else raw


def batch_of(name: str, b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoded batch (values, masks) of a task."""
    rng = np.random.default_rng(seed)
    pairs = [get_task(name).decode(random_raw(name, rng)) for _ in range(b)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


# ---------------------------------------------------------------------------------------------------- names


def test_task_names_and_channels():
    assert len(TASK_NAMES) == 13
    assert TASK_NAMES[0] == "class_object" and TASK_NAMES[-1] == "segment_unsup25d"
    for name in TASK_NAMES:
        task = get_task(name)
        assert isinstance(task, Task)
        assert task.name == name == task.domain
        assert task.channels == EXPECTED_CHANNELS[name]
        assert task.head_kind == ("class" if name.startswith("class") else "dense")
        assert task.file_ext == (".npy" if name.startswith("class") else ".png")
        assert task.lower_is_better == (task.head_kind == "dense")
    assert get_task("depth").primary_metric == "rmse"
    assert get_task("curvature").primary_metric == "l2"


@pytest.mark.parametrize("alias,canonical", [
    ("depth", "depth_euclidean"), ("zdepth", "depth_zbuffer"), ("normal", "normal"),
    ("curvature", "principal_curvature"), ("reshading", "reshading"), ("edge2d", "edge_texture"),
    ("edge3d", "edge_occlusion"), ("keypoints2d", "keypoints2d"), ("keypoints3d", "keypoints3d"),
    ("segment2d", "segment_unsup2d"), ("segment25d", "segment_unsup25d"), ("object", "class_object"),
    ("scene", "class_scene"),
])
def test_aliases(alias, canonical):
    assert get_task(alias).name == canonical
    assert get_task(alias) is get_task(canonical)


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_task("deph")
    msg = str(err.value)
    assert "deph" in msg and "depth_euclidean" in msg and "edge2d" in msg
    with pytest.raises(ValueError):
        resolve_task_names(["depth", "nope"])
    with pytest.raises(ValueError):
        resolve_task_names([])


def test_resolve_task_names():
    assert resolve_task_names(["depth", "depth_euclidean", "object"]) == ["depth_euclidean", "class_object"]
    assert resolve_task_names("normal,edge2d") == ["normal", "edge_texture"]
    assert resolve_task_names("all") == list(TASK_NAMES)
    assert set(ALIASES.values()) <= set(TASK_NAMES)


def test_register_task_and_options():
    class Extra(Task):
        name = domain = "extra_test_task"
        head_kind, channels, primary_metric, lower_is_better = "class", 4, "accuracy", False

    register_task("extra_test_task", Extra, aliases=("extra",))
    try:
        assert get_task("extra").name == "extra_test_task"
        with pytest.raises(ValueError):
            register_task("depth", Extra)
    finally:
        unregister_task("extra_test_task")
    with pytest.raises(ValueError):
        get_task("extra")
    mse = get_task("object", loss="mse")
    assert mse.loss_kind == "mse" and mse is not get_task("object")
    with pytest.raises(ValueError):
        get_task("object", nonsense=1)


# -------------------------------------------------------------------------------------- decoding real files


def test_depth_png_roundtrip(tmp_path):
    metres = np.array([[0.5, 1.0, 2.25], [10.0, 100.0, 0.0]])
    code = np.round(metres * 512).astype(np.uint16)
    code[1, 2] = 65535  # no geometry
    Image.fromarray(code).save(tmp_path / "d.png")
    value, mask = get_task("depth").decode(read_raw(tmp_path / "d.png"))
    assert value.shape == (1, 2, 3) and mask.shape == (1, 2, 3) and mask.dtype == torch.bool
    assert mask[0].tolist() == [[True, True, True], [True, True, False]]
    expect = torch.tensor(metres, dtype=torch.float32)
    torch.testing.assert_close(value[0][mask[0]], expect[mask[0]], atol=1 / 1024, rtol=0)
    assert value[0, 1, 2] == 0


def test_normal_png_roundtrip(tmp_path):
    vecs = np.array([[[1, 0, 0], [0, -1, 0], [0, 0, 1], [0.6, 0.8, 0]]], dtype=np.float64)  # [1, 4, 3]
    code = np.round((vecs + 1) * 127.5).clip(0, 255).astype(np.uint8)
    code = np.concatenate([code, np.full((1, 1, 3), 128, np.uint8)], axis=1)  # invalid fill at the end
    Image.fromarray(code).save(tmp_path / "n.png")
    value, mask = get_task("normal").decode(read_raw(tmp_path / "n.png"))
    assert value.shape == (3, 1, 5)
    assert mask[0, 0].tolist() == [True, True, True, True, False]
    torch.testing.assert_close(value[:, 0, :4].T, torch.tensor(vecs[0], dtype=torch.float32), atol=0.01, rtol=0)
    torch.testing.assert_close(value[:, 0, :4].norm(dim=0), torch.ones(4))
    assert value[:, 0, 4].abs().sum() == 0


def test_scalar_and_class_files(tmp_path):
    edge = np.array([[0, 65535, 5243]], dtype=np.uint16)
    Image.fromarray(edge).save(tmp_path / "e.png")
    value, mask = get_task("edge2d").decode(read_raw(tmp_path / "e.png"))
    torch.testing.assert_close(value[0, 0], torch.tensor([0.0, 1.0, 5243 / 65535]))
    assert bool(mask.all())
    seg = np.array([[0, 5, 63]], dtype=np.uint8)
    Image.fromarray(seg).save(tmp_path / "s.png")
    value, _ = get_task("segment2d").decode(read_raw(tmp_path / "s.png"))
    assert value[0, 0].tolist() == [0.0, 5.0, 63.0]
    curv = np.zeros((1, 2, 3), np.uint8)
    curv[0, 0] = (127, 254, 0)
    curv[0, 1] = (0, 127, 9)
    Image.fromarray(curv).save(tmp_path / "c.png")
    value, _ = get_task("curvature").decode(read_raw(tmp_path / "c.png"))
    torch.testing.assert_close(value[:, 0], torch.tensor([[0.0, -1.0], [1.0, 0.0]]))
    probs = np.array([0.2, 0.8] + [0.0] * 363, np.float64)
    np.save(tmp_path / "p.npy", probs)
    value, mask = get_task("scene").decode(read_raw(tmp_path / "p.npy"))
    assert value.dtype == torch.float32 and bool(mask.all()) and value.argmax() == 1
    torch.testing.assert_close(value.sum(), torch.tensor(1.0))
    logits = np.linspace(-3, 3, 1000).astype(np.float32)
    value, _ = get_task("object").decode(logits)
    torch.testing.assert_close(value, torch.softmax(torch.from_numpy(logits), 0))


def test_decode_rejects_wrong_encodings():
    with pytest.raises(DecodeError, match="16-bit"):
        get_task("depth").decode(np.zeros((4, 4), np.uint8))
    with pytest.raises(DecodeError, match="1000"):
        get_task("object").decode(np.zeros(10, np.float32))
    with pytest.raises(DecodeError):
        get_task("normal").decode(np.zeros((4, 4), np.uint8))
    with pytest.raises(DecodeError):
        get_task("curvature").decode(np.zeros((4, 4), np.uint8))


def test_normal_hflip_negates_x():
    value, _ = get_task("normal").decode(random_raw("normal", np.random.default_rng(1)))
    flipped = get_task("normal").hflip(value)
    torch.testing.assert_close(flipped[0], -torch.flip(value[0], dims=(-1,)))
    torch.testing.assert_close(flipped[1:], torch.flip(value[1:], dims=(-1,)))
    batch = value[None].repeat(2, 1, 1, 1)
    torch.testing.assert_close(get_task("normal").hflip(batch)[1], flipped)


# ---------------------------------------------------------------------------------- losses and metrics


@pytest.mark.parametrize("name", TASK_NAMES)
def test_roundtrip_and_perfect_prediction(name):
    task = get_task(name)
    value, mask = batch_of(name)
    target = task.target(value)
    units = task.to_units(target)
    clipped = value.clamp(*task.spec.clip) if getattr(task, "spec", None) and task.spec.clip else value
    m = mask.expand_as(value) if task.head_kind == "dense" else mask.expand_as(value)
    torch.testing.assert_close(units[m], clipped[m], atol=1e-5, rtol=1e-4)
    assert float(task.loss(target, target, mask)) == pytest.approx(0.0, abs=1e-5)
    final = task.metrics(task.metric_sums(target, target, mask))
    if task.lower_is_better:
        assert final[task.primary_metric] == pytest.approx(0.0, abs=1e-4)
    else:
        assert final[task.primary_metric] == pytest.approx(100.0)
    if name.startswith("depth"):
        assert final["delta1"] == pytest.approx(100.0)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_masked_entries_do_not_count(name):
    task = get_task(name)
    value, mask = batch_of(name, b=4, seed=3)
    if task.head_kind == "class":
        mask = torch.tensor([[True], [False], [True], [False]])
    else:
        mask = mask.clone()
        mask[:, :, :, :5] = False
    target = task.target(value)
    pred = target + 0.1 * torch.randn_like(target)
    garbage = pred.clone()
    m = mask.expand_as(pred)
    garbage[~m] = torch.randn_like(pred)[~m] * 100
    assert float(task.loss(pred, target, mask)) > 0
    torch.testing.assert_close(task.loss(garbage, target, mask), task.loss(pred, target, mask))
    torch.testing.assert_close(task.metrics(task.metric_sums(garbage, target, mask)),
                               task.metrics(task.metric_sums(pred, target, mask)))


@pytest.mark.parametrize("name", TASK_NAMES)
def test_all_masked_batch_gives_zero_with_gradient(name):
    task = get_task(name)
    value, mask = batch_of(name, b=2)
    pred = task.target(value).clone().add_(1.0).requires_grad_(True)
    loss = task.loss(pred, task.target(value), torch.zeros_like(mask))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and float(pred.grad.abs().sum()) == 0


@pytest.mark.parametrize("name", TASK_NAMES)
def test_metric_sums_are_additive(name):
    task = get_task(name)
    value, mask = batch_of(name, b=4, seed=5)
    target = task.target(value)
    pred = target + 0.2 * torch.randn_like(target)
    whole = task.metric_sums(pred, target, mask)
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in whole.values())
    parts: dict[str, torch.Tensor] = {}
    add_sums(parts, task.metric_sums(pred[:1], target[:1], mask[:1]))
    add_sums(parts, task.metric_sums(pred[1:], target[1:], mask[1:]))
    torch.testing.assert_close(task.metrics(parts), task.metrics(whole))


def test_shape_errors_name_the_task():
    with pytest.raises(ValueError, match="normal"):
        get_task("normal").loss(torch.zeros(2, 1, 4, 4), torch.zeros(2, 1, 4, 4), torch.ones(2, 1, 4, 4))
    with pytest.raises(ValueError, match="class_scene"):
        get_task("scene").loss(torch.zeros(2, 10), torch.zeros(2, 10), torch.ones(2, 1))


def test_depth_metrics_by_hand():
    task = get_task("depth")
    gt = torch.tensor([1.0, 2.0, 4.0, 8.0]).view(1, 1, 2, 2)
    pred_m = torch.tensor([1.0, 2.6, 4.0, 4.0]).view(1, 1, 2, 2)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    final = task.metrics(task.metric_sums(task.target(pred_m), task.target(gt), mask))
    assert final["rmse"] == pytest.approx(math.sqrt((0.36 + 16) / 4), rel=1e-4)
    assert final["abs_rel"] == pytest.approx((0.3 + 0.5) / 4, rel=1e-4)
    assert final["delta1"] == pytest.approx(50.0)  # ratios 1, 1.3, 1, 2
    assert final["delta2"] == pytest.approx(75.0)
    assert final["delta3"] == pytest.approx(75.0)  # 2 > 1.953


def test_class_loss_is_soft_cross_entropy_minus_entropy():
    task = get_task("object")
    probs = torch.softmax(torch.randn(2, 1000), dim=1)
    logits = torch.randn(2, 1000, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss = task.loss(logits, task.target(probs), mask)
    ce = -(probs * torch.log_softmax(logits, dim=1)).sum(1).mean()
    entropy = -(probs * probs.log()).sum(1).mean()
    torch.testing.assert_close(loss, ce - entropy, atol=1e-4, rtol=1e-4)
    (g1,) = torch.autograd.grad(loss, logits)
    (g2,) = torch.autograd.grad(ce, logits)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)
    mse = get_task("object", loss="mse")
    torch.testing.assert_close(mse.loss(logits, probs, mask), ((logits - probs) ** 2).mean())


def test_normal_loss_ignores_prediction_scale():
    task = get_task("normal")
    value, mask = batch_of("normal")
    pred = value + 0.3 * torch.randn_like(value)
    torch.testing.assert_close(task.loss(pred, value, mask), task.loss(5 * pred, value, mask))


@pytest.mark.parametrize("name", TASK_NAMES)
@pytest.mark.parametrize("mask_shape", ["full", "squeezed"])
def test_empty_batch_gives_zero_loss_and_zero_sums(name, mask_shape):
    """train.tasks_per_image can leave a task without any image in a micro-batch: 0 loss (with a gradient path),
    all-zero metric sums, for every task kind and both mask layouts the dataset gives."""
    task = get_task(name)
    if task.head_kind == "class":
        shape, mask = (0, task.channels), torch.zeros((0, 1) if mask_shape == "full" else (0,), dtype=torch.bool)
    else:
        shape = (0, task.channels, 8, 8)
        mask = torch.zeros((0, 1, 8, 8) if mask_shape == "full" else (0, 8, 8), dtype=torch.bool)
    pred = torch.zeros(shape, requires_grad=True)
    loss = task.loss(pred, torch.zeros(shape), mask)
    assert loss.shape == () and float(loss.detach()) == 0.0
    loss.backward()
    assert pred.grad is not None and pred.grad.shape == shape
    sums = task.metric_sums(pred.detach(), torch.zeros(shape), mask)
    assert sums and all(float(v) == 0.0 for v in sums.values())
    assert all(math.isnan(v) for v in task.metrics(sums).values())  # nothing seen: NaN, never a fake 0


@pytest.mark.parametrize("name", ["depth_euclidean", "depth_zbuffer"])
def test_depth_units_clamped_to_the_encoding(name):
    """An untrained head's outputs far outside the encoding's [0, 1] give depths within [0, 65535/512] m, so
    metrics stay finite (expm1 of unclamped outputs overflowed to inf from about 8)."""
    task = get_task(name)
    pred = torch.tensor([-5.0, 0.0, 0.5, 1.0, 8.0, 50.0, 1e4]).view(1, 1, 1, 7)
    units = task.to_units(pred)
    assert torch.isfinite(units).all()
    assert float(units.min()) == 0.0 and float(units.max()) == pytest.approx(65535 / 512)
    assert float(units[0, 0, 0, 2]) == pytest.approx((65536**0.5 - 1) / 512)  # inside the range: unchanged
    value, mask = batch_of(name)
    final = task.metrics(task.metric_sums(torch.full_like(value, 100.0), task.target(value), mask))
    assert math.isfinite(final["rmse"]) and final["rmse"] < 65535 / 512
