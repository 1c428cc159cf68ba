"""Boundary detection scored as SEISM scores it (the odsF that PASCAL-Context and NYUD-v2 papers report), in Python.

The benchmarks' numbers come from MATLAB: SEISM (jponttuset/seism) reads each prediction PNG, keeps the pixels above
a threshold (``read_one_cont_png``: ``im2double(png) > t``), thins them (``bwmorph(E, 'thin', Inf)``) and matches them
to the ground-truth boundary pixels with BSDS's ``correspondPixels`` (``edgesEvalImg(..., 'thin', 0)``: the
prediction was thinned already, the truth is not thinned). Per threshold the counts are summed over the whole dataset
(``gather_measure``: ``cntR, sumR, cntP, sumP``), precision ``cntP / sumP`` and recall ``cntR / sumR`` are computed
from the pooled counts, F = 2PR / (P + R), and odsF is the largest F over the thresholds (``general_ods``).
Vandenhende's Multi-Task-Learning-PyTorch (and so M3ViT / Mod-Squad) runs it with the 99 thresholds 0.01 … 0.99.

Here:

* `thin` is the thinning of MATLAB's ``bwmorph(…, 'thin', Inf)``: the two-subiteration parallel algorithm that
  MATLAB documents (Lam, Lee & Suen 1992, p. 879), pixels outside the image counting as background, repeated until
  nothing changes. Each subiteration deletes, all at once, the foreground pixels whose 8-neighbourhood satisfies G1
  (Hilditch crossing number 1), G2 (2 ≤ min(n1, n2) ≤ 3) and G3 (first) or G3' (second); the three conditions are
  tabulated for the 256 neighbourhoods once (`_thin_tables`). Vectorised over a stack of maps.
* `match_counts` replaces ``correspondPixels``: a predicted and a true pixel may correspond when their Euclidean
  distance is ≤ ``max_dist · diagonal`` (``d² > maxDist²`` is the BSDS rejection test; the diagonal is that of the
  image, ``sqrt(h² + w²)``, or of the scored region when a mask is given), and every pixel corresponds to at most one
  other. ``correspondPixels`` finds a minimum-cost assignment in which leaving a pixel unmatched costs
  100 · maxDist · diagonal, far more than any distance, so it matches as many pixels as possible; only the counts
  enter the scores, and a maximum-cardinality bipartite matching (Hopcroft–Karp,
  ``scipy.sparse.csgraph.maximum_bipartite_matching``, on the pairs within the distance) gives the same counts.
  With one ground truth per image the matched predicted and matched true pixels are equally many (``cntP = cntR``).
* `edge_counts` does both for a batch of probability maps at every threshold; `ods_f` turns pooled counts into odsF
  with SEISM's conventions for empty sets (no true boundary anywhere: recall 1, precision 0; no predicted boundary:
  recall 0, precision 1; F = 0 when P + R = 0).

The tolerance is relative to the diagonal, so it depends on the resolution the maps are scored at: at 64 × 64 the
PASCAL tolerance (0.0075 · 90.5 px = 0.68 px) accepts only exact hits, while at the benchmarks' ~500 × 375 it is
about 4.7 px. Scores at different resolutions are not comparable.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

PASCAL_MAX_DIST = 0.0075  # SEISM / edgesEvalImg default, used for PASCAL-Context
NYUD_MAX_DIST = 0.011  # the NYUD-v2 boundary benchmark's tolerance
SEISM_THRESHOLDS: tuple[float, ...] = tuple(round(0.01 * k, 2) for k in range(1, 100))  # 0.01 … 0.99

# neighbour k of a pixel (bit k of its code): E, NE, N, NW, W, SW, S, SE — x1 … x8 of Lam, Lee & Suen
_NEIGHBOURS = ((0, 1), (-1, 1), (-1, 0), (-1, -1), (0, -1), (1, -1), (1, 0), (1, 1))
_CHUNK_PIXELS = 1 << 23  # maps thinned and matched at once (bounds the memory of a batch at large sizes)


@functools.cache
def _thin_tables() -> tuple[np.ndarray, np.ndarray]:
    """Which 8-neighbourhood codes let a foreground pixel be deleted in subiteration 1 and in subiteration 2."""
    first = np.zeros(256, dtype=bool)
    second = np.zeros(256, dtype=bool)
    for code in range(256):
        x = [bool(code >> k & 1) for k in range(8)]  # x[0] = x1 (E) … x[7] = x8 (SE)
        crossing = sum(1 for i in (0, 2, 4, 6) if not x[i] and (x[i + 1] or x[(i + 2) % 8]))
        n1 = sum(1 for k in (0, 2, 4, 6) if x[k] or x[k + 1])
        n2 = sum(1 for k in (1, 3, 5, 7) if x[k] or x[(k + 1) % 8])
        g12 = crossing == 1 and 2 <= min(n1, n2) <= 3
        first[code] = g12 and not ((x[1] or x[2] or not x[7]) and x[0])
        second[code] = g12 and not ((x[5] or x[6] or not x[3]) and x[4])
    return first, second


def thin(image: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Morphological thinning to 1-pixel-wide lines: MATLAB's ``bwmorph(image, 'thin', Inf)`` (module docstring).

    Exactly the parallel algorithm, evaluated where it can change something: a pixel is looked at in a subiteration
    only if it is on the boundary (G1 needs a background 4-neighbour) and its 8-neighbourhood changed since that
    subiteration last looked at it (its verdict would otherwise be the same), so the cost follows the pixels that
    change rather than the area. Pixels are flat indices into a zero-padded copy of the stack.

    Args:
        image: ``[H, W]`` or a stack ``[N, H, W]``; non-zero pixels are foreground.
        max_iter: at most this many iterations (each = both subiterations); None: until nothing changes.

    Returns:
        ``bool`` of the same shape.

    Raises:
        ValueError: an array that is not 2-D or 3-D.
    """
    arr = np.asarray(image)
    if arr.ndim not in (2, 3):
        raise ValueError(f"thin: expected an image [H, W] or a stack [N, H, W], got shape {arr.shape}")
    stack = arr[None] if arr.ndim == 2 else arr
    n, h, w = stack.shape
    padded = np.zeros((n, h + 2, w + 2), dtype=np.uint8)
    padded[:, 1:-1, 1:-1] = stack != 0
    flat = padded.reshape(-1)  # a view; every map keeps its own zero border, so neighbours never cross maps
    offsets = np.array([dy * (w + 2) + dx for dy, dx in _NEIGHBOURS], dtype=np.int64)
    fg = np.flatnonzero(flat)
    start = fg[(flat[fg[:, None] + offsets[None, [0, 2, 4, 6]]] == 0).any(axis=1)]  # the boundary
    pending = [start, start.copy()]  # pixels each subiteration must (re)examine
    queued = [np.zeros(flat.size, dtype=bool), np.zeros(flat.size, dtype=bool)]
    for q, todo in zip(queued, pending, strict=True):
        q[todo] = True
    slot = np.empty(flat.size, dtype=np.int64)  # scratch for removing duplicate indices
    tables = _thin_tables()
    done = 0
    while (pending[0].size or pending[1].size) and (max_iter is None or done < max_iter):
        for sub, table in enumerate(tables):
            todo = pending[sub]
            queued[sub][todo] = False
            pending[sub] = todo[:0]
            todo = todo[flat[todo] != 0]
            if not todo.size:
                continue
            code = np.zeros(todo.size, dtype=np.uint8)
            for bit, off in enumerate(offsets):
                code |= flat[todo + off] << np.uint8(bit)
            gone = todo[table[code]]
            if not gone.size:
                continue
            flat[gone] = 0  # parallel within the subiteration: every code was read before this write
            near = (gone[:, None] + offsets[None, :]).reshape(-1)
            near = near[flat[near] != 0]
            order = np.arange(near.size)
            slot[near] = order
            near = near[slot[near] == order]  # one of each (no sort: the last write of an index wins)
            for other in (0, 1):
                add = near[~queued[other][near]]
                queued[other][add] = True
                pending[other] = np.concatenate([pending[other], add])
        done += 1
    out = padded[:, 1:-1, 1:-1].astype(bool)
    return out[0] if arr.ndim == 2 else out


def diagonal(valid: np.ndarray | None, shape: tuple[int, int]) -> float:
    """The diagonal in pixels that the tolerance is relative to: of the bounding box of `valid` (the scored region,
    e.g. an image letterboxed into a square), or of the whole ``shape`` without a mask (or with an empty one)."""
    if valid is not None and valid.any():
        rows = np.flatnonzero(valid.any(axis=1))
        cols = np.flatnonzero(valid.any(axis=0))
        return math.hypot(rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1)
    return math.hypot(*shape)


def match_counts(pred: np.ndarray, gt: np.ndarray, radius: float | Sequence[float] | np.ndarray) -> np.ndarray:
    """Matched pixels of each pair of boundary maps under a one-to-one correspondence within `radius` pixels.

    Args:
        pred: ``bool [N, H, W]`` (or ``[H, W]``) predicted boundary pixels.
        gt: the true boundary pixels, the same shape.
        radius: the largest distance (pixels) of a correspondence, one for all maps or one per map.

    Returns:
        ``int64 [N]`` (a scalar array for one map): the size of a maximum one-to-one matching between the two pixel
        sets, pairs at Euclidean distance ≤ radius only — as many predicted as true pixels are matched.

    Raises:
        ValueError: shapes differ or a radius is negative.
    """
    p, g = np.asarray(pred, dtype=bool), np.asarray(gt, dtype=bool)
    if p.shape != g.shape or p.ndim not in (2, 3):
        raise ValueError(f"match_counts: expected two maps [N, H, W] of one shape, got {p.shape} and {g.shape}")
    single = p.ndim == 2
    if single:
        p, g = p[None], g[None]
    n = p.shape[0]
    r = np.broadcast_to(np.asarray(radius, dtype=np.float64), (n,))
    if (r < 0).any():
        raise ValueError(f"match_counts: radius must be >= 0, got {r.min()}")
    reach = int(math.floor(float(r.max()))) if n else 0
    if reach == 0:  # only exact hits are within reach
        out = (p & g).reshape(n, -1).sum(axis=1)
        return out[0] if single else out
    pn, py, px = np.nonzero(p)
    gn, gy, gx = np.nonzero(g)
    if not len(pn) or not len(gn):
        out = np.zeros(n, dtype=np.int64)
        return out[0] if single else out
    gid = np.full(g.shape, -1, dtype=np.int64)
    gid[gn, gy, gx] = np.arange(len(gn))
    r2 = r[pn] ** 2
    h, w = g.shape[1:]
    rows, cols = [], []
    for dy in range(-reach, reach + 1):
        for dx in range(-reach, reach + 1):
            d2 = dy * dy + dx * dx
            ok = np.flatnonzero((d2 <= r2) & (py + dy >= 0) & (py + dy < h) & (px + dx >= 0) & (px + dx < w))
            if not ok.size:
                continue
            j = gid[pn[ok], py[ok] + dy, px[ok] + dx]
            hit = j >= 0
            rows.append(ok[hit])
            cols.append(j[hit])
    rows_a, cols_a = np.concatenate(rows), np.concatenate(cols)
    from scipy.sparse import csr_matrix  # here: importing the tasks needs no scipy
    from scipy.sparse.csgraph import maximum_bipartite_matching

    graph = csr_matrix((np.ones(len(rows_a), dtype=np.int8), (rows_a, cols_a)), shape=(len(pn), len(gn)))
    matched = maximum_bipartite_matching(graph, perm_type="column") >= 0  # per predicted pixel
    out = np.bincount(pn[matched], minlength=n).astype(np.int64)
    return out[0] if single else out


def edge_counts(prob: np.ndarray, gt: np.ndarray, valid: np.ndarray | None = None,
                thresholds: Sequence[float] = SEISM_THRESHOLDS, max_dist: float = PASCAL_MAX_DIST,
                thin_pred: bool = True) -> dict[str, np.ndarray]:
    """SEISM's per-threshold counts of a batch, to be summed over a dataset and turned into odsF by `ods_f`.

    At each threshold t the prediction ``prob > t`` (inside `valid`) is thinned and matched to the true boundary
    pixels (inside `valid`) within ``max_dist`` times the image diagonal (`diagonal`).

    Args:
        prob: ``[B, H, W]`` boundary probabilities in [0, 1].
        gt: ``[B, H, W]`` true boundary pixels (non-zero).
        valid: ``bool [B, H, W]`` pixels scored (None: all); outside it neither map has boundary pixels.
        thresholds: the K thresholds (SEISM: 0.01 … 0.99).
        max_dist: tolerance as a fraction of the image diagonal (0.0075 PASCAL-Context, 0.011 NYUD-v2).
        thin_pred: thin the thresholded predictions (SEISM does).

    Returns:
        ``{"matched": int64 [K], "pred": int64 [K], "gt": int64 scalar}``: matched pixels (= cntP = cntR), predicted
        boundary pixels (sumP) per threshold, and true boundary pixels (sumR).

    Raises:
        ValueError: shapes that differ, or a negative `max_dist`.
    """
    p = np.asarray(prob, dtype=np.float32)
    g = np.asarray(gt) != 0
    if p.ndim != 3 or g.shape != p.shape or (valid is not None and np.shape(valid) != p.shape):
        raise ValueError(f"edge_counts: expected prob, gt (and valid) [B, H, W] of one shape, got {p.shape}, "
                         f"{g.shape}" + ("" if valid is None else f", {np.shape(valid)}"))
    if max_dist < 0:
        raise ValueError(f"edge_counts: max_dist must be >= 0, got {max_dist}")
    v = None if valid is None else np.asarray(valid, dtype=bool)
    if v is not None:
        g = g & v
    t = np.asarray(list(thresholds), dtype=np.float32)
    b, h, w = p.shape
    matched = np.zeros(len(t), dtype=np.int64)
    pred_total = np.zeros(len(t), dtype=np.int64)
    per_chunk = max(1, _CHUNK_PIXELS // max(1, len(t) * h * w))
    for start in range(0, b, per_chunk):
        sl = slice(start, min(b, start + per_chunk))
        n = sl.stop - sl.start
        binary = p[None, sl] > t[:, None, None, None]  # [K, n, H, W]
        if v is not None:
            binary &= v[None, sl]
        maps = binary.reshape(len(t) * n, h, w)
        if thin_pred:
            maps = thin(maps)
        radius = np.array([max_dist * diagonal(None if v is None else v[i], (h, w)) for i in range(sl.start, sl.stop)])
        truth = np.broadcast_to(g[None, sl], (len(t), n, h, w)).reshape(len(t) * n, h, w)
        hits = match_counts(maps, truth, np.tile(radius, len(t)))
        matched += hits.reshape(len(t), n).sum(axis=1)
        pred_total += maps.reshape(len(t), n, -1).sum(axis=2).sum(axis=1)
    return {"matched": matched, "pred": pred_total, "gt": np.int64(g.sum())}


def precision_recall(matched: np.ndarray, pred: np.ndarray, gt: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SEISM's pooled precision and recall per threshold (``gather_measure``), with its rules for empty sets."""
    m = np.asarray(matched, dtype=np.float64)
    sp = np.asarray(pred, dtype=np.float64)
    sr = np.broadcast_to(np.asarray(gt, dtype=np.float64), m.shape)
    prec = np.zeros_like(m)
    rec = np.zeros_like(m)
    no_truth = (sr == 0) & (m == 0)
    rec[no_truth], prec[no_truth] = 1.0, 0.0
    no_pred = (sp == 0) & (m == 0)
    rec[no_pred], prec[no_pred] = 0.0, 1.0
    some = (sp != 0) & (m != 0)
    rec[some] = m[some] / sr[some]
    prec[some] = m[some] / sp[some]
    return prec, rec


def ods_f(matched: np.ndarray, pred: np.ndarray, gt: float | np.ndarray,
          thresholds: Sequence[float] | None = None) -> dict[str, float]:
    """odsF (the optimal dataset scale F-measure) from counts summed over a dataset (`edge_counts`).

    Returns:
        ``{"odsf", "precision", "recall"}`` in [0, 1] at the best threshold, and ``"threshold"`` (its value when
        `thresholds` is given, else its index). F = 2PR / (P + R), 0 where P + R = 0.
    """
    prec, rec = precision_recall(matched, pred, gt)
    denom = prec + rec
    f = np.where(denom > 0, 2 * prec * rec / np.where(denom > 0, denom, 1.0), 0.0)
    best = int(np.argmax(f))
    at = float(thresholds[best]) if thresholds is not None else float(best)
    return {"odsf": float(f[best]), "precision": float(prec[best]), "recall": float(rec[best]), "threshold": at}
