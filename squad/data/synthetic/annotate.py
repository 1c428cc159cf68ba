"""Taskonomy's 2-D annotators, re-implemented for the synthetic Taskonomy (``squad.data.synthetic``).

Each domain is computed the way Taskonomy's generator computes it (its public successor, EPFL-VILAB/omnidata's
``omnidata_annotator/scripts``, keeps the same scripts), from the rendered RGB, depth and normals:

* edge_texture — Taskonomy: Gaussian blur (sigma 3 px at 512 px) of the grey image, then the Sobel magnitude
  (Canny without non-maximum suppression). Here the same.
* edge_occlusion — Taskonomy: Sobel magnitude of sqrt(z-buffer code / 2^16), masked where the code is at least
  2^16 - 500. Here the same.
* keypoints2d — Taskonomy: SURF's determinant of Hessian (box filters), the maximum over 10 scales sigma = 1..30 px
  at 512 px, before non-maximum suppression; negative values clip to 0. Here the same box filters, over the scales
  an image this size resolves.
* keypoints3d — Taskonomy: PCL's NARF interest image of the z-buffer, support 0.3 m. Here a NARF-like interest:
  surface change (normal turn, occlusion border) within the support radius, falling off with metric distance.
* segment_unsup2d — Taskonomy: Felzenszwalb over-segmentation of the RGB merged by normalised cuts, written with
  the ids rescaled over 0..255. Here colour + position k-means split into connected regions, small regions merged,
  ids in raster order, rescaled the same way.
* segment_unsup25d — Taskonomy: the same on (2 x log depth / 16, normals, 10 x occlusion edges). Here the same
  features, clustered as above.

Gradients are per pixel of the image they are computed on. Taskonomy's images are 512 px; a derivative at ``S`` px
is ``512 / S`` times that at 512 px for smooth content, so first-derivative domains are multiplied by ``S / 512``
(then an S-pixel map equals the 512-pixel map averaged over S-pixel blocks) and blur or filter widths given in
512-pixel units are scaled by ``S / 512``; depth discontinuities are treated apart (`edge_occlusion`).

Checked on a real Taskonomy view (omnidata's example ``point_202_view_5``, 512 px, its RGB and z-buffer in, its
files out): edge_texture, edge_occlusion and keypoints2d computed here at 512 px match the view's files (means 1106
vs 1099, 73 vs 73 and 73 vs 71 codes; 99th percentiles within 6 %). Emulated at 64 px from the same view, the means
are 730, 64-82 and 157 codes: what a 64-px image cannot hold is why ``squad.data.synthetic`` scales some domains.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

NATIVE_SIZE = 512  # Taskonomy's image side; filter widths and gradients below are given at this size
EDGE_TEXTURE_SIGMA = 3.0  # native px
DOH_SIGMAS = np.linspace(1.0, 30.0, 10)  # native px, skimage blob_doh's defaults as Taskonomy calls them
NARF_SUPPORT = 0.3  # metres, support diameter (Taskonomy's setting)
NARF_RADIUS = NARF_SUPPORT / 2  # metres: where the interest of a surface change has fallen to 0
NARF_BORDER = 0.25  # change score of an occlusion border
Z_INVALID = 65536 - 500  # edge_occlusion's mask: z-buffer codes at or above this have no geometry


def luminance(rgb8: np.ndarray) -> np.ndarray:
    """Grey level in [0, 1] of a uint8 RGB image (PIL's "L" weights), (S, S, 3) -> (S, S)."""
    return (rgb8.astype(np.float64) @ np.array([0.299, 0.587, 0.114])) / 255.0


def sobel_magnitude(img: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """skimage's ``filters.sobel``: sqrt((h^2 + v^2) / 2) with the [1, 2, 1] / 4 smoothing kernels; with a mask,
    0 wherever the 3 x 3 neighbourhood leaves it (the image border counts as inside)."""
    h = ndimage.correlate1d(ndimage.correlate1d(img, [1, 0, -1], 0, mode="nearest"), [0.25, 0.5, 0.25], 1,
                            mode="nearest")  # fmt: skip
    v = ndimage.correlate1d(ndimage.correlate1d(img, [1, 0, -1], 1, mode="nearest"), [0.25, 0.5, 0.25], 0,
                            mode="nearest")  # fmt: skip
    mag = np.sqrt((h * h + v * v) / 2.0)
    if mask is not None:
        mag = np.where(ndimage.binary_erosion(mask, np.ones((3, 3), bool), border_value=1), mag, 0.0)
    return mag


def smooth_masked(img: np.ndarray, sigma: float, mask: np.ndarray) -> np.ndarray:
    """Gaussian blur that ignores masked-out pixels (normalised convolution), (S, S[, C])."""
    if sigma < 0.3:
        return img
    sig = (sigma, sigma, 0) if img.ndim == 3 else sigma
    w = ndimage.gaussian_filter(mask.astype(np.float64), sigma, mode="constant")
    m = mask[..., None] if img.ndim == 3 else mask
    blurred = ndimage.gaussian_filter(np.where(m, img, 0.0), sig, mode="constant")
    return np.where(m, blurred / np.maximum(w if img.ndim == 2 else w[..., None], 1e-9), img)


def edge_texture(lum: np.ndarray) -> np.ndarray:
    """Taskonomy's edge_texture in units (the file holds 65535 x this): Sobel magnitude of the blurred grey image,
    per 512-px pixel."""
    s = lum.shape[0]
    sigma = EDGE_TEXTURE_SIGMA * s / NATIVE_SIZE
    blurred = ndimage.gaussian_filter(lum, sigma, mode="nearest") if sigma >= 0.3 else lum
    return sobel_magnitude(blurred) * s / NATIVE_SIZE


def edge_occlusion(zcode: np.ndarray, smooth_gain: float = 1.0, ridge_gain: float = 1.0) -> np.ndarray:
    """Taskonomy's edge_occlusion in units: Sobel magnitude of sqrt(z-buffer code / 2^16) per 512-px pixel, 0 where
    the 3 x 3 neighbourhood touches a pixel without geometry.

    At 512 px a depth discontinuity is a ridge two pixels wide whose height, 0.71 x the jump in sqrt(code / 2^16),
    does not depend on the resolution. Averaged into S-px pixels it would shrink by S / 512 (the 512-px file's
    tail is lost); kept at full height on one S-px pixel it would cover 4 x its share of the image. The pixel on the
    near side of each discontinuity gets the height x sqrt(S / 512), between the two: calibrated on a real
    Taskonomy view (omnidata's example point 202 view 5), whose 64-px emulation then matches its 512-px file's
    mean, median and 99th percentile within about 20 %. ``smooth_gain`` and ``ridge_gain`` scale the two parts
    (1 reproduces Taskonomy's algorithm).
    """
    s = zcode.shape[0]
    valid = zcode < Z_INVALID
    root = np.sqrt(zcode / 65536.0)
    out = sobel_magnitude(root, valid) * (smooth_gain * s / NATIVE_SIZE)
    z = zcode / 512.0
    for axis in (0, 1):
        for step in (1, -1):
            q = np.roll(z, -step, axis)  # the neighbour
            jump = (q - z > 0.12 * z + 0.05) & valid & np.roll(valid, -step, axis)
            edge = [slice(None)] * 2
            edge[axis] = slice(-1, None) if step == 1 else slice(0, 1)
            jump[tuple(edge)] = False  # np.roll wraps around the border
            ridge = np.sqrt(2.0) / 2 * (np.roll(root, -step, axis) - root) * (ridge_gain * np.sqrt(s / NATIVE_SIZE))
            out = np.where(jump, np.maximum(out, ridge), out)
    return np.where(ndimage.binary_erosion(valid, np.ones((3, 3), bool), border_value=1), out, 0.0)


def _box_doh(img: np.ndarray, size: int) -> np.ndarray:
    """SURF's box-filter determinant of Hessian at filter size ``size`` px (skimage's ``_hessian_matrix_det``, the
    box layout included), from an integral image; boxes are cut at the image border. (S, S) -> (S, S)."""
    h, w = img.shape
    pad = size + 1
    ii = np.zeros((h + 2 * pad + 1, w + 2 * pad + 1))
    ii[pad + 1 : pad + 1 + h, pad + 1 : pad + 1 + w] = img
    ii = ii.cumsum(0).cumsum(1)  # ii[y, x] = sum of the zero-padded image above and left of (y, x)

    def box(r: int, c: int, rl: int, cl: int) -> np.ndarray:  # sum of img[y + r : y + r + rl, x + c : x + c + cl]
        y0, x0 = pad + r, pad + c
        y1, x1 = y0 + rl, x0 + cl
        return (
            ii[y1 : y1 + h, x1 : x1 + w]
            - ii[y0 : y0 + h, x1 : x1 + w]
            - ii[y1 : y1 + h, x0 : x0 + w]
            + ii[y0 : y0 + h, x0 : x0 + w]
        )

    s2, s3, w_i = (size - 1) // 2, size // 3, 1.0 / size / size
    dxy = -(box(-s3, 1, s3, s3) + box(1, -s3, s3, s3) - box(-s3, -s3, s3, s3) - box(1, 1, s3, s3)) * w_i
    dxx = -(box(-s3 + 1, -s2, 2 * s3 - 1, size) - 3 * box(-s3 + 1, -(s3 // 2), 2 * s3 - 1, s3)) * w_i
    dyy = -(box(-s2, -s3 + 1, size, 2 * s3 - 1) - 3 * box(-(s3 // 2), -s3 + 1, s3, 2 * s3 - 1)) * w_i
    return dxx * dyy - 0.81 * dxy * dxy


def keypoints2d(lum: np.ndarray) -> np.ndarray:
    """Taskonomy's keypoints2d in units: the largest box determinant-of-Hessian response over its 10 scales, clipped
    at 0. A scale of sigma px at 512 px is a filter of int(3 * sigma * S / 512) px here (the box responses are
    resolution-independent); scales whose filter would be under 3 px are skipped."""
    s = lum.shape[0]
    sizes = sorted({int(3 * sg * s / NATIVE_SIZE) for sg in DOH_SIGMAS} - {0, 1, 2})
    if not sizes:
        sizes = [3]
    return np.maximum(np.max([_box_doh(lum, size) for size in sizes], axis=0), 0.0)


def keypoints3d(normal: np.ndarray, zdepth: np.ndarray, valid: np.ndarray, focal_px: float) -> np.ndarray:
    """A NARF-like 3-D interest image in [0, 1] from camera-frame normals (S, S, 3) and z-depth (S, S) in metres.

    NARF scores how strongly the surface changes within a support sphere (``NARF_SUPPORT`` across) around each
    point, and is 0 where nothing changes within it. Here the change at a pixel is the turn of the normal to its
    neighbours (1 - cos) or 1 on the near side of an occlusion border; the interest of a pixel is the change of the
    nearest changing pixel, falling to 0 at the support radius (in metres at the pixel's depth).
    """
    z = np.where(valid, zdepth, 0.0)
    change = np.zeros(z.shape)
    for axis in (0, 1):
        a = [slice(None)] * 2
        b = [slice(None)] * 2
        a[axis], b[axis] = slice(0, -1), slice(1, None)
        a, b = tuple(a), tuple(b)
        turn = 1.0 - (normal[a] * normal[b]).sum(-1)
        both = valid[a] & valid[b]
        za, zb = z[a], z[b]
        gap = np.abs(za - zb) > 0.1 * np.minimum(za, zb) + 0.05
        near_a = (both & gap & (za < zb)) | (valid[a] & ~valid[b])
        near_b = (both & gap & (zb < za)) | (valid[b] & ~valid[a])
        smooth = both & ~gap
        change[a] = np.maximum(change[a], np.where(near_a, NARF_BORDER, np.where(smooth, 0.8 * turn, 0.0)))
        change[b] = np.maximum(change[b], np.where(near_b, NARF_BORDER, np.where(smooth, 0.8 * turn, 0.0)))
    changing = valid & (change > 0.02)
    if not changing.any():
        return np.zeros(z.shape)
    dist, (iy, ix) = ndimage.distance_transform_edt(~changing, return_indices=True)
    metres = dist * z / focal_px
    fall = np.clip(1.0 - metres / NARF_RADIUS, 0.0, 1.0) ** 2
    return np.where(valid, np.minimum(change[iy, ix], 1.0) * fall, 0.0)


def _nearest(features: np.ndarray, centers: np.ndarray) -> np.ndarray:
    """Index of the nearest centre per row: (N, F), (K, F) -> (N,)."""
    return np.argmin((centers * centers).sum(1)[:, None] - 2.0 * (centers @ features.T), axis=0)  # (K, N)


def kmeans(features: np.ndarray, k: int, iters: int = 6, stride: int = 3) -> np.ndarray:
    """Deterministic k-means: farthest-point start at row 0, fitted on every ``stride``-th row, then every row
    labelled with its nearest centre. (N, F) -> (N,) labels < k."""
    fit = features[::stride]
    n, f = fit.shape
    centers = [fit[0]]
    d2 = ((fit - fit[0]) ** 2).sum(1)
    for _ in range(1, k):
        centers.append(fit[int(np.argmax(d2))])
        d2 = np.minimum(d2, ((fit - centers[-1]) ** 2).sum(1))
    c = np.stack(centers)  # (K, F)
    labels = _nearest(fit, c)
    cols = np.arange(f)
    for _ in range(iters):
        counts = np.bincount(labels, minlength=k)
        sums = np.bincount((labels[:, None] * f + cols).ravel(), fit.ravel(), minlength=k * f).reshape(k, f)
        c = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], c)
        new = _nearest(fit, c)
        if np.array_equal(new, labels):
            break
        labels = new
    return _nearest(features, c)


def regions(labels: np.ndarray, min_size: int) -> np.ndarray:
    """Split a label image (S, S) into 4-connected regions, merge regions under ``min_size`` pixels into the nearest
    large one, and number the regions 0.. in raster order of their first pixel."""
    h, w = labels.shape
    idx = np.arange(h * w).reshape(h, w)
    right, down = labels[:, :-1] == labels[:, 1:], labels[:-1] == labels[1:]
    a = np.concatenate([idx[:, :-1][right], idx[:-1][down]])
    b = np.concatenate([idx[:, 1:][right], idx[1:][down]])
    graph = coo_matrix((np.ones(len(a), np.int8), (a, b)), shape=(h * w, h * w))
    comp = connected_components(graph, directed=False)[1].reshape(h, w)
    sizes = np.bincount(comp.ravel())
    small = sizes[comp] < min_size
    if small.any() and not small.all():
        _, (iy, ix) = ndimage.distance_transform_edt(small, return_indices=True)
        comp = comp[iy, ix]
    ids, first = np.unique(comp.ravel(), return_index=True)
    remap = np.zeros(comp.max() + 1, np.int64)
    remap[ids[np.argsort(first)]] = np.arange(len(ids))
    return remap[comp]


def to_byte_range(ids: np.ndarray) -> np.ndarray:
    """Segment ids 0..n-1 rescaled over 0..255 as Taskonomy's writer does (scipy's bytescale): uint8."""
    top = ids.max()
    if top == 0:
        return np.zeros(ids.shape, np.uint8)
    return np.round(ids * (255.0 / top)).astype(np.uint8)


def _pixel_coords(s: int) -> np.ndarray:
    yy, xx = np.meshgrid(np.arange(s) / s, np.arange(s) / s, indexing="ij")
    return np.stack([yy.ravel(), xx.ravel()], 1)  # (S*S, 2)


SEGMENT_CLUSTERS = {"2d": 20, "25d": 40}  # k-means clusters before the split into regions
SEGMENT_POSITION = {"2d": 0.35, "25d": 1.0}  # weight of the pixel position beside the features (keeps regions compact)
SEGMENT_MIN_SHARE = 1 / 400  # smallest region, as a share of the image (real files: 25-65 regions per image)


def _segment(features: np.ndarray, s: int, clusters: int) -> np.ndarray:
    labels = kmeans(features, clusters).reshape(s, s)
    return to_byte_range(regions(labels, max(2, round(SEGMENT_MIN_SHARE * s * s))))


def segment_unsup2d(rgb8: np.ndarray) -> np.ndarray:
    """Unsupervised 2-D segments of an RGB image (S, S, 3): uint8 ids spread over 0..255."""
    s = rgb8.shape[0]
    colour = rgb8.reshape(-1, 3) / 255.0
    feats = np.concatenate([colour, SEGMENT_POSITION["2d"] * _pixel_coords(s)], 1)
    return _segment(feats, s, SEGMENT_CLUSTERS["2d"])


def segment_unsup25d(zcode: np.ndarray, normal8: np.ndarray, edge_occlusion_code: np.ndarray) -> np.ndarray:
    """Unsupervised 2.5-D segments from the z-buffer code, the normal file and the occlusion-edge file (Taskonomy's
    features: 2 x log(z code) / 16, normals / 255 smoothed over valid pixels, 10 x edge code / 255^2)."""
    s = zcode.shape[0]
    valid = zcode < 65534
    depth = smooth_masked(np.log(np.maximum(zcode, 1.0)) / 16.0, 1.0 * s / NATIVE_SIZE, valid)
    normal = smooth_masked(normal8 / 255.0, 2.0 * s / NATIVE_SIZE, valid)
    feats = [2.0 * depth.reshape(-1, 1), normal.reshape(-1, 3), 10.0 * edge_occlusion_code.reshape(-1, 1) / 65025.0,
             SEGMENT_POSITION["25d"] * _pixel_coords(s)]  # fmt: skip
    return _segment(np.concatenate(feats, 1), s, SEGMENT_CLUSTERS["25d"])
