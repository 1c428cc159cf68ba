"""Training batches as integers: the loader's workers hand over the stored codes of each sample's crop, and the
training device decodes them in one batched pass.

A worker's per-sample work is what must happen per sample on a CPU: read the stored integer arrays and cut the crop
(`squad.data.transforms.SamplePipeline.integers`; a resize only where the stored size differs from the wanted one).
`collate_integers` stacks those into one integer tensor per domain (uint8, or uint16 carried as int16) — in shared
memory inside a DataLoader worker, so the batch leaves the worker without another copy, and pinned by the loader when
a GPU is present. `decode_batch` then does the per-pixel work on the training device for the whole batch: conversion
to float and normalisation (`Task.decode_codes`), the frame filters (edge_occlusion's blur, `Task.filter_frames`, on
the whole frame, then cropped), the unit vectors, the horizontal flips and the geometry masks. Its output equals
`squad.data.samples.collate` of the per-sample pipeline (`SamplePipeline.__call__`) within float rounding
(tests/test_device_decode.py checks it domain by domain with augmentation on).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from squad.data.transforms import GEOMETRY_DOMAIN
from squad.tasks.depth import NO_GEOMETRY

INTEGERS = "integers"  # the key that marks an integer batch


def is_integer_batch(batch: Any) -> bool:
    """True for a batch made by `collate_integers`."""
    return isinstance(batch, dict) and INTEGERS in batch


_DTYPES = {"uint8": torch.uint8, "int16": torch.int16, "float32": torch.float32, "int64": torch.int64,
           "bool": torch.bool}


def collate_integers(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Packs the integer samples of `squad.data.samples.SampleDataset` (``integer_batches`` on) into a batch held in
    ONE byte buffer (``buffer``, in shared memory inside a DataLoader worker: one segment to hand over, one copy to
    pin and to move to the GPU), with ``layout`` saying where each part lies; `unpack` gives the parts as tensors:
    ``integers`` ``{domain: [B, ...] or None}`` (uint8, uint16 carried as int16, float32 class vectors; None: no
    sample of the batch has the domain), ``present`` ``bool [B, D]``, ``crop`` ``int64 [B, 2]`` (top, left) and
    ``flip`` ``bool [B]``. Beside them: ``domains``, ``id`` and ``cpu_s`` (the worker's CPU seconds for the batch,
    for the loader's rate in the run log).

    Raises:
        ValueError: an empty list.
    """
    if not samples:
        raise ValueError("collate_integers: no samples")
    t0 = time.thread_time()
    n = len(samples)
    domains = list(samples[0]["arrays"])
    parts: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
    templates: dict[str, np.ndarray] = {}
    for d in domains:
        template = next((s["arrays"][d] for s in samples if s["arrays"][d] is not None), None)
        if template is not None:
            templates[d] = template
            dtype = np.dtype(np.int16) if template.dtype == np.uint16 else template.dtype
            parts[d] = (dtype, (n, *template.shape))
    parts["present"] = (np.dtype(np.bool_), (n, len(domains)))
    parts["crop"] = (np.dtype(np.int64), (n, 2))
    parts["flip"] = (np.dtype(np.bool_), (n,))
    layout, total = {}, 0
    for key, (dtype, shape) in parts.items():
        layout[key] = (total, dtype.name, shape)
        total += -(-int(np.prod(shape)) * dtype.itemsize // 8) * 8  # 8-byte aligned parts
    buffer = torch.empty(total, dtype=torch.uint8)
    if get_worker_info() is not None:
        buffer.share_memory_()
    raw = buffer.numpy()

    def part(key: str) -> np.ndarray:
        off, name, shape = layout[key]
        dtype = np.dtype(name)
        return raw[off: off + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)

    for d in templates:
        out = part(d)
        for i, s in enumerate(samples):
            a = s["arrays"][d]
            if a is None:
                out[i] = 0
            else:
                out[i] = a.view(out.dtype) if a.dtype != out.dtype else a
    part("present")[...] = [[s["arrays"][d] is not None for d in domains] for s in samples]
    part("crop")[...] = [s["crop"] for s in samples]
    part("flip")[...] = [s["flip"] for s in samples]
    return {INTEGERS: {d: layout.get(d) for d in domains}, "layout": layout, "buffer": buffer, "domains": domains,
            "id": [s["id"] for s in samples],
            "cpu_s": sum(s.get("cpu_s", 0.0) for s in samples) + time.thread_time() - t0}


def unpack(batch: dict[str, Any], device: torch.device | str = "cpu") -> dict[str, Any]:
    """The parts of a `collate_integers` batch as tensors on `device` (views of its buffer, moved in one copy without
    blocking): ``integers``, ``present``, ``crop``, ``flip``."""
    buf = batch["buffer"].to(device, non_blocking=True)

    def part(entry: tuple[int, str, tuple[int, ...]] | None) -> torch.Tensor | None:
        if entry is None:
            return None
        off, name, shape = entry
        dtype = _DTYPES[name]
        size = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return buf[off: off + size].view(dtype).view(shape)

    layout = batch["layout"]
    return {INTEGERS: {d: part(e) for d, e in batch[INTEGERS].items()},
            **{k: part(layout[k]) for k in ("present", "crop", "flip")}}


def _codes(t: torch.Tensor) -> torch.Tensor:
    """Stored codes ``[B, H, W]`` / ``[B, H, W, C]`` (int16 carrying uint16) → ``float32 [B, C, H, W]``."""
    if t.dtype == torch.int16:
        t = t.to(torch.int32) & 0xFFFF
    t = t.to(torch.float32)
    return t.unsqueeze(1) if t.dim() == 3 else t.permute(0, 3, 1, 2)


def _crop(x: torch.Tensor, crop: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Per-sample windows ``[B, C, h, w]`` of frames ``[B, C, H, W]`` at ``crop`` (top, left), in one gather."""
    b = torch.arange(x.shape[0], device=x.device)[:, None, None]
    rows = (crop[:, 0, None] + torch.arange(hw[0], device=x.device))[:, :, None]
    cols = (crop[:, 1, None] + torch.arange(hw[1], device=x.device))[:, None, :]
    return x.permute(0, 2, 3, 1)[b, rows, cols].permute(0, 3, 1, 2)


def decode_batch(batch: dict[str, Any], pipeline, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Decodes an integer batch on `device`: ``(rgb float32 [B, 3, h, w], targets, masks)`` as
    `squad.data.samples.collate` of `pipeline`'s per-sample samples gives them (module docstring).

    Args:
        batch: a `collate_integers` batch (pinned or not; copied to `device` without blocking).
        pipeline: the dataset's `squad.data.transforms.SamplePipeline`.
        device: the training device.
    """
    device = torch.device(device)
    parts = unpack(batch, device)
    ints, present, crop = parts[INTEGERS], parts["present"], parts["crop"]
    flip = parts["flip"].view(-1, 1, 1, 1)
    col = {d: k for k, d in enumerate(batch["domains"])}
    rgb = ints["rgb"].permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    n, hw = rgb.shape[0], tuple(rgb.shape[-2:])
    full = set(pipeline.full_frame_domains)

    def flipped(x: torch.Tensor) -> torch.Tensor:
        return torch.where(flip, x.flip(-1), x)

    geo, geo_frame = None, None
    if ints.get(GEOMETRY_DOMAIN) is not None:
        lacking = ~present[:, col[GEOMETRY_DOMAIN]].view(-1, 1, 1, 1)
        valid = (_codes(ints[GEOMETRY_DOMAIN]) != NO_GEOMETRY) | lacking  # a sample without the file: no geometry
        if GEOMETRY_DOMAIN in full:
            geo_frame, geo = valid, _crop(valid, crop, hw)
        else:
            geo = valid
    targets: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    for task in pipeline.tasks:
        d = task.domain
        if task.head_kind == "class":
            if ints.get(d) is None:
                value, mask = torch.zeros(n, task.channels, device=device), torch.zeros(n, 1, dtype=torch.bool,
                                                                                         device=device)
            else:
                value, mask = task.decode_codes(ints[d].to(torch.float32))
                have = present[:, col[d]].view(-1, 1)
                value, mask = torch.where(have, value, torch.zeros((), device=device)), mask & have
            targets[task.name], masks[task.name] = value, mask
            continue
        if ints.get(d) is None:
            targets[task.name] = torch.zeros(n, task.channels, *hw, device=device)
            masks[task.name] = torch.zeros(n, 1, *hw, dtype=torch.bool, device=device)
            continue
        value, mask = task.decode_codes(_codes(ints[d]))
        if d in full:  # decoded and filtered on the whole frame, then cropped
            valid = mask & geo_frame if geo_frame is not None and task.geometric else mask
            value, mask = _crop(task.filter_frames(value, valid), crop, hw), _crop(mask, crop, hw)
        value, mask = torch.where(flip, task.hflip(value), value), flipped(mask)
        have = present[:, col[d]].view(-1, 1, 1, 1)
        value, mask = torch.where(have, value, torch.zeros((), device=device)), mask & have
        if pipeline.geometry_mask and geo is not None and task.geometric:
            mask = mask & flipped(geo)
        targets[task.name], masks[task.name] = value, mask
    return flipped(rgb), targets, masks
