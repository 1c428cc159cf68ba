"""HDF5 shards of a Taskonomy tree: the format and its reader (`ShardDataset`); `squad.data.offline.pack` writes them.

A shard folder holds ``shards.json`` (the index: format, stored size, domains, shards per split) and files
``{split}_{k:05d}.h5``. Each shard has, for N samples:

* one dataset per domain, ``[N, H, W]`` / ``[N, H, W, C]`` in the file's own dtype (uint8/uint16), or ``[N, C]``
  float32 for class vectors; chunked one sample per chunk so a random read touches one chunk per domain;
* ``present`` ``bool [N, D]`` (a domain the sample lacks or whose file was corrupt is False) and ``id`` (str).

What is stored is the raw file after the reader's own steps 1–2 (`squad.data.transforms`: compact, resize to
`image_size` in the encoded domain), so `ShardDataset` asking for the packed size yields exactly the samples
`TaskonomyDataset` yields at that size. The stored arrays come from the mask-aware resize: pixels with too little
geometry hold their domain's fill and depth_zbuffer's 65535, so the geometry mask read back (with
``geometry_mask=True``, the default) masks them in every geometric domain; reading at another size resizes again,
mask-aware with the stored depth_zbuffer. Files are opened lazily in each process (DataLoader workers open their
own handles; a handle never crosses a fork).
"""

from __future__ import annotations

import functools
import json
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np

from squad.data.benchmark import DEFAULT_SCALE_RANGE, BenchmarkPipeline, check_dataset_tasks, detect_layout
from squad.data.samples import CorruptFileError, EmptyDatasetError, Pipeline, SampleDataset
from squad.data.taskonomy import make_data_hint
from squad.data.transforms import SamplePipeline
from squad.tasks import Task, TaskOptions

logger = logging.getLogger(__name__)

INDEX_NAME = "shards.json"
HW_KEY = "hw"  # benchmark shards: int32 [N, 2], the unpadded size of each sample's arrays
FORMAT = "squad-taskonomy-shards"
VERSION = 1
RUN_GAP = 4  # rows between two samples of a batch that one contiguous read takes in rather than two reads


def is_shard_root(root: str | Path) -> bool:
    """True when `root` holds a shard index (`INDEX_NAME`)."""
    return (Path(root) / INDEX_NAME).is_file()


def detect_dataset(root: str | Path) -> str:
    """Which dataset a folder holds: the ``dataset`` its shard index records (older indexes: taskonomy), else its
    layout (`squad.data.benchmark.detect_layout`)."""
    root = Path(root)
    if is_shard_root(root):
        try:
            return str(json.loads((root / INDEX_NAME).read_text()).get("dataset", "taskonomy"))
        except (OSError, ValueError):
            return "taskonomy"
    return detect_layout(root)


class ShardDataset(SampleDataset):
    """Taskonomy samples from HDF5 shards written by `pack_shards`; same sample format as `TaskonomyDataset`.

    Args:
        root: shard folder (holds ``shards.json``).
        tasks, augment, missing, geometry_mask, seed, task_options: as in `TaskonomyDataset`.
        split: ``"train"``, ``"val"``, ``"test"``, ``"all"`` or a list (shards packed without a CSV are ``"all"``).
        buildings: keep only samples of these buildings.
        image_size: output size; None keeps the packed size (then no resizing happens).
        resize: size before cropping `image_size`; None means `image_size`.
        pipeline: builds the sample pipeline from the tasks instead (the benchmark shards'); None: Taskonomy's
            `squad.data.transforms.SamplePipeline` with the options above.

    Raises:
        FileNotFoundError: no index in `root` (with a hint), or a requested domain was not packed.
        ValueError: wrong index format, or no samples in the split.
    """

    dataset = "taskonomy"

    def __init__(self, root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                 buildings: Sequence[str] | None = None, image_size: int | None = None, resize: int | None = None,
                 augment: bool = False, missing: Literal["skip", "mask"] = "skip", geometry_mask: bool = True,
                 seed: int = 0, task_options: TaskOptions | None = None,
                 pipeline: Callable[[list[Task]], Pipeline] | None = None) -> None:
        if pipeline is None:
            pipeline = functools.partial(SamplePipeline, image_size=image_size, resize=resize, augment=augment,
                                         geometry_mask=geometry_mask)
        super().__init__(tasks, pipeline, missing, seed, task_options)
        self.root = Path(root)
        path = self.root / INDEX_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no shard index {path}. Pack a tree with: python tools/make_data.py pack "
                                    f"--src ROOT --out {self.root} --image-size 256. {make_data_hint(self.root)}")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path}: not a squad shard index (format {self.index.get('format')!r})")
        stored = self.index.get("dataset", "taskonomy")
        if stored != self.dataset:
            raise ValueError(f"{path}: these shards hold {stored}, not {self.dataset} (read them with "
                             f"build_dataset(..., dataset={stored!r}))")
        packed = self.index["domains"]
        lacking = [d for d in self.required if d not in packed]
        if lacking:
            raise FileNotFoundError(f"{self.root}: domains {lacking} were not packed (packed: {packed}); use "
                                    f"missing='mask' to train without them")
        splits = [split] if isinstance(split, str) else list(split)
        self.split = split
        self.files = [s["file"] for s in self.index["shards"] if "all" in splits or s["split"] in splits]
        self._index(packed, set(buildings) if buildings is not None else None)
        if len(self) == 0:
            have = sorted({s["split"] for s in self.index["shards"]})
            lost = (f"; unreadable shard files: {', '.join(self.unreadable_files)} ({self.lost_samples} samples)"
                    if self.unreadable_files else "")
            raise EmptyDatasetError(f"no samples in {self.root} for split {split!r} (packed splits: {have}) with tasks "
                                    f"{self.tasks} and missing={self.missing!r}{lost}")
        self._handles: dict[int, h5py.File] = {}
        self._dsets: dict[tuple[int, str], h5py.Dataset] = {}
        self._maps: dict[tuple[int, str], Any] = {}  # `_chunks`
        self._files: dict[int, np.ndarray] = {}  # shard files mapped into memory
        self._runs: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = {}  # `_prefetch`
        self._pid = -1

    def _index(self, packed: list[str], buildings: set[str] | None) -> None:
        cols = [packed.index(d) if d in packed else -1 for d in self.domains]
        required = sum(1 << k for k, d in enumerate(self.domains) if d in self.required)
        counted = sum(1 << k for k, d in enumerate(self.domains) if d in self.task_domains and d in packed)
        ids, present, loc = [], [], []
        missing_files, unindexed, examples = 0, 0, []
        sizes = {s["file"]: int(s.get("n", 0)) for s in self.index["shards"]}
        for fi, name in enumerate(self.files):
            try:
                with h5py.File(self.root / name, "r") as f:
                    sid = f["id"].asstr()[...]
                    pres = f["present"][...]
            except (OSError, KeyError, ValueError) as e:  # truncated, not HDF5, or without squad's datasets
                self._unreadable(name, sizes.get(name, 0), e)
                continue
            bits = np.zeros(len(sid), dtype=np.int64)
            for k, c in enumerate(cols):
                if c >= 0:
                    bits |= pres[:, c].astype(np.int64) << k
            chosen = np.ones(len(sid), dtype=bool)
            if buildings is not None:
                chosen = np.array([s.split("/", 1)[0] in buildings for s in sid], dtype=bool)
            lacking = (counted & ~bits) * chosen  # a domain stored as absent: missing, or bad when packed
            if lacking.any():
                missing_files += int(sum(int(v).bit_count() for v in lacking[lacking != 0]))
                examples += [f"{name}[{r}] {sid[r]}" for r in np.flatnonzero(lacking)[: 3 - len(examples)]]
            keep = chosen & ((bits & required) == required)
            unindexed += int((chosen & ~keep).sum())
            rows = np.nonzero(keep)[0]
            ids.append(sid[rows])
            present.append(bits[rows])
            loc.append(np.stack([np.full_like(rows, fi), rows], axis=1))
        self._ids = np.concatenate(ids).astype(str) if ids else np.array([], dtype=str)
        self._present = np.concatenate(present) if present else np.zeros(0, dtype=np.int64)
        self._loc = np.concatenate(loc) if loc else np.zeros((0, 2), dtype=np.int64)
        self._indexed(missing_files, unindexed, examples)

    def _unreadable(self, name: str, samples: int, error: BaseException) -> None:
        """A shard file that cannot be opened: named in a warning, counted as a corrupt file, its samples lost."""
        self.unreadable_files.append(name)
        self.lost_samples += samples
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        logger.warning("%s: unreadable shard file %s (%s): its %d samples are skipped", self.root,
                       self.root / name, reason[:300], samples)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_handles"], state["_dsets"], state["_pid"], state["_runs"] = {}, {}, -1, {}
        state["_maps"], state["_files"] = {}, {}
        return state

    def _dataset(self, fi: int, domain: str) -> h5py.Dataset:
        if self._pid != os.getpid():  # first use in this process (or after a fork): never reuse a parent's handle
            self._handles, self._dsets, self._maps, self._files = {}, {}, {}, {}
            self._pid = os.getpid()
        key = (fi, domain)
        if key not in self._dsets:
            if fi not in self._handles:
                self._handles[fi] = h5py.File(self.root / self.files[fi], "r")
            self._dsets[key] = self._handles[fi][domain]
        return self._dsets[key]

    def _describe(self, index: int, domain: str) -> str:
        fi, row = self._loc[index]
        return f"{self.files[fi]}[{row}] {self._ids[index]} ({domain})"

    def _chunks(self, fi: int, domain: str) -> tuple[np.ndarray, np.ndarray, np.dtype, tuple[int, ...], int] | None:
        """Where each sample's chunk of one domain lies in its shard file, for reads without a copy: ``(the file's
        bytes as a memory map, byte offset per row, dtype, sample shape, bytes per sample)``; None when the dataset's
        chunks are not one raw sample each (compressed or filtered shards are read through h5py)."""
        key = (fi, domain)
        if key not in self._maps:
            self._maps[key] = None
            dset = self._dataset(fi, domain)
            plain = (dset.chunks is not None and dset.chunks == (1, *dset.shape[1:]) and dset.compression is None
                     and not dset.shuffle and not dset.fletcher32 and dset.scaleoffset is None)
            if plain and len(dset):
                offsets = np.full(len(dset), -1, dtype=np.int64)

                def found(info) -> None:
                    offsets[info.chunk_offset[0]] = info.byte_offset

                try:
                    dset.id.chunk_iter(found)
                except (AttributeError, RuntimeError, OSError):  # an HDF5 older than 1.12.3: h5py reads
                    offsets[:] = -1
                if (offsets >= 0).all():
                    if fi not in self._files:
                        with open(self.root / self.files[fi], "rb") as f:
                            self._files[fi] = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ),
                                                            dtype=np.uint8)
                    shape = tuple(dset.shape[1:])
                    self._maps[key] = (self._files[fi], offsets, dset.dtype, shape,
                                       dset.dtype.itemsize * int(np.prod(shape)))
        return self._maps[key]

    def _prefetch(self, indices: Sequence[int]) -> None:
        """Reads the rows of a batch as runs: neighbouring rows of one shard (gaps up to `RUN_GAP` rows read
        through) are one contiguous read per domain, which `_read` then serves; an empty `indices` drops them. A
        run that does not read is left to `_read` (which accounts for the bad file)."""
        self._runs: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = {}
        if not len(indices):
            return
        loc = self._loc[np.asarray(indices, dtype=np.int64)]
        for fi in np.unique(loc[:, 0]):
            rows = np.unique(loc[loc[:, 0] == fi, 1])
            cuts = np.flatnonzero(np.diff(rows) > RUN_GAP + 1) + 1
            for run in np.split(rows, cuts):
                first, last = int(run[0]), int(run[-1]) + 1
                for domain in self.domains:
                    if self._chunks(int(fi), domain) is not None:
                        continue  # read in place by _read
                    try:
                        block = self._dataset(int(fi), domain)[first:last]
                    except (OSError, KeyError):
                        continue
                    self._runs.setdefault((int(fi), domain), []).append((first, block))

    def _read(self, index: int, domain: str) -> np.ndarray:
        fi, row = self._loc[index]
        for first, block in self._runs.get((int(fi), domain), ()):
            if 0 <= row - first < len(block):
                return block[row - first]
        try:
            if self.integer_batches and (where := self._chunks(int(fi), domain)) is not None:
                data, offsets, dtype, shape, nbytes = where
                start = int(offsets[row])
                return data[start: start + nbytes].view(dtype).reshape(shape)
            return self._dataset(int(fi), domain)[int(row)]
        except (OSError, KeyError, ValueError) as e:
            raise CorruptFileError(f"unreadable {self._describe(index, domain)}: {e}") from e


class BenchmarkShardDataset(ShardDataset):
    """PASCAL-Context / NYUD-v2 samples from shards written by `squad.data.offline.pack.pack_benchmark`.

    The stored arrays are the readers' fit to the packed size, zero-padded to a square; ``hw`` gives each sample's
    unpadded size, which `_read` cuts back out before `squad.data.benchmark.BenchmarkPipeline` runs — so reading at
    the packed size without augmentation yields exactly `PascalContextDataset` / `NYUDDataset`'s samples.

    Args:
        root: shard folder.
        tasks: task names of the packed dataset (``"all"``: every task it has).
        split, image_size, augment, missing, seed, scale_range: as in `squad.data.benchmark.BenchmarkBase`.
        **ignored: Taskonomy-only options, accepted and ignored.

    Raises:
        FileNotFoundError: no index, or a required task was not packed.
        squad.data.benchmark.DatasetTaskError: a task the dataset does not provide.
        ValueError: not a benchmark shard index.
    """

    def __init__(self, root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                 image_size: int | None = None, augment: bool = False, missing: Literal["skip", "mask"] = "skip",
                 seed: int = 0, scale_range: tuple[float, float] | None = None,
                 task_options: TaskOptions | None = None, **ignored: Any) -> None:
        unknown = set(ignored) - {"resize", "geometry_mask", "split_csv", "buildings"}
        if unknown:
            raise TypeError(f"BenchmarkShardDataset: unexpected options {sorted(unknown)}")
        path = Path(root) / INDEX_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no shard index {path}. Pack a tree with: python tools/make_data.py pack "
                                    f"--dataset pascal_context --src ROOT --out {root} --image-size 512")
        self.dataset = str(json.loads(path.read_text()).get("dataset", "taskonomy"))
        if self.dataset == "taskonomy":
            raise ValueError(f"{path}: these shards hold taskonomy; read them with ShardDataset")
        names = check_dataset_tasks(self.dataset, tasks)
        pipeline = functools.partial(BenchmarkPipeline, image_size=image_size, augment=augment,
                                     scale_range=scale_range or DEFAULT_SCALE_RANGE)
        super().__init__(root, names, split=split, missing=missing, seed=seed, task_options=task_options,
                         pipeline=pipeline)

    def _read(self, index: int, domain: str) -> np.ndarray:
        arr = super()._read(index, domain)
        fi, row = self._loc[index]
        try:
            h, w = (int(v) for v in self._dataset(int(fi), HW_KEY)[int(row)])
        except (OSError, KeyError) as e:
            raise CorruptFileError(f"unreadable size of {self._describe(index, domain)}: {e}") from e
        return arr[:h, :w]


# ------------------------------------------------------------------------------------------------ bench
