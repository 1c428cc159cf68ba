"""Shared machinery of the PASCAL-Context and NYUD-v2 readers: non-square images, one geometry for every target.

Taskonomy's images are square, so its pipeline (`squad.data.transforms`) only resizes and crops. These benchmarks
store images of any aspect ratio (PASCAL about 500 × 375, NYUD 425 × 560), so `BenchmarkPipeline` makes them square:

* evaluation (deterministic): resize so the longer side is ``image_size`` (aspect kept), then pad to the square,
  centred. Padded pixels are zero in rgb and masked (False) in every target, so every image pixel is scored at that
  resolution and nothing is cropped away — what InvPT's padded evaluation does, at the model's size;
* training: the same fit times a random factor in ``scale_range`` (default 0.75–1.5), then a random crop where the
  scaled image is larger than the square and a random placement (padding masked) where it is smaller, then a
  horizontal flip with p = 0.5 (`Task.hflip`: normals' x negated). One draw serves rgb and every target, so they
  stay aligned. The public loaders' random scaling and flip, without their ±20° rotation (ASTMT / MTI-Net stretch
  every image to 512 × 512 instead; InvPT crops and pads at the original scale).

A task with a `Task.frame_filter` (the edge task's thinning) is decoded and filtered on the whole scaled frame,
then cut, so its values do not depend on where the crop falls. Resizing follows each task's ``resample``:
``"nearest"`` for label maps (ids never blend), ``"bilinear"`` (antialiased) mask-aware for the others — invalid
pixels (`Task.raw_valid`, e.g. normals' fill) never blend into valid ones, and an output pixel less than half
covered by valid pixels holds `Task.raw_fill`; float arrays (NYUD depth in metres) are resized the same way in
float, with 0 as their invalid code.

`BenchmarkBase` is the Dataset: it shares `squad.data.samples.SampleDataset`'s sample dict, collate, accounting
of corrupt / wrong-size / missing files (`squad.data.accounting`), substitution in training and omission in
evaluation. The packer (`squad.data.offline.pack`) stores the output of `BenchmarkPipeline.prepare_raw` (the fit to the
packed size), so shards read back at that size give exactly the tree reader's samples.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from scipy import ndimage

from squad.data.samples import CorruptFileError, EmptyDatasetError, SampleDataset
from squad.data.transforms import MIN_COVERAGE, WrongSizeError, _resize_nearest, compact_rgb, decode_rgb, resize_raw
from squad.tasks import (
    NYUD_TASKS,
    PASCAL_TASKS,
    TASK_NAMES,
    DecodeError,
    Task,
    TaskOptions,
    get_task,
    resolve_task_names,
)

logger = logging.getLogger(__name__)

DATASETS = ("taskonomy", "pascal_context", "nyud")
DEFAULT_SCALE_RANGE = (0.75, 1.5)


class DatasetTaskError(ValueError):
    """A task that the chosen dataset does not provide."""


# ------------------------------------------------------------------------------------------------ files
def read_image(path: str | Path) -> np.ndarray:
    """An RGB image file (JPEG / PNG, any mode) as ``uint8 [H, W, 3]``.

    Raises:
        CorruptFileError: truncated or undecodable file.
        FileNotFoundError: the file does not exist.
    """
    try:
        with Image.open(path) as im:
            im.load()
            return np.array(im.convert("RGB"))
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error) as e:
        raise CorruptFileError(f"corrupt file {path}: {e}") from e


def read_png(path: str | Path) -> np.ndarray:
    """An 8-bit PNG as stored (palette images give their indices): ``uint8 [H, W]`` or ``[H, W, C]``.

    Raises:
        CorruptFileError: truncated or undecodable file, or not 8-bit.
    """
    try:
        with Image.open(path) as im:
            im.load()
            arr = np.array(im)
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error) as e:
        raise CorruptFileError(f"corrupt file {path}: {e}") from e
    if arr.dtype == bool:
        arr = arr.astype(np.uint8)
    if arr.dtype != np.uint8:
        raise CorruptFileError(f"{path}: expected an 8-bit image, got dtype {arr.dtype}")
    return arr


def read_npy(path: str | Path) -> np.ndarray:
    """A ``.npy`` array (no pickles).

    Raises:
        CorruptFileError: bad header or truncated data.
    """
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise CorruptFileError(f"corrupt file {path}: {e}") from e


def read_mat(path: str | Path) -> dict[str, Any]:
    """A MATLAB ``.mat`` file (v5/v7) as scipy.io.loadmat gives it.

    Raises:
        CorruptFileError: not a readable .mat file.
    """
    from scipy.io import loadmat  # scipy.io pulls in a lot; only the benchmarks need it

    try:
        return loadmat(str(path))
    except FileNotFoundError:
        raise
    except Exception as e:  # loadmat raises many types (ValueError, TypeError, MatReadError, struct.error ...)
        raise CorruptFileError(f"corrupt file {path}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------------------------ edges
def _thin_luts() -> tuple[np.ndarray, np.ndarray]:
    """Deletion tables of the two sub-iterations of Guo & Hall's thinning (algorithm A1; MATLAB's
    ``bwmorph(..., 'thin', Inf)`` and scikit-image's ``thin``), indexed by the 8-neighbour code of `_NEIGHBOURS`."""

    def bits(n: int) -> list[bool]:
        return [bool(n >> i & 1) for i in range(8)]  # 0 E, 1 NE, 2 N, 3 NW, 4 W, 5 SW, 6 S, 7 SE

    def g1(b: list[bool]) -> bool:  # exactly one 8-connected 0→1 transition around the pixel
        return sum(1 for i in (0, 2, 4, 6) if not b[i] and (b[i + 1] or b[(i + 2) % 8])) == 1

    def g2(b: list[bool]) -> bool:
        n1 = sum(1 for k in (1, 3, 5, 7) if b[k] or b[k - 1])
        n2 = sum(1 for k in (1, 3, 5, 7) if b[k] or b[(k + 1) % 8])
        return min(n1, n2) in (2, 3)

    def g3(b: list[bool]) -> bool:
        return not ((b[1] or b[2] or not b[7]) and b[0])

    def g3p(b: list[bool]) -> bool:
        return not ((b[5] or b[6] or not b[3]) and b[4])

    first = np.array([g1(b) and g2(b) and g3(b) for b in map(bits, range(256))])
    second = np.array([g1(b) and g2(b) and g3p(b) for b in map(bits, range(256))])
    return first, second


_NEIGHBOURS = np.array([[8, 4, 2], [16, 0, 1], [32, 64, 128]], dtype=np.int32)
_THIN_LUTS = _thin_luts()


def thin(mask: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Morphological thinning to one-pixel-wide lines (Guo & Hall; the ``thin`` of scikit-image and MATLAB).

    Args:
        mask: ``[H, W]`` array; nonzero is foreground.
        max_iter: at most this many passes (None: until nothing changes).

    Returns:
        ``bool [H, W]``.
    """
    skel = np.ascontiguousarray(mask != 0).astype(np.uint8)
    n = 0
    while max_iter is None or n < max_iter:
        before = int(skel.sum())
        for lut in _THIN_LUTS:
            code = ndimage.correlate(skel.astype(np.int32), _NEIGHBOURS, mode="constant")
            skel[lut[code] & (skel == 1)] = 0
        n += 1
        if int(skel.sum()) == before:
            break
    return skel.astype(bool)


def label_edges(labels: np.ndarray) -> np.ndarray:
    """Semantic edges of a label map as ASTMT derives PASCAL-Context's: the 4-neighbour Laplacian (OpenCV's
    ``Laplacian(..., ksize=1)``, reflect-101 borders) is nonzero, then `thin`.

    Args:
        labels: integer label map ``[H, W]``.

    Returns:
        ``uint8 [H, W]`` in {0, 1}.
    """
    lab = np.asarray(labels, dtype=np.float64)
    if lab.ndim != 2:
        raise DecodeError(f"edges: expected a label map [H, W], got shape {lab.shape}")
    p = np.pad(lab, 1, mode="reflect") if min(lab.shape) > 1 else np.pad(lab, 1, mode="edge")
    lap = p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * lab
    return thin(lap != 0).astype(np.uint8)


# ----------------------------------------------------------------------------------------------- resize
def _resize_float(raw: np.ndarray, size: tuple[int, int], valid: np.ndarray | None, fill: float) -> np.ndarray:
    """Mask-aware antialiased bilinear resize of a float array ``[H, W]`` / ``[H, W, C]`` (as `resize_raw`)."""
    squeeze = raw.ndim == 2
    planes = (raw[None] if squeeze else raw.transpose(2, 0, 1)).astype(np.float32)
    if valid is not None and valid.all():
        valid = None
    if valid is not None:
        planes = planes * valid[None]
    x = torch.from_numpy(np.ascontiguousarray(planes))[None]
    y = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    if valid is not None:
        m = torch.from_numpy(np.ascontiguousarray(valid)).to(torch.float32)[None, None]
        den = F.interpolate(m, size=size, mode="bilinear", antialias=True, align_corners=False)
        y = torch.where(den >= MIN_COVERAGE, y / den.clamp_min(1e-6), torch.full((), float(fill)))
    out = y[0, 0] if squeeze else y[0].permute(1, 2, 0)
    return np.ascontiguousarray(out.numpy()).astype(raw.dtype, copy=False)


def resize_task_raw(task: Task, raw: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Resizes a task's raw array to `size` = (h, w) the way its ``resample`` says (module docstring)."""
    if raw.shape[:2] == tuple(size):
        return raw
    if task.resample == "nearest":
        return _resize_nearest(raw, size, None)
    valid = task.raw_valid(raw)
    if np.issubdtype(raw.dtype, np.floating):
        if valid is None:
            valid = raw > 0 if raw.ndim == 2 else None  # float maps (depth): 0 = no measurement
        return _resize_float(raw, size, valid, float(task.raw_fill))
    return resize_raw(raw, size, "bilinear", valid, int(task.raw_fill))


def fit_size(hw: tuple[int, int], side: int) -> tuple[int, int]:
    """Size with the longer side `side` and the aspect of `hw` kept (each side at least 1)."""
    h, w = hw
    scale = side / max(h, w)
    return max(1, round(h * scale)), max(1, round(w * scale))


# --------------------------------------------------------------------------------------------- pipeline
class BenchmarkPipeline:
    """Turns the raw arrays of one sample into ``(rgb, targets, masks)`` (module docstring).

    Args:
        tasks: the tasks (names or `Task` objects); their ``domain`` keys the raw arrays.
        image_size: output height = width; None keeps the stored size (no scaling, no padding; flip only).
        augment: random scale, crop / placement and flip; otherwise the centred fit.
        scale_range: (low, high) of the random scale factor relative to the fit (training only).
    """

    def __init__(self, tasks: Sequence[str | Task], image_size: int | None = None, augment: bool = False,
                 scale_range: tuple[float, float] = DEFAULT_SCALE_RANGE) -> None:
        self.tasks = [t if isinstance(t, Task) else get_task(t) for t in tasks]
        if image_size is not None and image_size < 1:
            raise ValueError(f"image_size must be >= 1, got {image_size}")
        lo, hi = (float(s) for s in scale_range)
        if not 0 < lo <= hi:
            raise ValueError(f"scale_range must be (low, high) with 0 < low <= high, got {scale_range}")
        self.image_size = image_size
        self.resize = image_size
        self.augment = augment
        self.scale_range = (lo, hi)
        self._by_domain = {t.domain: t for t in self.tasks}

    @property
    def domains(self) -> list[str]:
        """Domains read per sample: rgb and the tasks'."""
        return ["rgb", *(t.domain for t in self.tasks)]

    def task(self, domain: str) -> Task:
        """This pipeline's task for a domain."""
        return self._by_domain.get(domain) or get_task(domain)

    def prepare_raw(self, domain: str, raw: np.ndarray, size: int | None = None) -> np.ndarray:
        """The stored form of one raw array at a packed size: rgb compacted to ``uint8 [H, W, 3]``, then every
        array resized so its longer side is `size` (aspect kept; None: unchanged)."""
        if domain == "rgb":
            raw = compact_rgb(raw)
            return raw if size is None else resize_raw(raw, fit_size(raw.shape[:2], size), "bilinear")
        task = self.task(domain)
        raw = task.compact_raw(raw)
        return raw if size is None else resize_task_raw(task, raw, fit_size(raw.shape[:2], size))

    def __call__(self, raws: dict[str, np.ndarray | None], rng: np.random.Generator | None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Builds one sample.

        Args:
            raws: ``{domain: raw array or None}``; None marks a missing file (zeros, mask False). ``"rgb"`` required.
            rng: draws the scale, placement and flip when augmenting (ignored otherwise).

        Raises:
            WrongSizeError: a target whose size differs from the rgb image's (carries the domain).
            DecodeError: a raw array that does not decode (``domain`` set).
        """
        try:
            rgb_raw = compact_rgb(raws["rgb"])
        except DecodeError as e:
            e.domain = "rgb"
            raise
        hw = rgb_raw.shape[:2]
        rng = rng if self.augment else None
        if self.image_size is None:
            scaled, out = hw, hw
        else:
            factor = 1.0 if rng is None else float(rng.uniform(*self.scale_range))
            scaled, out = fit_size(hw, round(self.image_size * factor)), (self.image_size, self.image_size)
        boxes = [self._place(n, o, rng) for n, o in zip(scaled, out, strict=True)]
        flip = bool(rng is not None and rng.random() < 0.5)
        (sy, dy, ly), (sx, dx, lx) = boxes

        def window(a: np.ndarray) -> np.ndarray:
            return a[sy: sy + ly, sx: sx + lx]

        def canvas(value: torch.Tensor, fill: bool | float) -> torch.Tensor:
            c = torch.full((value.shape[0], *out), fill, dtype=value.dtype)
            c[:, dy: dy + ly, dx: dx + lx] = value
            return c

        rgb = canvas(decode_rgb(window(resize_raw(rgb_raw, scaled, "bilinear"))), 0.0)
        if flip:
            rgb = torch.flip(rgb, dims=(-1,))
        targets: dict[str, torch.Tensor] = {}
        masks: dict[str, torch.Tensor] = {}
        for task in self.tasks:
            raw = raws.get(task.domain)
            if raw is None:
                targets[task.name] = torch.zeros(task.channels, *out)
                masks[task.name] = torch.zeros(1, *out, dtype=torch.bool)
                continue
            try:
                raw = task.compact_raw(raw)
                if tuple(raw.shape[:2]) != tuple(hw):
                    raise WrongSizeError(f"{task.domain}: size {raw.shape[0]}×{raw.shape[1]} differs from the rgb "
                                         f"image's {hw[0]}×{hw[1]}", task.domain)
                resized = resize_task_raw(task, raw, scaled)
                if task.frame_filter:  # decoded and filtered on the whole frame, then cut (as squad.data.transforms)
                    value, mask = task.decode(resized)
                    value = task.filter_frame(value, mask)
                    value, mask = value[..., sy: sy + ly, sx: sx + lx], mask[..., sy: sy + ly, sx: sx + lx]
                else:
                    value, mask = task.decode(window(resized))
            except DecodeError as e:
                e.domain = task.domain
                raise
            value, mask = canvas(value, 0), canvas(mask, False)
            if flip:
                value, mask = task.hflip(value), torch.flip(mask, dims=(-1,))
            targets[task.name], masks[task.name] = value, mask
        return rgb, targets, masks

    @staticmethod
    def _place(n: int, out: int, rng: np.random.Generator | None) -> tuple[int, int, int]:
        """(source offset, destination offset, length) along one axis: crop when `n` > `out`, else pad."""
        if n >= out:
            src = (n - out) // 2 if rng is None else int(rng.integers(0, n - out + 1))
            return src, 0, out
        dst = (out - n) // 2 if rng is None else int(rng.integers(0, out - n + 1))
        return 0, dst, n


# ----------------------------------------------------------------------------------------------- datasets
def dataset_tasks(dataset: str) -> tuple[str, ...]:
    """The task names a dataset provides (``taskonomy``: the 13 Taskonomy tasks).

    Raises:
        ValueError: an unknown dataset name.
    """
    if dataset == "pascal_context":
        return PASCAL_TASKS
    if dataset == "nyud":
        return NYUD_TASKS
    if dataset == "taskonomy":
        return tuple(TASK_NAMES)
    raise ValueError(f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)}")


def check_dataset_tasks(dataset: str, tasks: str | Sequence[str]) -> list[str]:
    """Canonical task names for `dataset` (``"all"`` = all of its tasks).

    Raises:
        DatasetTaskError: a task the dataset does not provide (the message lists the dataset's tasks).
    """
    allowed = dataset_tasks(dataset)
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    if any(n.strip() == "all" for n in names):
        return list(allowed)
    try:
        resolved = resolve_task_names(names)
    except (KeyError, ValueError) as e:
        raise DatasetTaskError(f"{e}; dataset {dataset} provides: {', '.join(allowed)}") from e
    bad = [n for n in resolved if n not in allowed]
    if bad:
        raise DatasetTaskError(f"task(s) {', '.join(bad)} are not in dataset {dataset}; it provides: "
                               f"{', '.join(allowed)}")
    return resolved


def read_split_list(path: Path) -> list[str]:
    """Ids of a split list (one per line; blank lines and surrounding spaces ignored)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


class BenchmarkBase(SampleDataset):
    """A PASCAL-Context or NYUD-v2 folder tree as a Dataset (the sample contract of `SampleDataset`).

    Subclasses set `dataset`, `tasks_provided`, `split_dir` and implement `_sources` (the files a task reads, for
    indexing) and `_read_task`.

    Args:
        root: the dataset folder.
        tasks: task names (or ``"all"``: every task of the dataset).
        split: ``"train"``, ``"val"`` or a list of them (split lists ``{split}.txt``); ``"all"`` = train + val.
        image_size: output side (None: stored size, for inspection only — batches need one size).
        augment: random scale, crop and flip (training); otherwise the deterministic centred fit.
        missing: ``"skip"`` leaves out samples lacking a task's file; ``"mask"`` keeps them masked.
        seed: augmentation seed.
        scale_range: the training scale factor's range.
        task_options: the options of the model the data is for (``model.task_options``, e.g. edge's
            ``max_dist``), as in `squad.data.taskonomy.TaskonomyDataset`.
        **ignored: Taskonomy-only options (``resize``, ``geometry_mask``, ``split_csv``, ``buildings``) are
            accepted and ignored, so callers can pass one set of options.

    Raises:
        FileNotFoundError: `root` or its split list is missing.
        DatasetTaskError: a task the dataset does not provide.
        EmptyDatasetError: the split selects no samples.
    """

    dataset = "benchmark"
    split_dir = "."
    splits = ("train", "val")

    def __init__(self, root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                 image_size: int | None = None, augment: bool = False, missing: Literal["skip", "mask"] = "skip",
                 seed: int = 0, scale_range: tuple[float, float] = DEFAULT_SCALE_RANGE,
                 task_options: TaskOptions | None = None, **ignored: Any) -> None:
        names = check_dataset_tasks(self.dataset, tasks)
        unknown = set(ignored) - {"resize", "geometry_mask", "split_csv", "buildings"}
        if unknown:
            raise TypeError(f"{type(self).__name__}: unexpected options {sorted(unknown)}")
        pipeline = functools.partial(BenchmarkPipeline, image_size=image_size, augment=augment,
                                     scale_range=scale_range)
        super().__init__(names, pipeline, missing, seed, task_options)
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.dataset} root {self.root} does not exist. {self.hint()}")
        self.split = split
        self.ids_in_split = self._split_ids(split)
        self._cache: tuple[int, str, Any] | None = None
        self._index()
        if len(self) == 0:
            raise EmptyDatasetError(f"no samples in {self.root} for split {split!r} with tasks {self.tasks} "
                                    f"(missing={self.missing!r})")

    def hint(self) -> str:
        """How to get data for this dataset (ends the missing-data errors)."""
        return (f"Make a small synthetic one with: python tools/make_data.py synthetic --dataset {self.dataset} "
                f"--out {self.root}, or see docs/data.md for the real data")

    def _split_ids(self, split: str | Sequence[str]) -> list[str]:
        chosen = [split] if isinstance(split, str) else list(split)
        if "all" in chosen:
            chosen = list(self.splits)
        bad = [s for s in chosen if s not in self.splits]
        if bad:
            raise ValueError(f"unknown split {bad} for {self.dataset}; use {', '.join(self.splits)}, all or a list")
        out: list[str] = []
        for s in chosen:
            path = self.root / self.split_dir / f"{s}.txt"
            if not path.is_file():
                raise FileNotFoundError(f"{self.dataset}: split list {path} is missing. {self.hint()}")
            out += read_split_list(path)
        return list(dict.fromkeys(out))

    # ------------------------------------------------------------------------------------ indexing
    def _sources(self, domain: str, sample_id: str) -> list[Path | None]:
        """The files one domain of one sample needs (None: none of the accepted names exists)."""
        raise NotImplementedError

    def _index(self) -> None:
        listing: dict[Path, set[str]] = {}

        def exists(p: Path | None) -> bool:
            if p is None:
                return False
            if p.parent not in listing:
                try:
                    with os.scandir(p.parent) as it:
                        listing[p.parent] = {e.name for e in it}
                except (FileNotFoundError, NotADirectoryError):
                    listing[p.parent] = set()
            return p.name in listing[p.parent]

        self._exists = exists
        required = sum(1 << k for k, d in enumerate(self.domains) if d in self.required)
        ids, present, examples = [], [], []
        missing_files = unindexed = 0
        for sid in self.ids_in_split:
            bits = 0
            for k, d in enumerate(self.domains):
                if all(exists(p) for p in self._sources(d, sid)):
                    bits |= 1 << k
            lacking = [d for k, d in enumerate(self.domains) if k and not bits >> k & 1]
            if lacking:
                missing_files += len(lacking)
                if len(examples) < 3:
                    examples.append(f"{sid} ({', '.join(lacking)})")
            if not bits & 1:  # no image: the sample cannot be used whatever `missing` says
                missing_files += 1
                unindexed += 1
                if len(examples) < 3:
                    examples.append(f"{sid} (rgb)")
                continue
            if bits & required == required:
                ids.append(sid)
                present.append(bits)
            else:
                unindexed += 1
        self._exists = None
        self._ids = np.array(ids, dtype=str)
        self._present = np.array(present, dtype=np.int64)
        self._indexed(missing_files, unindexed, examples)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None
        return state

    # ------------------------------------------------------------------------------------- reading
    def _read(self, index: int, domain: str) -> np.ndarray:
        return self._read_task(str(self._ids[index]), domain)

    def _read_task(self, sample_id: str, domain: str) -> np.ndarray:
        raise NotImplementedError

    def _cached(self, sample_id: str, key: str, load: Any) -> Any:
        """One file read per sample even when two domains need it (the last one is kept)."""
        if self._cache is not None and self._cache[:2] == (sample_id, key):
            return self._cache[2]
        value = load()
        self._cache = (sample_id, key, value)
        return value

    def path(self, index: int, domain: str) -> Path:
        """The main file of one domain of one sample."""
        sources = self._sources(domain, str(self._ids[index]))
        return sources[0] if sources and sources[0] is not None else self.root


def first_existing(folder: Path, stem: str, exts: Sequence[str]) -> Path | None:
    """``folder/stem+ext`` for the first ext in `exts` that exists, else None."""
    for ext in exts:
        p = folder / f"{stem}{ext}"
        if p.is_file():
            return p
    return None


def detect_layout(root: str | Path) -> str:
    """Which dataset a folder's layout is (``ImageSets/Context`` + ``JPEGImages`` → pascal_context; ``gt_sets`` +
    ``images`` → nyud; else taskonomy). `squad.data.shards.detect_dataset` also reads a shard index's record."""
    root = Path(root)
    if (root / "ImageSets" / "Context").is_dir() and (root / "JPEGImages").is_dir():
        return "pascal_context"
    if (root / "gt_sets").is_dir() and (root / "images").is_dir():
        return "nyud"
    return "taskonomy"
    if (root / "ImageSets" / "Context").is_dir() and (root / "JPEGImages").is_dir():
        return "pascal_context"
    if (root / "gt_sets").is_dir() and (root / "images").is_dir():
        return "nyud"
    return "taskonomy"
