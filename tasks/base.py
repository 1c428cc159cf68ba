"""The `Task` interface: how one Taskonomy domain is decoded, learned and scored.

A task turns the contents of one file into a value in physical or canonical units plus a valid mask (`decode`),
maps that value to what its head regresses (`target`) and back (`to_units`), and owns its masked loss and its
metrics. The model asks a task for its head (`head_kind`, `channels`); the data pipeline asks it how to resize and
flip its files; the training engine asks for the loss and for additive metric statistics.

Spaces and shapes (B = batch):

* value (what `decode` and the dataset give): dense ``float32 [C, H, W]`` with mask ``bool [1, H, W]``; class
  ``float32 [C]`` probabilities with mask ``bool [1]``. Batched by `squad.data.collate` to ``[B, C, H, W]`` /
  ``[B, 1, H, W]`` and ``[B, C]`` / ``[B, 1]``.
* head space (what the head outputs and what `target(value)` returns): dense ``[B, C, H, W]`` at the target's
  H, W; class ``[B, C]`` logits.

Calling convention, identical for the loss and the metrics::

    t = task.target(batch["targets"][name])          # head space
    loss = task.loss(pred, t, batch["masks"][name])  # scalar
    sums = task.metric_sums(pred, t, batch["masks"][name])  # additive float64 statistics
    ...                                               # sum `sums` over batches / all-reduce over ranks
    final = task.metrics(total_sums)

`metric_sums` applies `to_units` to both `pred` and `t` itself, so metrics are in the units `decode` gives.
Every task satisfies ``loss(target(v), target(v), mask) == 0`` and ``to_units(target(v)) == v`` up to rounding
(and up to the target's clipping range, where it has one).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from squad.lazy import module

torch = module("torch")  # imported at first use: building a task (the config does) needs no torch

HeadKind = Literal["dense", "class"]


class DecodeError(ValueError):
    """File contents do not match a task's encoding (wrong dtype, channels or length)."""


class Task:
    """Base class of the 13 Taskonomy tasks (and of any task registered later).

    Attributes:
        name: canonical task name, e.g. ``"depth_euclidean"``.
        domain: the folder name on disk (Taskonomy's domain name); the same as `name` for the 13 tasks.
        head_kind: ``"dense"`` (per-pixel prediction) or ``"class"`` (one distribution per image).
        channels: output channels of the head (classes for class tasks).
        primary_metric: the metric Δt uses by default (`squad.eval.metrics.delta_t`).
        higher_is_better: the names of the metrics (keys of `metrics`) for which higher is better, such as
            accuracies and threshold shares; every other metric is an error, lower is better. The one source of
            metric direction: `lower_is_better_for`, `lower_is_better`, Δt and the reports all read it.
        file_ext: ``".png"`` or ``".npy"``.
        bits: 8 or 16 for PNG domains (the bit depth `decode` expects), 0 for ``.npy``.
        geometric: the target only exists where the scene has geometry; the dataset ANDs the depth_zbuffer
            valid mask (≠ 65535) into this task's mask when that file is available.
        resample: how the reader resizes this domain's raw file: ``"bilinear"`` (mask-aware, antialiased),
            ``"nearest"`` (ids) or ``"none"`` (class vectors).
        raw_fill: the code written into pixels that are invalid after a mask-aware resize.
        frame_filter: `filter_frame` is not the identity: the data pipeline decodes this task on the whole resized
            frame and filters it there, before the crop and flip (a filter wider than one pixel, such as
            edge_occlusion's blur, would otherwise depend on where the crop falls).
    """

    name: str
    domain: str
    head_kind: HeadKind
    channels: int
    primary_metric: str
    higher_is_better: frozenset[str] = frozenset()
    file_ext: str = ".png"
    bits: int = 8
    geometric: bool = False
    resample: Literal["bilinear", "nearest", "none"] = "bilinear"
    raw_fill: int = 0
    frame_filter: bool = False

    # ----------------------------------------------------------------------------------------------- files
    def compact_raw(self, raw: np.ndarray) -> np.ndarray:
        """Drops channels of a file that `decode` never reads (packing stores less). Idempotent."""
        return raw

    def raw_valid(self, raw: np.ndarray) -> np.ndarray | None:
        """Valid pixels of a raw file as ``bool [H, W]``, or None when every pixel is valid."""
        return None

    def decode(self, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """File contents → (value in units, valid mask). See the module docstring for shapes."""
        raise NotImplementedError

    def decode_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of a batch on any device: ``codes`` are a dense domain's compacted file codes as ``float32
        [B, C, H, W]`` (C: the channels `compact_raw` keeps); returns ``(value [B, C, H, W], mask bool [B, 1, H,
        W])``, equal to stacking `decode` per sample (`squad.data.device` decodes training batches with it). This
        default runs `decode` per sample on the CPU; the 13 Taskonomy tasks override it with batched arithmetic."""
        dtype = np.uint8 if self.bits == 8 else np.uint16
        out = []
        for c in codes.cpu():
            arr = c.permute(1, 2, 0).numpy().astype(dtype)
            out.append(self.decode(arr[..., 0] if arr.shape[2] == 1 else arr))
        return (torch.stack([v for v, _ in out]).to(codes.device),
                torch.stack([m for _, m in out]).to(codes.device))

    def filter_frame(self, value: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """Filters a decoded dense value ``[C, H, W]`` of the whole resized frame (the identity unless `frame_filter`).

        Args:
            value: the decoded value of the frame.
            valid: ``bool [1, H, W]`` pixels with data (geometry and the decode mask), or None when unknown; a
                filter must not carry invalid pixels' values into valid ones.
        """
        return value

    def filter_frames(self, value: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`filter_frame` of a batch ``[B, C, H, W]`` with ``valid`` ``bool [B, 1, H, W]``, on any device (this
        default loops over the samples)."""
        return torch.stack([self.filter_frame(v, m) for v, m in zip(value, valid, strict=True)])

    def hflip(self, value: torch.Tensor) -> torch.Tensor:
        """Mirrors a decoded dense value ``[..., H, W]`` left-right (vector fields override this)."""
        return torch.flip(value, dims=(-1,))

    # ------------------------------------------------------------------------------------------ learning
    def target(self, value: torch.Tensor) -> torch.Tensor:
        """Value in units → what the head regresses (head space)."""
        return value

    def to_units(self, pred: torch.Tensor) -> torch.Tensor:
        """Head space → units (inverse of `target`)."""
        return pred

    def loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked training loss, a scalar; an all-masked batch gives 0 (with a gradient path), never NaN."""
        raise NotImplementedError

    def metric_sums(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Additive statistics (float64 scalars) of a batch; sum them over batches and ranks, then `metrics`."""
        raise NotImplementedError

    def metrics(self, sums: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Final metrics from summed statistics."""
        raise NotImplementedError

    def lower_is_better_for(self, metric: str) -> bool:
        """Direction of one metric of this task: True for errors, False for names in `higher_is_better`."""
        if metric == self.primary_metric:
            return self.lower_is_better  # a plug-in task may still declare `lower_is_better` alone
        return metric not in self.higher_is_better

    @property
    def lower_is_better(self) -> bool:
        """Direction of `primary_metric`, derived from `higher_is_better`."""
        return self.primary_metric not in self.higher_is_better

    # ------------------------------------------------------------------------------------------- helpers
    def check_batch(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Checks shapes of a batch and returns the mask as ``bool [B, 1, H, W]`` (dense) or ``bool [B]``."""
        if self.head_kind == "class":
            if pred.dim() != 2 or pred.shape[1] != self.channels or target.shape != pred.shape:
                raise ValueError(f"task {self.name}: expected pred and target [B, {self.channels}], got "
                                 f"pred {tuple(pred.shape)}, target {tuple(target.shape)}")
            b = pred.shape[0]
            if b == 0:  # a task that drew no image in this batch (train.tasks_per_image): [0] or [0, 1]
                mask = mask.reshape(0, mask.shape[-1] if mask.dim() > 1 else 1)
            else:
                mask = mask.reshape(b, -1)
            if mask.shape[1] != 1:
                raise ValueError(f"task {self.name}: expected mask [B] or [B, 1], got {tuple(mask.shape)}")
            return mask[:, 0].bool()
        if pred.dim() != 4 or pred.shape[1] != self.channels or target.shape != pred.shape:
            raise ValueError(f"task {self.name}: expected pred and target [B, {self.channels}, H, W] of equal "
                             f"shape, got pred {tuple(pred.shape)}, target {tuple(target.shape)}")
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        b, _, h, w = pred.shape
        if mask.shape != (b, 1, h, w):
            raise ValueError(f"task {self.name}: expected mask [B, 1, H, W] = {(b, 1, h, w)}, got {tuple(mask.shape)}")
        return mask.bool()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, head_kind={self.head_kind!r}, channels={self.channels}, "
                f"primary_metric={self.primary_metric!r})")


def masked_mean(err: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``err [B, C, H, W]`` over valid pixels (mask ``[B, 1, H, W]``) and channels.

    Masked entries are replaced (not multiplied) by zero, so NaN/inf there cannot leak; an all-masked batch
    gives exactly 0 with a gradient path to `err`.
    """
    m = mask.expand_as(err)
    total = torch.where(m, err, torch.zeros((), dtype=err.dtype, device=err.device)).sum()
    count = m.sum().clamp_min(1).to(err.dtype)
    return total / count


def as_f64(x: torch.Tensor | float | int) -> torch.Tensor:
    """A float64 scalar tensor (keeps the device of tensors)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).reshape(())
    return torch.tensor(float(x), dtype=torch.float64)


def ratio(sums: dict[str, torch.Tensor | float], num: str, den: str) -> float:
    """``sums[num] / sums[den]`` as a float, NaN when the count is zero (nothing valid was seen)."""
    d = float(sums[den])
    return float(sums[num]) / d if d > 0 else float("nan")


def integer_image(raw: np.ndarray, bits: int, task: str) -> np.ndarray:
    """Checks that a decoded PNG has the bit depth a task expects and returns it unchanged.

    Raises:
        DecodeError: if the array is not an integer image of the right depth.
    """
    if not np.issubdtype(raw.dtype, np.integer):
        raise DecodeError(f"task {task}: expected an integer {bits}-bit image, got dtype {raw.dtype}")
    if bits == 16 and raw.dtype == np.uint8:
        raise DecodeError(f"task {task}: expected a 16-bit image, got an 8-bit one")
    if bits == 8 and raw.dtype != np.uint8:
        if raw.size and int(raw.max()) > 255:
            raise DecodeError(f"task {task}: expected an 8-bit image, got values up to {int(raw.max())}")
    if raw.ndim not in (2, 3):
        raise DecodeError(f"task {task}: expected an image [H, W] or [H, W, C], got shape {raw.shape}")
    return raw
