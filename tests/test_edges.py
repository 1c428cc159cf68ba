"""SEISM-style boundary scoring (`squad.tasks.edges`): thinning, one-to-one matching within the tolerance, odsF —
on hand-made maps whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import ndimage

from squad.tasks.edges import (
    NYUD_MAX_DIST,
    PASCAL_MAX_DIST,
    SEISM_THRESHOLDS,
    diagonal,
    edge_counts,
    match_counts,
    ods_f,
    thin,
)

SIZE = 200  # diagonal 282.8 px: tolerance 2.12 px (PASCAL) and 3.11 px (NYUD)


def line_map(row: int = 100, cols: tuple[int, int] = (20, 180), size: int = SIZE) -> np.ndarray:
    m = np.zeros((size, size), dtype=bool)
    m[row, cols[0]: cols[1]] = True
    return m


def score(prob: np.ndarray, gt: np.ndarray, **kw) -> dict[str, float]:
    counts = edge_counts(prob[None].astype(np.float32), gt[None], **kw)
    return ods_f(counts["matched"], counts["pred"], counts["gt"])


# ------------------------------------------------------------------------------------------------------ thinning


def test_thin_bar_becomes_its_centre_line():
    bar = np.zeros((10, 14), dtype=bool)
    bar[3:6, 1:13] = True  # 3 px thick, 12 long
    out = thin(bar)
    assert out.sum(axis=0).max() == 1  # one pixel per column
    rows, cols = np.nonzero(out)
    assert set(rows) == {4}  # the middle row
    assert cols.min() == 2 and cols.max() == 11  # the ends shorten by one pixel each (bwmorph 'thin')


def test_thin_keeps_lines_and_points_and_is_idempotent():
    line = line_map()
    diag = np.eye(30, dtype=bool)
    point = np.zeros((5, 5), dtype=bool)
    point[2, 2] = True
    for m in (line, diag, point):
        np.testing.assert_array_equal(thin(m), m)
    blob = ndimage.binary_dilation(line, iterations=3)
    once = thin(blob)
    np.testing.assert_array_equal(thin(once), once)


def test_thin_square_to_a_point_and_ring_to_a_loop():
    square = np.zeros((9, 9), dtype=bool)
    square[1:8, 1:8] = True
    out = thin(square)
    assert out.sum() == 1 and out[4, 4]
    yy, xx = np.mgrid[:41, :41]
    r = np.hypot(yy - 20, xx - 20)
    ring = (r >= 8) & (r <= 14)
    loop = thin(ring)
    assert ndimage.label(loop, structure=np.ones((3, 3)))[1] == 1  # still one 8-connected curve
    assert ndimage.label(~loop)[1] == 2  # which still encloses the hole
    assert loop.sum() < ring.sum() / 4


def test_thin_stack_equals_each_map():
    rng = np.random.default_rng(0)
    maps = ndimage.gaussian_filter(rng.random((6, 24, 30)), (0, 1.5, 1.5)) > 0.5
    stacked = thin(maps)
    for i in range(len(maps)):
        np.testing.assert_array_equal(stacked[i], thin(maps[i]))
    with pytest.raises(ValueError, match="shape"):
        thin(np.zeros(5))


# ------------------------------------------------------------------------------------------------------ matching


def test_match_counts_one_to_one_within_radius():
    gt = np.zeros((10, 10), dtype=bool)
    gt[5, 5] = True
    pred = np.zeros_like(gt)
    pred[5, 4] = pred[5, 6] = True  # two candidates for one true pixel
    assert match_counts(pred, gt, 1.0) == 1
    assert match_counts(pred, gt, 0.9) == 0  # 1 px away, tolerance < 1 px
    pred2 = np.zeros_like(gt)
    pred2[6, 6] = True  # sqrt(2) px away
    assert match_counts(pred2, gt, 1.4) == 0 and match_counts(pred2, gt, 1.5) == 1
    # a maximum matching, not a greedy one: A-B close, A-C close, D only near B
    gt3 = np.zeros((10, 10), dtype=bool)
    gt3[2, 2] = gt3[2, 4] = True
    pred3 = np.zeros_like(gt3)
    pred3[2, 3] = pred3[2, 5] = True  # (2,3) near both, (2,5) only near (2,4)
    assert match_counts(pred3, gt3, 1.0) == 2
    stack = match_counts(np.stack([pred, pred2]), np.stack([gt, gt]), [1.0, 1.0])
    assert stack.tolist() == [1, 0]


def test_diagonal_of_the_scored_region():
    assert diagonal(None, (30, 40)) == 50.0
    valid = np.zeros((64, 64), dtype=bool)
    valid[8:56, :] = True  # a 48 × 64 image letterboxed into 64 × 64
    assert diagonal(valid, (64, 64)) == 80.0


# -------------------------------------------------------------------------------------------------------- odsF


def test_perfect_prediction_scores_one():
    gt = line_map() | np.eye(SIZE, dtype=bool)
    best = score(gt.astype(np.float32), gt)
    assert best["odsf"] == 1.0 and best["precision"] == 1.0 and best["recall"] == 1.0


@pytest.mark.parametrize("shift,max_dist,expect", [
    (1, PASCAL_MAX_DIST, 1.0),  # 1 px < 2.12 px
    (2, PASCAL_MAX_DIST, 1.0),
    (3, PASCAL_MAX_DIST, 0.0),  # 3 px > 2.12 px
    (3, NYUD_MAX_DIST, 1.0),  # 3 px < 3.11 px
    (4, NYUD_MAX_DIST, 0.0),
])
def test_shifted_prediction_within_and_beyond_the_tolerance(shift, max_dist, expect):
    radius = {PASCAL_MAX_DIST: 2.1213, NYUD_MAX_DIST: 3.1113}[max_dist]
    assert max_dist * math.hypot(SIZE, SIZE) == pytest.approx(radius, abs=1e-3)
    gt = line_map()
    pred = line_map(row=100 + shift)
    assert score(pred.astype(np.float32), gt, max_dist=max_dist)["odsf"] == expect


def test_half_the_boundary_predicted():
    gt = line_map(cols=(20, 180))  # 160 px
    pred = line_map(cols=(20, 100))  # its first 80 px
    best = score(pred.astype(np.float32), gt)
    assert best["precision"] == 1.0 and best["recall"] == 0.5
    assert best["odsf"] == pytest.approx(2 * 0.5 / 1.5)


def test_thick_prediction_is_thinned_before_matching():
    gt = line_map(cols=(20, 180))  # 160 px
    thick = np.zeros_like(gt)
    thick[99:102, 20:180] = True  # 3 px thick around the truth
    best = score(thick.astype(np.float32), gt)
    assert best["precision"] == 1.0  # thinned to the 158-px centre line (ends shortened by one each)
    assert best["recall"] == pytest.approx(158 / 160)
    raw = score(thick.astype(np.float32), gt, thin_pred=False)
    assert raw["precision"] == pytest.approx(160 / 480)


def test_thresholds_pick_the_best_operating_point():
    gt = line_map()
    prob = np.zeros(gt.shape, dtype=np.float32)
    prob[gt] = 0.6
    prob[50, 10:190] = 0.3  # a false boundary, above thresholds < 0.3 only
    counts = edge_counts(prob[None], gt[None])
    best = ods_f(counts["matched"], counts["pred"], counts["gt"], SEISM_THRESHOLDS)
    assert best["odsf"] == 1.0 and 0.3 <= best["threshold"] < 0.6
    low = SEISM_THRESHOLDS.index(0.1)
    assert counts["pred"][low] == 160 + 180 and counts["matched"][low] == 160


def test_empty_predictions_and_truths():
    gt = line_map()
    zero = np.zeros(gt.shape, dtype=np.float32)
    assert score(zero, gt) == {"odsf": 0.0, "precision": 1.0, "recall": 0.0, "threshold": 0.0}
    best = score(gt.astype(np.float32), np.zeros_like(gt))  # boundaries where there are none
    assert best["odsf"] == 0.0 and best["precision"] == 0.0


def test_counts_add_up_over_batches_and_respect_the_mask():
    rng = np.random.default_rng(1)
    gt = np.stack([line_map(row=r, size=64) for r in (10, 30, 50)])
    prob = np.clip(ndimage.gaussian_filter(gt.astype(np.float32), (0, 1, 1)) * 3 + rng.random(gt.shape) * 0.2, 0, 1)
    whole = edge_counts(prob, gt, thresholds=(0.2, 0.5, 0.8), max_dist=0.02)
    parts = [edge_counts(prob[i: i + 1], gt[i: i + 1], thresholds=(0.2, 0.5, 0.8), max_dist=0.02) for i in range(3)]
    for key in ("matched", "pred", "gt"):
        np.testing.assert_array_equal(whole[key], sum(p[key] for p in parts))
    valid = np.ones_like(gt)
    valid[:, :, 32:] = False
    half = edge_counts(prob, gt, valid, thresholds=(0.5,), max_dist=0.0)
    assert int(half["gt"]) == 3 * (32 - 20)
    noisy = prob.copy()
    noisy[:, :, 32:] = 1.0  # outside the mask: no effect
    np.testing.assert_array_equal(edge_counts(noisy, gt, valid, thresholds=(0.5,), max_dist=0.0)["pred"], half["pred"])
