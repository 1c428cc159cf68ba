"""Mask-aware resizing of the geometric domains, and edge_occlusion's blur/clip decoding (issue 11).

A real-like view (`real_like_view`): a window and a round hole without geometry, holding the real files' fills —
depth 65535, normal (128,128,128), curvature (0,0,0), reshading 8–13 varying, occlusion edges / keypoints3d /
segments 0 — around smooth valid content that never takes those values. After the reader's 128 → 64 resize (and
after ``make_data.py pack`` at 64), every valid pixel must lie within the range of the valid input pixels of its
footprint: no fill blends in.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from squad.config.base import ConfigError
from squad.config.loading import load_config
from squad.data import ShardDataset, TaskonomyDataset
from squad.data.offline.pack import pack_shards
from squad.data.transforms import SamplePipeline
from squad.tasks import get_task
from squad.tasks.scalar import gaussian_blur

SRC, OUT = 128, 64
MASKED = ["depth_zbuffer", "normal", "principal_curvature", "reshading", "edge_occlusion", "keypoints3d",
          "segment_unsup25d"]


def real_like_view(n: int = SRC, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Raw arrays of one view with holes (real fills) and the bool [n, n] geometry mask."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:n, 0:n] / n
    hole = ((y > 0.105) & (y < 0.37) & (x > 0.53) & (x < 0.87)) | ((y - 0.7) ** 2 + (x - 0.3) ** 2 < 0.09 ** 2)
    noise = rng.normal(0, 1.5, (n, n))
    raws: dict[str, np.ndarray] = {"rgb": rng.integers(0, 256, (n, n, 3), dtype=np.uint8)}
    depth = np.round(512 * (1.5 + 2 * x + 0.5 * np.sin(5 * y))).astype(np.uint16)
    depth[hole] = 65535
    raws["depth_zbuffer"] = depth
    v = np.stack([np.sin(3 * x), np.cos(2 * y) - 0.5, -np.ones_like(x)], -1)
    v /= np.linalg.norm(v, axis=-1, keepdims=True)
    normal = np.round((v + 1) * 127.5).astype(np.uint8)
    normal[hole] = 128
    raws["normal"] = normal
    curv = np.zeros((n, n, 3), np.uint8)  # blue always 0
    curv[..., 0] = np.clip(np.round(127 + 40 * np.sin(6 * np.pi * x) + noise), 60, 200)
    curv[..., 1] = np.clip(np.round(127 + 12 * np.cos(5 * np.pi * y) + noise), 100, 160)
    curv[hole] = 0
    raws["principal_curvature"] = curv
    shade = np.clip(np.round(60 + 140 * (0.5 + 0.5 * np.sin(4 * x + 3 * y)) + noise), 40, 230).astype(np.uint8)
    shade[hole] = rng.integers(8, 14, int(hole.sum()))
    raws["reshading"] = np.repeat(shade[..., None], 3, axis=2)
    edges = np.round(20 + 1000 * (0.5 + 0.5 * np.sin(9 * x) * np.cos(7 * y)) ** 4).astype(np.uint16)
    edges[hole] = 0
    raws["edge_occlusion"] = edges
    kp = np.round(500 + 8000 * (0.5 + 0.5 * np.cos(6 * x + 2 * y)) ** 2).astype(np.uint16)
    kp[hole] = 0
    raws["keypoints3d"] = kp
    seg = (40 + 20 * (((8 * x).astype(int) + 3 * (8 * y).astype(int)) % 11)).astype(np.uint8)
    seg[hole] = 0
    raws["segment_unsup25d"] = seg
    return raws, ~hole


def to_codes(task_name: str, value: torch.Tensor) -> np.ndarray:
    """Decoded dense value [C, h, w] → codes [h, w, C] of the task's file (the inverse of its decode)."""
    v = value.double().numpy()
    if task_name.startswith("depth"):
        v = v * 512.0
    elif task_name == "normal":
        pass  # unit vectors: compared in decoded space
    else:
        spec = get_task(task_name).spec
        v = (v - spec.code_offset) / spec.code_scale
    return v.transpose(1, 2, 0)


def footprint_range(src: np.ndarray, valid: np.ndarray, i: int, j: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-channel (min, max) of the valid input pixels of output pixel (i, j)'s antialiasing footprint."""
    s = SRC // OUT
    r0, r1, c0, c1 = max(0, s * i - s // 2), s * i + s + s // 2, max(0, s * j - s // 2), s * j + s + s // 2
    block, ok = src[r0:r1, c0:c1].reshape(-1, src.shape[-1]), valid[r0:r1, c0:c1].reshape(-1)
    if not ok.any():
        return None
    return block[ok].min(0), block[ok].max(0)


def assert_no_fill(name: str, src: np.ndarray, valid: np.ndarray, out: np.ndarray, mask: np.ndarray,
                   tol: float) -> int:
    """Every valid output pixel within its footprint's valid range (± tol); returns how many border pixels
    (footprint partly invalid) were checked, so the test cannot pass vacuously."""
    src = src[..., None] if src.ndim == 2 else src
    out = out[..., None] if out.ndim == 2 else out
    border, worst = 0, 0.0
    for i, j in zip(*np.nonzero(mask), strict=True):
        rng = footprint_range(src.astype(np.float64), valid, i, j)
        assert rng is not None, f"{name}: output ({i}, {j}) is valid but its footprint has no geometry"
        lo, hi = rng
        err = float(np.max(np.maximum(lo - out[i, j], out[i, j] - hi)))
        worst = max(worst, err)
        s = SRC // OUT
        border += not valid[max(0, s * i - 1): s * i + s + 1, max(0, s * j - 1): s * j + s + 1].all()
    assert worst <= tol, f"{name}: a valid pixel is {worst:.3f} outside its footprint's valid range (fill blended)"
    return border


def check_sample(targets: dict, masks: dict, raws: dict, valid: np.ndarray) -> None:
    normal_src = raws["normal"].astype(np.float64) / 127.5 - 1
    normal_src /= np.linalg.norm(normal_src, axis=-1, keepdims=True)
    for name in MASKED:
        mask = masks[name][0].numpy()
        if name == "edge_occlusion":  # blurred (default): never below the smallest valid code, the fill is 0
            codes = to_codes(name, targets[name])[..., 0]
            assert codes[mask].min() >= 20 - 0.5, "edge_occlusion: the fill (0) reached a valid pixel"
            continue
        src = normal_src if name == "normal" else get_task(name).compact_raw(raws[name])
        out = targets[name].numpy().transpose(1, 2, 0) if name == "normal" else to_codes(name, targets[name])
        tol = 0.02 if name == "normal" else 0.5  # half a code (rounding); normals: renormalised 8-bit vectors
        assert assert_no_fill(name, src, valid, out, mask, tol) > 20, name
        assert not mask[~_geometry(valid)].any(), f"{name}: a pixel without geometry is valid"


def _geometry(valid: np.ndarray) -> np.ndarray:
    """Output pixels whose footprint is at least half geometry (the reader's rule), from the depth resize."""
    pipe = SamplePipeline(["depth_zbuffer"], image_size=OUT)
    return pipe.prepare_raw("depth_zbuffer", np.where(valid, 1000, 65535).astype(np.uint16)) != 65535


def test_pipeline_resize_keeps_fills_out():
    raws, valid = real_like_view()
    rgb, targets, masks = SamplePipeline(MASKED, image_size=OUT)(raws, None)
    check_sample(targets, masks, raws, valid)
    # one footprint for every masked domain: the same valid pixels (the normal also drops its own fill)
    for name in MASKED:
        assert torch.equal(masks[name], masks["depth_zbuffer"]), name


def test_pipeline_uses_geometry_when_depth_is_not_a_task():
    raws, valid = real_like_view(seed=1)
    tasks = ["principal_curvature", "reshading"]
    _, targets, masks = SamplePipeline(tasks, image_size=OUT)(raws, None)
    t = get_task("principal_curvature").target(targets["principal_curvature"])  # the standardised curvature
    m = masks["principal_curvature"][0]
    assert t[:, m].abs().max() < 4.0  # the fill (0,0,0) is −3.9 / −5.5 std away: it never appears
    assert check_border(raws, valid, targets, masks, tasks) > 20


def check_border(raws, valid, targets, masks, tasks) -> int:
    n = 0
    for name in tasks:
        src = get_task(name).compact_raw(raws[name])
        n += assert_no_fill(name, src, valid, to_codes(name, targets[name]), masks[name][0].numpy(), 0.5)
    return n


def write_tree(root, raws: dict[str, np.ndarray]) -> None:
    for domain, arr in raws.items():
        folder = root / domain / "b0"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(arr).save(folder / f"point_0_view_0_domain_{domain}.png")


def test_pack_stores_mask_aware_resized_arrays(tmp_path):
    raws, valid = real_like_view(seed=2)
    write_tree(tmp_path / "tree", raws)
    pack_shards(tmp_path / "tree", tmp_path / "shards", image_size=OUT, domains=MASKED, workers=0)
    with h5py.File(tmp_path / "shards" / "all_00000.h5", "r") as f:
        stored = {d: f[d][0] for d in MASKED}
    geo = stored["depth_zbuffer"] != 65535
    assert np.array_equal(geo, _geometry(valid))
    border = 0
    for name in ("principal_curvature", "reshading", "keypoints3d", "edge_occlusion", "segment_unsup25d"):
        src = get_task(name).compact_raw(raws[name])
        border += assert_no_fill(name, src, valid, stored[name].astype(np.float64), geo, 0.5)
    assert border > 50
    # read back: the shards give the PNG reader's samples, masked where the geometry is
    shards = ShardDataset(tmp_path / "shards", MASKED, split="all")[0]
    tree = TaskonomyDataset(tmp_path / "tree", MASKED, split="all", image_size=OUT)[0]
    for name in MASKED:
        assert torch.equal(shards["targets"][name], tree["targets"][name]), name
        assert torch.equal(shards["masks"][name], tree["masks"][name]), name
    check_sample(shards["targets"], shards["masks"], raws, valid)


# ------------------------------------------------------------------------------------------ edge_occlusion


def reference_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """scipy.ndimage.gaussian_filter(img, sigma) (mode reflect, truncate 4) written out by hand."""
    r = int(4 * sigma + 0.5)
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    h, w = img.shape
    out = np.zeros_like(img, dtype=np.float64)
    for i in range(h):
        for j in range(w):
            acc = 0.0
            for a in range(-r, r + 1):
                for b in range(-r, r + 1):
                    ii, jj = _reflect(i + a, h), _reflect(j + b, w)
                    acc += k[a + r] * k[b + r] * img[ii, jj]
            out[i, j] = acc
    return out


def _reflect(i: int, n: int) -> int:
    i %= 2 * n
    return 2 * n - 1 - i if i >= n else i


def test_gaussian_blur_matches_hand_reference():
    rng = np.random.default_rng(0)
    img = rng.random((7, 9))
    for sigma in (0.5, 1.0, 4.0):  # 4.0: the radius (16) is wider than the image: reflected again and again
        got = gaussian_blur(torch.from_numpy(img).float()[None], sigma)[0].double().numpy()
        np.testing.assert_allclose(got, reference_blur(img, sigma), atol=1e-6)
    # mask-aware: a normalised convolution over the valid pixels
    valid = rng.random((7, 9)) > 0.3
    got = gaussian_blur(torch.from_numpy(img).float()[None], 1.0, torch.from_numpy(valid)[None])[0].double().numpy()
    ref = reference_blur(img * valid, 1.0) / reference_blur(valid.astype(float), 1.0)
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-5)
    assert (got[~valid] == 0).all()


def edge_frame(n: int = 64) -> np.ndarray:
    code = np.zeros((n, n), np.uint16)
    code[20:44, 31:33] = 3000  # a vertical occlusion edge
    code[10, 10] = 400
    return code


def test_edge_occlusion_blur_is_the_default():
    task = get_task("edge_occlusion")
    assert task.frame_filter and task.spec.clip is None and task.spec.blur_sigma == 4.0
    code = edge_frame()
    _, targets, _ = SamplePipeline(["edge_occlusion"], image_size=64)(
        {"rgb": np.zeros((64, 64, 3), np.uint8), "edge_occlusion": code}, None)
    units = targets["edge_occlusion"][0].double().numpy()
    ref = reference_blur(code / 65535.0, 4.0 * 64 / 256)  # σ = 4 px per 256 px of the frame
    np.testing.assert_allclose(units, ref, atol=1e-7)
    t = task.target(targets["edge_occlusion"][None])
    np.testing.assert_allclose(t[0, 0].double().numpy(), 2 * ref / 0.00625 - 1, atol=1e-4)  # no clip
    assert float(t.max()) > 1.0  # the peak of the blurred edge lies over the old clip
    np.testing.assert_allclose(task.to_units(t)[0, 0].double().numpy(), ref, atol=1e-7)


def test_edge_occlusion_blur_before_the_crop_and_flip():
    code = edge_frame()
    raws = {"rgb": np.zeros((64, 64, 3), np.uint8), "edge_occlusion": code}
    full = SamplePipeline(["edge_occlusion"], image_size=64)(raws, None)[1]["edge_occlusion"]
    pipe = SamplePipeline(["edge_occlusion"], image_size=48, resize=64, augment=True)
    for seed in range(6):
        _, targets, _ = pipe(raws, np.random.default_rng(seed))
        r2 = np.random.default_rng(seed)  # the same draws: crop top, left, then the flip
        top, left = int(r2.integers(0, 17)), int(r2.integers(0, 17))
        crop = full[..., top: top + 48, left: left + 48]
        flipped = r2.random() < 0.5
        assert torch.allclose(targets["edge_occlusion"], torch.flip(crop, (-1,)) if flipped else crop), seed


def test_edge_occlusion_clip_option_is_the_old_decoding():
    clip = get_task("edge_occlusion", decode="clip")
    assert not clip.frame_filter and clip.spec.clip == (0.0, 0.00625)
    code = edge_frame()
    _, targets, _ = SamplePipeline([clip], image_size=64)(
        {"rgb": np.zeros((64, 64, 3), np.uint8), "edge_occlusion": code}, None)
    value = targets["edge_occlusion"]
    assert torch.equal(value[0], torch.from_numpy(code.astype(np.float32)) / 65535)  # unblurred
    t = clip.target(value)
    expected = 2 * np.clip(code / 65535, 0, 0.00625) / 0.00625 - 1
    np.testing.assert_allclose(t[0].numpy(), expected, atol=1e-5)  # today's result: clipped onto [−1, 1]


def test_edge_occlusion_blur_ignores_holes_and_is_masked_there():
    raws, valid = real_like_view(seed=3)
    _, targets, masks = SamplePipeline(["edge_occlusion"], image_size=OUT)(raws, None)
    m = masks["edge_occlusion"][0]
    assert torch.equal(m, torch.from_numpy(_geometry(valid)))
    codes = targets["edge_occlusion"][0] * 65535
    assert float(codes[m].min()) >= 19.5 and float(codes[~m].abs().max()) == 0.0


def test_edge_occlusion_option_from_the_config():
    cfg = load_config("configs/demo.yaml", ["model.task_options={edge_occlusion: {decode: clip}}"])
    task = cfg.model.get_task("edge3d")
    assert task.spec.clip == (0.0, 0.00625) and not task.frame_filter
    assert task is get_task("edge_occlusion", {"edge3d": {"decode": "clip"}})  # one instance per task and options
    assert get_task("edge_occlusion").frame_filter  # loading the config changed nothing process-wide
    with pytest.raises(ConfigError, match=r"model\.task_options\.edge_occlusion\.decode: .*'gauss'"):
        load_config("configs/demo.yaml", ["model.task_options={edge_occlusion: {decode: gauss}}"])
    with pytest.raises(ConfigError, match=r"model\.task_options\.edge3d\.blur_sigma"):
        load_config("configs/demo.yaml", ["model.task_options={edge3d: {blur_sigma: -1}}"])
    with pytest.raises(ConfigError, match=r"model\.task_options: unknown task 'occlusion_edges'"):
        load_config("configs/demo.yaml", ["model.task_options={occlusion_edges: {decode: clip}}"])
    # 'edges' is the PASCAL/NYUD edge task: it exists, but has no such option
    with pytest.raises(ConfigError, match=r"model\.task_options\.edges: .*unsupported options \['decode'\]"):
        load_config("configs/demo.yaml", ["model.task_options={edges: {decode: clip}}"])
    assert load_config("configs/demo.yaml").model.get_task("edge_occlusion").frame_filter
