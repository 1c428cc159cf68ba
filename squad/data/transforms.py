"""From raw Taskonomy files to one training sample: resize, crop, decode, flip — the same for PNG trees and shards.

The order is fixed so that any two readers of the same raw arrays give identical samples:

1. `Task.compact_raw` drops channels that decoding never reads;
2. `resize_raw` resizes in the encoded domain (only when the stored size differs from the wanted one): bilinear
   with antialiasing, then rounded back to the file's dtype; nearest neighbour for segment ids. The resize is
   *mask-aware* for every domain with invalid pixels (below), so fill values never blend into valid pixels;
3. a crop (random when augmenting, else centred) — exact, per pixel, so it commutes with decoding;
4. `Task.decode` per domain (values in units + valid mask); a task with a `Task.frame_filter` (edge_occlusion's
   Gaussian blur) is decoded and filtered on the whole resized frame first, then cropped, so its values do not
   depend on where the crop falls;
5. a horizontal flip (when augmenting, p = 0.5) through `Task.hflip`, which negates the normal's x.

The HDF5 packer stores the output of steps 1–2 (never a filter), so a shard reader that asks for the packed size
skips them and yields exactly what the PNG reader yields.

Sizes: a square file of another size than wanted is resized (aspect kept). A file that would be distorted — a
non-square image when a size is asked for — or a dense target whose size differs from its rgb image's raises
`WrongSizeError` (a `DecodeError` carrying the domain): the dataset skips or masks it and counts it as a wrong-size
file (`squad.data.accounting`), never stretches it.

Geometry mask: Taskonomy ships no valid-mask domain; where the scene has no geometry, depth_zbuffer holds 65535
(`DepthTask.raw_valid`, the same rule as its decode mask; the original code's ≥ 64500 differs only for depths over
125.9 m). When that file is at hand, its valid mask is ANDed into the masks of the geometric tasks
(`Task.geometric`).

Mask-aware resizing: the geometric domains (depth, normal, curvature, reshading, edge_occlusion, keypoints3d,
segment_unsup25d) hold fill values where there is no geometry — normal (128,128,128), curvature (0,0,0), reshading
8–13, depth 65535, and whatever the others' writers left. When a sample's depth_zbuffer is read (a geometric task
with ``geometry_mask``, or depth_zbuffer a task itself), its valid pixels at the stored size (a `Footprint`) are
the mask of every geometric domain's resize, ANDed with the domain's own `Task.raw_valid` (depth ≠ 65535, normal
not the fill): each output pixel is the mean of the valid pixels of its footprint only (a normalised convolution;
the coverage is computed once per sample and shared). An output pixel whose footprint is less than half valid
(`MIN_COVERAGE`) holds the task's `Task.raw_fill` and is masked: the resize's validity is ANDed into the task's mask,
and it is the geometry mask itself (depth_zbuffer's resized file holds 65535 exactly there), so a packed shard read
back gives the same masks. Segment ids stay nearest-neighbour; a pixel whose nearest input is invalid takes a
valid id from its footprint. Without a depth_zbuffer file (not read, missing, corrupt) each domain falls back to
its own `Task.raw_valid` (depth, normal) or a plain resize (the scalar domains, whose fills are then blended).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from squad.tasks import DecodeError, Task, get_task
from squad.tasks.base import integer_image

GEOMETRY_DOMAIN = "depth_zbuffer"


class WrongSizeError(DecodeError):
    """A file whose size the pipeline refuses: non-square where it would be resized, or not its rgb image's size."""

    def __init__(self, message: str, domain: str) -> None:
        super().__init__(message)
        self.domain = domain


def check_size(domain: str, raw: np.ndarray, rgb_hw: tuple[int, int] | None, resizes: bool) -> None:
    """Refuses a raw array the pipeline could only distort (see the module docstring).

    Args:
        domain: the file's domain (``"rgb"`` or a task domain; class vectors are never checked).
        raw: the array as read.
        rgb_hw: the sample's rgb size (None when checking the rgb file itself).
        resizes: whether the pipeline resizes to a square size.

    Raises:
        WrongSizeError: the file is not square although it would be resized, or differs from the rgb size.
    """
    if domain != "rgb" and get_task(domain).head_kind == "class":
        return
    hw = tuple(raw.shape[:2])
    if rgb_hw is not None and hw != tuple(rgb_hw):
        raise WrongSizeError(f"{domain}: size {hw[0]}×{hw[1]} differs from the rgb image's {rgb_hw[0]}×{rgb_hw[1]}",
                             domain)
    if rgb_hw is None and resizes and hw[0] != hw[1]:
        raise WrongSizeError(f"{domain}: {hw[0]}×{hw[1]} is not square; resizing it to a square would distort it "
                             f"(crop or pad the files to squares)", domain)


def compact_rgb(raw: np.ndarray) -> np.ndarray:
    """RGB file contents → ``uint8 [H, W, 3]`` (gray is replicated, alpha dropped).

    Raises:
        DecodeError: for anything that is not an 8-bit image.
    """
    if raw.dtype != np.uint8:
        raise DecodeError(f"rgb: expected an 8-bit image, got dtype {raw.dtype}")
    if raw.ndim == 2:
        return np.repeat(raw[:, :, None], 3, axis=2)
    if raw.ndim == 3 and raw.shape[2] >= 3:
        return raw[:, :, :3]
    raise DecodeError(f"rgb: expected an image [H, W] or [H, W, 3|4], got shape {raw.shape}")


def decode_rgb(raw: np.ndarray) -> torch.Tensor:
    """``uint8 [H, W, 3]`` → ``float32 [3, H, W]`` in [0, 1]."""
    t = torch.from_numpy(np.ascontiguousarray(compact_rgb(raw)))
    return t.permute(2, 0, 1).to(torch.float32).div_(255.0)


MIN_COVERAGE = 0.5  # an output pixel is valid when at least this share of its resize footprint was valid


def coverage(valid: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """Share of valid input pixels in each output pixel's footprint: the antialiased bilinear resize of a
    ``bool [H, W]`` mask, as ``float32 [1, 1, h, w]``. An output pixel is valid where it is >= `MIN_COVERAGE`."""
    m = torch.from_numpy(np.ascontiguousarray(valid)).to(torch.float32)[None, None]
    return F.interpolate(m, size=size, mode="bilinear", antialias=True, align_corners=False)


def _nearest_index(n_in: int, n_out: int, offset: float) -> np.ndarray:
    """Input index read by each output index at `offset` (0–1) inside its footprint (0.5: torch's nearest-exact)."""
    return np.minimum(((np.arange(n_out) + offset) * (n_in / n_out)).astype(np.int64), n_in - 1)


def _resize_nearest(raw: np.ndarray, size: tuple[int, int], valid: np.ndarray | None) -> np.ndarray:
    """Nearest-neighbour resize (torch's nearest-exact); with `valid`, an output pixel whose nearest input pixel is
    invalid takes a valid one from the four quarter points of its footprint when there is one."""
    rows, cols = _nearest_index(raw.shape[0], size[0], 0.5), _nearest_index(raw.shape[1], size[1], 0.5)
    out = raw[rows[:, None], cols[None, :]]
    if valid is None:
        return np.ascontiguousarray(out)
    ok = valid[rows[:, None], cols[None, :]]
    bad_r, bad_c = np.nonzero(~ok)
    for oy, ox in ((0.25, 0.25), (0.25, 0.75), (0.75, 0.25), (0.75, 0.75)):
        if not len(bad_r):
            break
        r = _nearest_index(raw.shape[0], size[0], oy)[bad_r]
        c = _nearest_index(raw.shape[1], size[1], ox)[bad_c]
        take = valid[r, c]
        out[bad_r[take], bad_c[take]] = raw[r[take], c[take]]
        bad_r, bad_c = bad_r[~take], bad_c[~take]
    return out


def resize_raw(raw: np.ndarray, size: tuple[int, int], resample: str, valid: np.ndarray | None = None,
               fill: int = 0, weight: torch.Tensor | None = None) -> np.ndarray:
    """Resizes an encoded image ``[H, W]`` or ``[H, W, C]`` to `size` = (h, w), keeping its dtype.

    Args:
        raw: integer image as read from the file.
        size: output (height, width).
        resample: ``"bilinear"`` (antialiased) or ``"nearest"``.
        valid: ``bool [H, W]`` valid pixels (None: all valid). Bilinear: a normalised convolution — each output
            pixel is the weighted mean of the valid pixels of its footprint only, so fill values never blend in;
            ``"nearest"``: an output pixel prefers a valid input pixel of its footprint.
        fill: code written where less than `MIN_COVERAGE` of an output pixel's footprint was valid (bilinear).
        weight: ``coverage(valid, size)`` when the caller already has it (shared by the domains of a sample).

    Returns:
        The resized image, rounded and clipped to the input dtype's range. 8-bit images without a mask take
        torch's uint8 antialiasing kernel (rounding inside), everything else a float32 pass.
    """
    if raw.shape[:2] == tuple(size):
        return raw
    if valid is not None and valid.all():
        valid, weight = None, None
    if resample == "nearest":
        return _resize_nearest(raw, size, valid)
    if resample != "bilinear":
        raise ValueError(f"resize_raw: resample must be 'bilinear' or 'nearest', got {resample!r}")
    squeeze = raw.ndim == 2
    if valid is None:
        x = torch.from_numpy(np.ascontiguousarray(raw))
        x = x[None, None] if squeeze else x.permute(2, 0, 1)[None]  # [1, C, H, W] (channels-last in memory)
        if raw.dtype == np.uint8:
            y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)  # uint8 kernel
            out = y[0, 0] if squeeze else y[0].permute(1, 2, 0)
            return np.ascontiguousarray(out.numpy())
        y = F.interpolate(x.to(torch.float32).contiguous(), size=size, mode="bilinear", antialias=True,
                          align_corners=False)
    else:  # invalid pixels zeroed while casting, one channel at a time into a [1, C, H, W] buffer
        planes = raw[None] if squeeze else raw.transpose(2, 0, 1)
        buf = np.empty(planes.shape, dtype=np.float32)
        for c in range(planes.shape[0]):
            np.multiply(planes[c], valid, out=buf[c], dtype=np.float32)
        num = F.interpolate(torch.from_numpy(buf)[None], size=size, mode="bilinear", antialias=True,
                            align_corners=False)
        den = coverage(valid, size) if weight is None else weight
        y = torch.where(den >= MIN_COVERAGE, num / den.clamp_min(1e-6), torch.full((), float(fill)))
    info = np.iinfo(raw.dtype)
    y = y.round_().clamp_(info.min, info.max)[0]
    out = y[0] if squeeze else y.permute(1, 2, 0)
    return out.numpy().astype(raw.dtype)


def wire_codes(code: np.ndarray, bits: int) -> np.ndarray:
    """A checked integer image (`integer_image`) in the dtype a batch carries it in: uint8 for 8-bit domains, uint16
    for 16-bit ones."""
    dtype = np.uint8 if bits == 8 else np.uint16
    return code if code.dtype == dtype else code.astype(dtype)


def class_vector(task: Task, raw: np.ndarray) -> np.ndarray:
    """A class file's vector as ``float32 [C]`` (checked as `Task.decode` checks it).

    Raises:
        DecodeError: not numeric, or not `Task.channels` values.
    """
    arr = np.asarray(raw)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise DecodeError(f"task {task.name}: expected a numeric vector, got dtype {arr.dtype}")
    arr = arr.astype(np.float32).reshape(-1)
    if arr.shape[0] != task.channels:
        raise DecodeError(f"task {task.name}: expected {task.channels} values, got shape {np.shape(raw)}")
    return arr


class Footprint:
    """The geometry of one sample at its stored size — depth_zbuffer's valid pixels — and, cached per output size,
    their coverage (`coverage`): what the mask-aware resize of every masked domain of the sample uses.

    Args:
        valid: ``bool [H, W]`` pixels with geometry.
    """

    def __init__(self, valid: np.ndarray) -> None:
        self.valid = valid
        self.all_valid = bool(valid.all())
        self._weights: dict[tuple[int, int], torch.Tensor] = {}
        self._resized: dict[tuple[int, int], np.ndarray] = {}

    def weight(self, size: tuple[int, int]) -> torch.Tensor:
        """``coverage(valid, size)`` (computed once per size)."""
        if size not in self._weights:
            self._weights[size] = coverage(self.valid, size)
        return self._weights[size]

    def resized(self, size: tuple[int, int]) -> np.ndarray:
        """``bool [h, w]``: output pixels with geometry after a resize to `size` (coverage >= `MIN_COVERAGE`)."""
        if size == self.valid.shape:
            return self.valid
        if size not in self._resized:
            self._resized[size] = (self.weight(size)[0, 0] >= MIN_COVERAGE).numpy()
        return self._resized[size]


def crop_box(in_hw: tuple[int, int], out_hw: tuple[int, int], rng: np.random.Generator | None) -> tuple[int, int]:
    """Top-left corner of a crop: uniform with `rng`, centred without.

    Raises:
        ValueError: if the crop is larger than the image.
    """
    (h, w), (oh, ow) = in_hw, out_hw
    if oh > h or ow > w:
        raise ValueError(f"crop {out_hw} is larger than the image {in_hw}; lower image_size or raise resize")
    if rng is None:
        return (h - oh) // 2, (w - ow) // 2
    return int(rng.integers(0, h - oh + 1)), int(rng.integers(0, w - ow + 1))


class SamplePipeline:
    """Turns the raw arrays of one sample into ``(rgb, targets, masks)`` (see the module docstring).

    Args:
        tasks: the tasks to produce (canonical names or `Task` objects).
        image_size: output height = width; None keeps the stored size (no resize, no crop).
        resize: size the raw arrays are resized to before cropping `image_size`; None means `image_size`.
        augment: random crop and horizontal flip; otherwise a centred crop and no flip.
        geometry_mask: AND the depth_zbuffer valid mask into geometric tasks' masks when it is available.
    """

    def __init__(self, tasks: Sequence[str | Task], image_size: int | None = None, resize: int | None = None,
                 augment: bool = False, geometry_mask: bool = True) -> None:
        self.tasks = [t if isinstance(t, Task) else get_task(t) for t in tasks]
        if resize is not None and image_size is None:
            raise ValueError("resize needs image_size (the crop taken from the resized image)")
        self.image_size = image_size
        self.resize = resize if resize is not None else image_size
        if self.resize is not None and image_size is not None and self.resize < image_size:
            raise ValueError(f"resize ({self.resize}) must be >= image_size ({image_size})")
        self.augment = augment
        self.geometry_mask = geometry_mask and any(t.geometric for t in self.tasks)
        self._by_domain = {t.domain: t for t in self.tasks}
        self._depth = get_task(GEOMETRY_DOMAIN)

    @property
    def domains(self) -> list[str]:
        """Domains read from disk for a sample: rgb, the tasks', and depth_zbuffer when it masks geometry."""
        out = ["rgb", *(t.domain for t in self.tasks)]
        if self.geometry_mask and GEOMETRY_DOMAIN not in out:
            out.append(GEOMETRY_DOMAIN)
        return out

    def task(self, domain: str) -> Task:
        """This pipeline's task for a domain (its own instance, with the options it was built with)."""
        return self._by_domain.get(domain) or get_task(domain)

    def footprint(self, raw: np.ndarray | None) -> Footprint | None:
        """The `Footprint` of a sample from its raw depth_zbuffer array (None when it has none).

        Raises:
            DecodeError: the array is not a depth image.
        """
        if raw is None:
            return None
        return Footprint(self._depth.raw_valid(integer_image(self._depth.compact_raw(raw), 16, GEOMETRY_DOMAIN)))

    def prepare_raw(self, domain: str, raw: np.ndarray, size: int | None = None,
                    footprint: Footprint | None = None) -> np.ndarray:
        """Steps 1–2: compact and resize one raw array to `size` (default: this pipeline's resize size).

        Args:
            domain: ``"rgb"`` or a task domain.
            raw: the array as read.
            size: output side; None: this pipeline's resize size (None there: no resize).
            footprint: the sample's geometry (`footprint`) at the stored size; masked domains are resized with it
                (module docstring). None: each domain's own `Task.raw_valid` only.
        """
        return self._prepare(domain, raw, size, footprint)[0]

    def _prepare(self, domain: str, raw: np.ndarray, size: int | None, footprint: Footprint | None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
        """`prepare_raw`, plus the resized validity (``bool [size, size]``) when the resize was mask-aware."""
        size = self.resize if size is None else size
        if domain == "rgb":
            raw = compact_rgb(raw)
            return (raw if size is None else resize_raw(raw, (size, size), "bilinear")), None
        task = self.task(domain)
        raw = task.compact_raw(raw)
        if size is None or task.resample == "none" or raw.shape[:2] == (size, size):
            return raw, None
        out = (size, size)
        own = task.raw_valid(raw) if task.resample == "bilinear" else None
        geo = footprint if task.geometric and footprint is not None and footprint.valid.shape == raw.shape[:2] else None
        if geo is None:
            if own is None:
                return resize_raw(raw, out, task.resample), None
            return resize_raw(raw, out, task.resample, own, task.raw_fill), None  # the decode mask sees the fill
        if own is None or np.count_nonzero(own & geo.valid) == np.count_nonzero(geo.valid):
            if geo.all_valid and own is None:
                return resize_raw(raw, out, task.resample), None
            valid, weight, valid_out = geo.valid, geo.weight(out), geo.resized(out)
        else:
            valid = own & geo.valid
            weight = coverage(valid, out)
            valid_out = (weight[0, 0] >= MIN_COVERAGE).numpy()
        if task.resample == "nearest":  # ids: picked from valid pixels; validity as the geometry's
            return resize_raw(raw, out, "nearest", valid), geo.resized(out)
        return resize_raw(raw, out, "bilinear", valid, task.raw_fill, weight), valid_out

    def _rgb_window(self, raws: Mapping[str, object], rng) -> tuple:
        """The sample's rgb raw (sized as `prepare_raw` makes it) and its window: (rgb raw, its [h, w], the output
        [h, w], top, left, flip). The crop and then the flip are drawn from ``rng`` when augmenting, in that order,
        here alone: the per-sample pipeline and the integer one draw the same and so agree sample for sample."""
        try:
            check_size("rgb", raws["rgb"], None, self.resize is not None)
            rgb_raw = self.prepare_raw("rgb", raws["rgb"])
        except DecodeError as e:
            e.domain = "rgb"
            raise
        hw = rgb_raw.shape[:2]
        out_hw = hw if self.image_size is None else (self.image_size, self.image_size)
        top, left = crop_box(hw, out_hw, rng if self.augment else None)
        flip = bool(self.augment and rng is not None and rng.random() < 0.5)
        return rgb_raw, hw, out_hw, top, left, flip

    def __call__(self, raws: dict[str, np.ndarray | None], rng: np.random.Generator | None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Builds one sample.

        Args:
            raws: ``{domain: raw array or None}`` for `domains`; None marks a missing file (zeros, mask False).
                ``raws["rgb"]`` is required.
            rng: draws the crop and the flip when augmenting (ignored otherwise).

        Returns:
            rgb ``float32 [3, H, W]``, targets ``{task: value}``, masks ``{task: bool}`` (shapes in squad.tasks.base).
        """
        stored_hw = tuple(raws["rgb"].shape[:2])
        rgb_raw, hw, out_hw, top, left, flip = self._rgb_window(raws, rng)

        def same_size(a_hw: tuple[int, ...]) -> None:
            if tuple(a_hw) != tuple(hw):
                raise DecodeError(f"raw size {tuple(a_hw)} differs from the rgb size {tuple(hw)}")

        def window(a):  # numpy [H, W, ...] or torch [..., H, W]
            if isinstance(a, torch.Tensor):
                same_size(a.shape[-2:])
                return a[..., top: top + out_hw[0], left: left + out_hw[1]]
            same_size(a.shape[:2])
            return a[top: top + out_hw[0], left: left + out_hw[1]]

        rgb = decode_rgb(window(rgb_raw))
        if flip:
            rgb = torch.flip(rgb, dims=(-1,))
        # the geometry: its footprint at the stored size (for resizing) and its mask on the resized frame
        footprint, geo_frame, prepared = None, None, {}
        if raws.get(GEOMETRY_DOMAIN) is not None:
            try:
                check_size(GEOMETRY_DOMAIN, raws[GEOMETRY_DOMAIN], stored_hw, self.resize is not None)
                footprint = self.footprint(raws[GEOMETRY_DOMAIN])
                prepared[GEOMETRY_DOMAIN] = self._prepare(GEOMETRY_DOMAIN, raws[GEOMETRY_DOMAIN], None, footprint)
                geo_raw = prepared[GEOMETRY_DOMAIN][0]
                same_size(geo_raw.shape[:2])
                geo_frame = torch.from_numpy(np.ascontiguousarray(self._depth.raw_valid(geo_raw)))[None]  # [1, h, w]
            except DecodeError as e:
                e.domain = GEOMETRY_DOMAIN
                raise
        targets: dict[str, torch.Tensor] = {}
        masks: dict[str, torch.Tensor] = {}
        for task in self.tasks:
            raw = raws.get(task.domain)
            if raw is None:
                targets[task.name], masks[task.name] = self._missing(task, out_hw)
                continue
            try:
                check_size(task.domain, raw, stored_hw, self.resize is not None)
                raw, valid_out = prepared.get(task.domain) or self._prepare(task.domain, raw, None, footprint)
                if task.head_kind == "class":
                    value, mask = task.decode(raw)
                elif task.frame_filter:  # decoded and filtered on the whole frame, then cropped (exact per pixel)
                    same_size(raw.shape[:2])
                    value, mask = task.decode(raw)
                    if valid_out is not None:
                        mask = mask & torch.from_numpy(valid_out)[None]
                    valid = mask if geo_frame is None or not task.geometric else mask & geo_frame
                    value, mask = window(task.filter_frame(value, valid)), window(mask)
                else:
                    value, mask = task.decode(window(raw))
                    if valid_out is not None:
                        mask = mask & torch.from_numpy(np.ascontiguousarray(window(valid_out)))[None]
            except DecodeError as e:
                e.domain = task.domain  # lets the dataset mask this domain instead of dropping the sample
                raise
            if flip and task.head_kind == "dense":
                value, mask = task.hflip(value), torch.flip(mask, dims=(-1,))
            targets[task.name], masks[task.name] = value, mask
        if self.geometry_mask and geo_frame is not None:
            geo = window(geo_frame)
            if flip:
                geo = torch.flip(geo, dims=(-1,))
            for task in self.tasks:
                if task.geometric:
                    masks[task.name] = masks[task.name] & geo
        return rgb, targets, masks

    # ------------------------------------------------------------------------------ integer batches (device)
    @property
    def full_frame_domains(self) -> list[str]:
        """Domains whose whole resized frame is handed over (not the crop): a task with a `Task.frame_filter`
        (filtered on the frame before the crop), and depth_zbuffer when it masks such a filter."""
        filtered = [t for t in self.tasks if t.frame_filter and t.head_kind == "dense"]
        out = [t.domain for t in filtered]
        if any(t.geometric for t in filtered) and GEOMETRY_DOMAIN in self.domains and GEOMETRY_DOMAIN not in out:
            out.append(GEOMETRY_DOMAIN)
        return out

    def integers(self, raws: dict[str, np.ndarray | None], rng: np.random.Generator | None) -> dict:
        """The per-sample CPU stage of a training batch: steps 1–3 of the module docstring (compact, resize when
        the stored size differs, the crop), kept as the file's integers; decoding, the filter, the flip and the
        masks run batched on the training device (`squad.data.device.decode_batch`), giving what `__call__`
        gives.

        Returns:
            ``{"arrays": {domain: uint8/uint16 [h, w(, C)] crop (the whole frame for `full_frame_domains`),
            float32 [C] class vector, or None where missing}, "crop": (top, left), "flip": bool}``.

        Raises:
            DecodeError: (with its ``domain``) a file `__call__` would refuse.
        """
        stored_hw = raws["rgb"].shape[:2]
        resizes = self.resize is not None and stored_hw != (self.resize, self.resize)
        if resizes:  # arrays read in place (read-only shard maps) are copied for torch's resize
            raws = {d: (a if a is None or a.flags.writeable else a.copy()) for d, a in raws.items()}
        rgb_raw, hw, out_hw, top, left, flip = self._rgb_window(raws, rng)
        arrays: dict[str, np.ndarray | None] = {"rgb": rgb_raw[top: top + out_hw[0], left: left + out_hw[1]]}
        footprint = None
        for domain, task, wire, full in self._integer_plan():
            raw = raws.get(domain)
            if raw is None:
                arrays[domain] = None
                continue
            try:
                if wire is None:
                    arrays[domain] = (raw if raw.dtype == np.float32 and raw.shape == (task.channels,)
                                      else class_vector(task, raw))
                    continue
                if raw.shape[:2] != stored_hw:
                    check_size(domain, raw, stored_hw, self.resize is not None)
                if stored_hw != hw:  # resized: mask-aware, with the sample's geometry
                    if domain == GEOMETRY_DOMAIN:
                        footprint = self.footprint(raw)
                    raw = self._prepare(domain, raw, None, footprint)[0]
                else:
                    raw = task.compact_raw(raw)
                code = raw if raw.dtype == wire else wire_codes(integer_image(raw, task.bits, task.name), task.bits)
                if code.shape[:2] != hw:
                    raise DecodeError(f"raw size {tuple(code.shape[:2])} differs from the rgb size {tuple(hw)}")
            except DecodeError as e:
                e.domain = domain
                raise
            arrays[domain] = code if full else code[top: top + out_hw[0], left: left + out_hw[1]]
        return {"arrays": arrays, "crop": (top, left), "flip": flip}

    def _integer_plan(self) -> list[tuple[str, Task, np.dtype | None, bool]]:
        """`integers`' domains after rgb, depth_zbuffer first (the footprint of a resize): (domain, task, the dtype
        the batch carries — None for a class vector —, whether the whole frame is handed over). Built once."""
        if getattr(self, "_plan", None) is None:
            full = self.full_frame_domains
            plan = []
            for d in sorted(self.domains[1:], key=lambda d: d != GEOMETRY_DOMAIN):
                task = self.task(d)
                wire = None if task.head_kind == "class" else np.dtype(np.uint8 if task.bits == 8 else np.uint16)
                plan.append((d, task, wire, d in full))
            self._plan = plan
        return self._plan

    @staticmethod
    def _missing(task: Task, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Placeholder value (zeros) and an all-False mask for a domain the sample lacks."""
        if task.head_kind == "class":
            return torch.zeros(task.channels), torch.zeros(1, dtype=torch.bool)
        return torch.zeros(task.channels, *hw), torch.zeros(1, *hw, dtype=torch.bool)
