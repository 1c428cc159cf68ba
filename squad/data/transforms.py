"""From raw Taskonomy files to one training sample: resize, crop, decode, flip — the same for PNG trees and shards.

The order is fixed so that any two readers of the same raw arrays give identical samples:

1. `Task.compact_raw` drops channels that decoding never reads;
2. `resize_raw` resizes in the encoded domain (only when the stored size differs from the wanted one): bilinear
   with antialiasing, *mask-aware* for domains with invalid codes (depth 65535, normal fill) so invalid pixels never
   bleed into valid ones, then rounded back to the file's dtype; nearest neighbour for segment ids;
3. a crop (random when augmenting, else centred) — exact, per pixel, so it commutes with decoding;
4. `Task.decode` per domain (values in units + valid mask);
5. a horizontal flip (when augmenting, p = 0.5) through `Task.hflip`, which negates the normal's x.

The HDF5 packer stores the output of steps 1–2, so a shard reader that asks for the packed size skips them and
yields exactly what the PNG reader yields.

Sizes: a square file of another size than wanted is resized (aspect kept). A file that would be distorted — a
non-square image when a size is asked for — or a dense target whose size differs from its rgb image's raises
`WrongSizeError` (a `DecodeError` carrying the domain): the dataset skips or masks it and counts it as a wrong-size
file (`squad.data.accounting`), never stretches it.

Geometry mask: Taskonomy ships no valid-mask domain; where the scene has no geometry, depth_zbuffer holds 65535.
When that file is at hand, its valid mask is ANDed into the masks of the geometric tasks (`Task.geometric`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from squad.tasks import DecodeError, Task, get_task

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


def resize_raw(raw: np.ndarray, size: tuple[int, int], resample: str, valid: np.ndarray | None = None,
               fill: int = 0) -> np.ndarray:
    """Resizes an encoded image ``[H, W]`` or ``[H, W, C]`` to `size` = (h, w), keeping its dtype.

    Args:
        raw: integer image as read from the file.
        size: output (height, width).
        resample: ``"bilinear"`` (antialiased) or ``"nearest"``.
        valid: ``bool [H, W]`` valid pixels for a mask-aware bilinear resize (None: all valid).
        fill: code written where less than half of an output pixel's footprint was valid.

    Returns:
        The resized image, rounded and clipped to the input dtype's range. 8-bit images without a mask take
        torch's uint8 antialiasing kernel (rounding inside), everything else a float32 pass.
    """
    if raw.shape[:2] == tuple(size):
        return raw
    if valid is not None and valid.all():
        valid = None
    squeeze = raw.ndim == 2
    x = torch.from_numpy(np.ascontiguousarray(raw))
    x = x[None, None] if squeeze else x.permute(2, 0, 1)[None]  # [1, C, H, W] (channels-last in memory)
    if resample == "bilinear" and valid is None and raw.dtype == np.uint8:
        y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)  # fast uint8 kernel
        out = y[0, 0] if squeeze else y[0].permute(1, 2, 0)
        return np.ascontiguousarray(out.numpy())
    x = x.to(torch.float32).contiguous()
    if resample == "nearest":
        y = F.interpolate(x, size=size, mode="nearest-exact")
    elif resample == "bilinear":
        if valid is None:
            y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        else:
            m = torch.from_numpy(np.ascontiguousarray(valid)).to(torch.float32)[None, None]  # [1, 1, H, W]
            num = F.interpolate(x * m, size=size, mode="bilinear", antialias=True, align_corners=False)
            den = F.interpolate(m, size=size, mode="bilinear", antialias=True, align_corners=False)
            y = torch.where(den >= 0.5, num / den.clamp_min(1e-6), torch.full((), float(fill)))
    else:
        raise ValueError(f"resize_raw: resample must be 'bilinear' or 'nearest', got {resample!r}")
    info = np.iinfo(raw.dtype)
    y = y.round_().clamp_(info.min, info.max)[0]
    out = y[0] if squeeze else y.permute(1, 2, 0)
    return out.numpy().astype(raw.dtype)


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
        self._depth = get_task(GEOMETRY_DOMAIN)

    @property
    def domains(self) -> list[str]:
        """Domains read from disk for a sample: rgb, the tasks', and depth_zbuffer when it masks geometry."""
        out = ["rgb", *(t.domain for t in self.tasks)]
        if self.geometry_mask and GEOMETRY_DOMAIN not in out:
            out.append(GEOMETRY_DOMAIN)
        return out

    def prepare_raw(self, domain: str, raw: np.ndarray, size: int | None = None) -> np.ndarray:
        """Steps 1–2: compact and resize one raw array to `size` (default: this pipeline's resize size)."""
        size = self.resize if size is None else size
        if domain == "rgb":
            raw = compact_rgb(raw)
            return raw if size is None else resize_raw(raw, (size, size), "bilinear")
        task = get_task(domain)
        raw = task.compact_raw(raw)
        if size is None or task.resample == "none":
            return raw
        valid = task.raw_valid(raw) if task.resample == "bilinear" else None
        return resize_raw(raw, (size, size), task.resample, valid, task.raw_fill)

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
        check_size("rgb", raws["rgb"], None, self.resize is not None)
        try:
            rgb_raw = self.prepare_raw("rgb", raws["rgb"])
        except DecodeError as e:
            e.domain = "rgb"
            raise
        hw = rgb_raw.shape[:2]
        out_hw = hw if self.image_size is None else (self.image_size, self.image_size)
        top, left = crop_box(hw, out_hw, rng if self.augment else None)
        flip = bool(self.augment and rng is not None and rng.random() < 0.5)

        def window(a: np.ndarray) -> np.ndarray:
            if a.shape[:2] != hw:
                raise DecodeError(f"raw size {a.shape[:2]} differs from the rgb size {hw}")
            return a[top: top + out_hw[0], left: left + out_hw[1]]

        rgb = decode_rgb(window(rgb_raw))
        if flip:
            rgb = torch.flip(rgb, dims=(-1,))
        targets: dict[str, torch.Tensor] = {}
        masks: dict[str, torch.Tensor] = {}
        for task in self.tasks:
            raw = raws.get(task.domain)
            if raw is None:
                targets[task.name], masks[task.name] = self._missing(task, out_hw)
                continue
            try:
                check_size(task.domain, raw, stored_hw, self.resize is not None)
                raw = self.prepare_raw(task.domain, raw)
                value, mask = task.decode(raw if task.head_kind == "class" else window(raw))
            except DecodeError as e:
                e.domain = task.domain  # lets the dataset mask this domain instead of dropping the sample
                raise
            if flip and task.head_kind == "dense":
                value, mask = task.hflip(value), torch.flip(mask, dims=(-1,))
            targets[task.name], masks[task.name] = value, mask
        if self.geometry_mask and raws.get(GEOMETRY_DOMAIN) is not None:
            if GEOMETRY_DOMAIN in masks:
                geo = masks[GEOMETRY_DOMAIN]  # already decoded as a target: its mask is the geometry mask
            else:
                geo = self._geometry(raws[GEOMETRY_DOMAIN], window, flip, stored_hw)
            for task in self.tasks:
                if task.geometric:
                    masks[task.name] = masks[task.name] & geo
        return rgb, targets, masks

    def _geometry(self, raw: np.ndarray, window, flip: bool, stored_hw: tuple[int, int]) -> torch.Tensor:
        """Valid-geometry mask ``bool [1, H, W]`` from a depth_zbuffer file."""
        try:
            check_size(GEOMETRY_DOMAIN, raw, stored_hw, self.resize is not None)
            _, mask = self._depth.decode(window(self.prepare_raw(GEOMETRY_DOMAIN, raw)))
        except DecodeError as e:
            e.domain = GEOMETRY_DOMAIN
            raise
        return torch.flip(mask, dims=(-1,)) if flip else mask

    @staticmethod
    def _missing(task: Task, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Placeholder value (zeros) and an all-False mask for a domain the sample lacks."""
        if task.head_kind == "class":
            return torch.zeros(task.channels), torch.zeros(1, dtype=torch.bool)
        return torch.zeros(task.channels, *hw), torch.zeros(1, *hw, dtype=torch.bool)
