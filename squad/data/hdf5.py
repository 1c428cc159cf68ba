"""HDF5 shards of a Taskonomy tree: packing (`pack_shards`), reading (`ShardDataset`), and the speed bench.

A shard folder holds ``shards.json`` (the index: format, stored size, domains, shards per split) and files
``{split}_{k:05d}.h5``. Each shard has, for N samples:

* one dataset per domain, ``[N, H, W]`` / ``[N, H, W, C]`` in the file's own dtype (uint8/uint16), or ``[N, C]``
  float32 for class vectors; chunked one sample per chunk so a random read touches one chunk per domain;
* ``present`` ``bool [N, D]`` (a domain the sample lacks or whose file was corrupt is False) and ``id`` (str).

What is stored is the raw file after the reader's own steps 1–2 (`squad.data.transforms`: compact, resize to
`image_size` in the encoded domain), so `ShardDataset` asking for the packed size yields exactly the samples
`TaskonomyDataset` yields at that size. Files are opened lazily in each process (DataLoader workers open their
own handles; a handle never crosses a fork).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import h5py
import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from squad.benchmark import BenchResult, ratio_row, time_interleaved
from squad.tasks import TASK_NAMES, DecodeError, get_task

from .taskonomy import (
    SPLITS,
    CorruptFileError,
    EmptyDatasetError,
    TaskonomyBase,
    TaskonomyDataset,
    collate,
    domain_dir,
    find_split_csv,
    make_data_hint,
    read_raw,
)
from .transforms import SamplePipeline

logger = logging.getLogger(__name__)

INDEX_NAME = "shards.json"
FORMAT = "squad-taskonomy-shards"
VERSION = 1


def is_shard_root(root: str | Path) -> bool:
    """True when `root` holds a shard index (`INDEX_NAME`)."""
    return (Path(root) / INDEX_NAME).is_file()


class _PackSource(Dataset):
    """Reads and prepares every domain of the samples of a PNG tree (runs inside DataLoader workers)."""

    def __init__(self, tree: TaskonomyDataset, domains: list[str], image_size: int | None) -> None:
        self.tree = tree
        self.domains = domains
        self.image_size = image_size
        self.pipeline = SamplePipeline([d for d in domains if d != "rgb"], geometry_mask=False)

    def __len__(self) -> int:
        return len(self.tree)

    def __getitem__(self, index: int) -> tuple[str, dict[str, np.ndarray | None], list[str]]:
        bits = int(self.tree._present[index])
        arrays: dict[str, np.ndarray | None] = {}
        errors: list[str] = []
        for domain in self.domains:
            k = self.tree.domains.index(domain)
            if not bits >> k & 1:
                arrays[domain] = None
                continue
            try:
                raw = self.pipeline.prepare_raw(domain, read_raw(self.tree.path(index, domain)), self.image_size)
                if domain != "rgb":
                    task = get_task(domain)
                    if task.head_kind == "class":
                        raw = np.asarray(raw, dtype=np.float32).reshape(-1)
                    task.decode(raw)  # validates the contents; the stored array is the raw one
                arrays[domain] = raw
            except (CorruptFileError, DecodeError) as e:
                errors.append(f"{self.tree._ids[index]} ({domain}): {e}")
                arrays[domain] = None
        return str(self.tree._ids[index]), arrays, errors


def _first(batch: list) -> Any:
    return batch[0]


def pack_shards(src: str | Path, out: str | Path, split_csv: str | Path | None = None,
                splits: Sequence[str] = SPLITS, image_size: int | None = 256, shard_size: int = 1024,
                domains: Sequence[str] | None = None, compression: str | None = None, workers: int = 0) -> Path:
    """Packs a Taskonomy tree into HDF5 shards.

    Args:
        src: Taskonomy root (either layout).
        out: output folder (created); an existing index there is overwritten.
        split_csv: CSV path or short name (``"tiny"``); None finds one in `src`; without any CSV every building
            is packed as split ``"all"``.
        splits: which partitions to pack.
        image_size: stored size (raw files are resized in the encoded domain); None keeps the file size.
        shard_size: samples per shard file.
        domains: domains to pack (default: rgb and every task domain present in `src`).
        compression: h5py compression (None, ``"lzf"``, ``"gzip"``); None reads fastest.
        workers: DataLoader workers reading and resizing files in parallel.

    Returns:
        Path of the written ``shards.json``.

    Raises:
        FileNotFoundError: `src` or its rgb folder does not exist.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"source {src} does not exist. {make_data_hint(src)}")
    if domains is None:
        domains = ["rgb", *(t for t in TASK_NAMES if domain_dir(src, t) is not None)]
    domains = list(dict.fromkeys(["rgb", *domains]))
    tasks = [d for d in domains if d != "rgb"]
    csv = find_split_csv(src, split_csv)
    parts = list(splits) if csv is not None else ["all"]
    out.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "image_size": image_size, "domains": domains,
                             "source": str(src), "split_csv": str(csv) if csv else None, "shards": [],
                             "shapes": {}, "corrupt": 0}
    for part in parts:
        try:
            tree = TaskonomyDataset(src, tasks, split=part, split_csv=csv, missing="mask", geometry_mask=False)
        except EmptyDatasetError as e:
            logger.warning("pack: split %s is empty, nothing packed (%s)", part, e)
            continue
        loader = DataLoader(_PackSource(tree, domains, image_size), batch_size=1, num_workers=workers,
                            collate_fn=_first)
        writer = _ShardWriter(out, part, domains, shard_size, compression, index)
        for sample_id, arrays, errors in loader:
            for e in errors:
                index["corrupt"] += 1
                logger.warning("pack: skipping unreadable %s", e)
            if arrays["rgb"] is None:
                continue
            writer.add(sample_id, arrays)
        writer.close()
        logger.info("packed %s: %d samples in %d shards", part, writer.total, writer.count)
    path = out / INDEX_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path)
    return path


class _ShardWriter:
    """Buffers samples and writes one shard file per `shard_size` samples."""

    def __init__(self, out: Path, split: str, domains: list[str], shard_size: int, compression: str | None,
                 index: dict[str, Any]) -> None:
        self.out, self.split, self.domains = out, split, domains
        self.shard_size, self.compression, self.index = shard_size, compression, index
        self.buffer: list[tuple[str, dict[str, np.ndarray | None]]] = []
        self.count = 0
        self.total = 0

    def add(self, sample_id: str, arrays: dict[str, np.ndarray | None]) -> None:
        shapes = self.index["shapes"]
        for d, a in arrays.items():
            if a is None:
                continue
            spec = {"shape": list(a.shape), "dtype": a.dtype.str}
            if d not in shapes:
                shapes[d] = spec
            elif shapes[d] != spec:
                logger.warning("pack: %s (%s) has shape %s %s, expected %s; stored as missing", sample_id, d,
                               spec["shape"], spec["dtype"], shapes[d])
                self.index["corrupt"] += 1
                arrays[d] = None
        self.buffer.append((sample_id, arrays))
        if len(self.buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"{self.split}_{self.count:05d}.h5"
        n = len(self.buffer)
        with h5py.File(self.out / name, "w") as f:
            f.attrs["format"] = FORMAT
            f.create_dataset("id", data=[s for s, _ in self.buffer], dtype=h5py.string_dtype())
            present = np.array([[a[d] is not None for d in self.domains] for _, a in self.buffer], dtype=bool)
            f.create_dataset("present", data=present)
            for k, d in enumerate(self.domains):
                if d not in self.index["shapes"]:
                    continue
                spec = self.index["shapes"][d]
                shape = tuple(spec["shape"])
                ds = f.create_dataset(d, shape=(n, *shape), dtype=np.dtype(spec["dtype"]), chunks=(1, *shape),
                                      compression=self.compression)
                for i, (_, arrays) in enumerate(self.buffer):
                    if present[i, k]:
                        ds[i] = arrays[d]
        self.index["shards"].append({"file": name, "split": self.split, "n": n})
        self.count += 1
        self.total += n
        self.buffer = []

    def close(self) -> None:
        self.flush()


class ShardDataset(TaskonomyBase):
    """Taskonomy samples from HDF5 shards written by `pack_shards`; same sample format as `TaskonomyDataset`.

    Args:
        root: shard folder (holds ``shards.json``).
        tasks, augment, missing, geometry_mask, seed: as in `TaskonomyDataset`.
        split: ``"train"``, ``"val"``, ``"test"``, ``"all"`` or a list (shards packed without a CSV are ``"all"``).
        buildings: keep only samples of these buildings.
        image_size: output size; None keeps the packed size (then no resizing happens).
        resize: size before cropping `image_size`; None means `image_size`.

    Raises:
        FileNotFoundError: no index in `root` (with a hint), or a requested domain was not packed.
        ValueError: wrong index format, or no samples in the split.
    """

    def __init__(self, root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                 buildings: Sequence[str] | None = None, image_size: int | None = None, resize: int | None = None,
                 augment: bool = False, missing: Literal["skip", "mask"] = "skip", geometry_mask: bool = True,
                 seed: int = 0) -> None:
        super().__init__(tasks, image_size, resize, augment, missing, geometry_mask, seed)
        self.root = Path(root)
        path = self.root / INDEX_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no shard index {path}. Pack a tree with: python tools/make_data.py pack "
                                    f"--src ROOT --out {self.root} --image-size 256. {make_data_hint(self.root)}")
        self.index = json.loads(path.read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{path}: not a squad shard index (format {self.index.get('format')!r})")
        packed = self.index["domains"]
        lacking = [d for d in self.required if d not in packed]
        if lacking:
            raise FileNotFoundError(f"{self.root}: domains {lacking} were not packed (packed: {packed}); use "
                                    f"missing='mask' to train without them")
        splits = [split] if isinstance(split, str) else list(split)
        self.files = [s["file"] for s in self.index["shards"] if "all" in splits or s["split"] in splits]
        self._index(packed, set(buildings) if buildings is not None else None)
        if len(self) == 0:
            have = sorted({s["split"] for s in self.index["shards"]})
            raise EmptyDatasetError(f"no samples in {self.root} for split {split!r} (packed splits: {have}) with tasks "
                             f"{self.tasks} and missing={self.missing!r}")
        self._handles: dict[int, h5py.File] = {}
        self._dsets: dict[tuple[int, str], h5py.Dataset] = {}
        self._pid = -1

    def _index(self, packed: list[str], buildings: set[str] | None) -> None:
        cols = [packed.index(d) if d in packed else -1 for d in self.domains]
        required = sum(1 << k for k, d in enumerate(self.domains) if d in self.required)
        ids, present, loc = [], [], []
        for fi, name in enumerate(self.files):
            with h5py.File(self.root / name, "r") as f:
                sid = f["id"].asstr()[...]
                pres = f["present"][...]
            bits = np.zeros(len(sid), dtype=np.int64)
            for k, c in enumerate(cols):
                if c >= 0:
                    bits |= pres[:, c].astype(np.int64) << k
            keep = (bits & required) == required
            if buildings is not None:
                keep &= np.array([s.split("/", 1)[0] in buildings for s in sid], dtype=bool)
            rows = np.nonzero(keep)[0]
            ids.append(sid[rows])
            present.append(bits[rows])
            loc.append(np.stack([np.full_like(rows, fi), rows], axis=1))
        self._ids = np.concatenate(ids).astype(str) if ids else np.array([], dtype=str)
        self._present = np.concatenate(present) if present else np.zeros(0, dtype=np.int64)
        self._loc = np.concatenate(loc) if loc else np.zeros((0, 2), dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_handles"], state["_dsets"], state["_pid"] = {}, {}, -1
        return state

    def _dataset(self, fi: int, domain: str) -> h5py.Dataset:
        if self._pid != os.getpid():  # first use in this process (or after a fork): never reuse a parent's handle
            self._handles, self._dsets = {}, {}
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

    def _read(self, index: int, domain: str) -> np.ndarray:
        fi, row = self._loc[index]
        try:
            return self._dataset(int(fi), domain)[int(row)]
        except (OSError, KeyError) as e:
            raise CorruptFileError(f"unreadable {self._describe(index, domain)}: {e}") from e


# ------------------------------------------------------------------------------------------------ bench


def write_random_tree(root: str | Path, n: int = 200, size: int = 256, buildings: int = 4, seed: int = 0,
                      layout: Literal["official", "flat"] = "official", unique: int | None = None) -> Path:
    """Writes a Taskonomy-format tree of smooth random files in every domain's encoding (for benches and tests).

    Args:
        root: output folder.
        n: samples, spread over `buildings` buildings named ``b0, b1, ...``.
        size: image side in pixels.
        buildings: number of buildings; all are in the train split of ``train_val_test_random.csv`` (CR-only).
        seed: random seed.
        layout: ``"official"`` (``{domain}/taskonomy/{building}``) or ``"flat"`` (``{domain}/{building}``).
        unique: draw only this many distinct samples and fill the rest with byte copies of them (PNG encoding is
            the slow part of writing; reading a copy costs the same as reading an original). None: all distinct.

    Returns:
        `root`.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)

    def smooth(channels: int, lo: float, hi: float) -> np.ndarray:
        coarse = rng.uniform(lo, hi, size=(size // 16 + 1, size // 16 + 1, channels))
        up = np.kron(coarse, np.ones((16, 16, 1)))[:size, :size]
        return up + rng.normal(0, (hi - lo) * 0.01, size=up.shape)

    written: list[dict[str, Path]] = []
    for i in range(n):
        b = f"b{i % buildings}"
        stem = f"point_{i // buildings}_view_{i % 3}"
        sub = "taskonomy" if layout == "official" else ""
        if unique is not None and i >= unique:
            for domain, source in written[i % unique].items():
                folder = root / domain / sub / b
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, folder / f"{stem}_domain_{domain}{source.suffix}")
            continue
        paths: dict[str, Path] = {}
        depth = smooth(1, 512, 20000)[..., 0]
        depth[:8, :8] = 65535
        normal = smooth(3, -1, 1)
        normal /= np.linalg.norm(normal, axis=-1, keepdims=True) + 1e-6
        files: dict[str, np.ndarray] = {
            "rgb": smooth(3, 0, 255), "depth_euclidean": depth * 1.05, "depth_zbuffer": depth,
            "normal": (normal + 1) * 127.5, "principal_curvature": smooth(3, 90, 160), "reshading": smooth(3, 0, 255),
            "edge_texture": smooth(1, 0, 6000)[..., 0], "edge_occlusion": smooth(1, 0, 500)[..., 0],
            "keypoints2d": smooth(1, 0, 400)[..., 0], "keypoints3d": smooth(1, 0, 65535)[..., 0],
            "segment_unsup2d": np.floor(smooth(1, 0, 63.99)[..., 0]),
            "segment_unsup25d": np.floor(smooth(1, 0, 63.99)[..., 0]),
        }
        for domain, arr in files.items():
            bits = 8 if domain == "rgb" else get_task(domain).bits
            dtype = np.uint8 if bits == 8 else np.uint16
            arr = np.clip(np.round(arr), 0, np.iinfo(dtype).max).astype(dtype)
            folder = root / domain / sub / b
            folder.mkdir(parents=True, exist_ok=True)
            paths[domain] = folder / f"{stem}_domain_{domain}.png"
            Image.fromarray(arr).save(paths[domain])
        for domain in ("class_object", "class_scene"):
            folder = root / domain / sub / b
            folder.mkdir(parents=True, exist_ok=True)
            paths[domain] = folder / f"{stem}_domain_{domain}.npy"
            np.save(paths[domain], rng.dirichlet(np.full(get_task(domain).channels, 0.1)).astype(np.float32))
        written.append(paths)
    rows = ["id,train,val,test", *(f"b{k},1,0,0" for k in range(buildings))]
    (root / "train_val_test_random.csv").write_bytes(("\r".join(rows) + "\r").encode())
    return root


def bench_shards_vs_png(tmpdir: str | Path | None = None, quick: bool = False) -> list[BenchResult]:
    """Images per second through a DataLoader (2 workers, batch 8, all 13 domains): HDF5 shards vs PNG tree.

    Writes its own data with `write_random_tree` (128 samples, 32 with `quick`; 16 / 8 distinct ones, the rest
    byte copies) and times full passes over the datasets, interleaved. Two comparisons:

    * ``hdf5_vs_png_13_domains`` (the contract, ≥ 3×): the tree at Taskonomy's native 512 px read at 256 px
      (decode 512 px PNGs, resize every domain) against shards packed at 256 px from it — what
      ``tools/make_data.py pack --image-size 256`` buys a user of the real dataset.
    * ``hdf5_vs_png_same_size`` (informational): tree and shards both at 256 px, so only PNG decoding against
      HDF5 reads differs; decoding to float targets and moving batches out of the workers is common to both
      and bounds this ratio on a 2-core machine.

    Args:
        tmpdir: scratch folder (a temporary one is made and removed when None).
        quick: fewer samples and repeats.

    Returns:
        The two ratio rows and one informational images-per-second row per dataset.
    """
    if tmpdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return bench_shards_vs_png(tmp, quick)
    tmpdir = Path(tmpdir)
    n, unique, repeats = (32, 8, 2) if quick else (128, 16, 3)
    size = 256
    base = {"images": n, "image_size": size, "workers": 2, "batch_size": 8, "domains": 13}
    rows: list[BenchResult] = []
    for case, tree_size, target in (("hdf5_vs_png_13_domains", 512, ">= 3"), ("hdf5_vs_png_same_size", size, "")):
        tree = write_random_tree(tmpdir / f"tree{tree_size}", n=n, size=tree_size, unique=unique)
        shards = tmpdir / f"shards{tree_size}"
        pack_shards(tree, shards, image_size=size, splits=("train",), workers=2)
        datasets = {"png": TaskonomyDataset(tree, "all", split="train", image_size=size),
                    "hdf5": ShardDataset(shards, "all", split="train")}
        loaders = {k: DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate, persistent_workers=True)
                   for k, ds in datasets.items()}

        def epoch(loader: DataLoader) -> None:
            seen = sum(len(batch["id"]) for batch in loader)
            if seen != n:
                raise RuntimeError(f"bench: a pass yielded {seen} images instead of {n}")

        h5_loader, png_loader = loaders["hdf5"], loaders["png"]
        t_h5, t_png = time_interleaved([lambda: epoch(h5_loader), lambda: epoch(png_loader)],  # noqa: B023
                                       repeats=repeats, warmup=1)
        details = {**base, "png_file_size": tree_size, "png_images_per_s": n / t_png,
                   "hdf5_images_per_s": n / t_h5}
        rows.append(ratio_row(case, t_h5, t_png, target, faster=True, **details))
        rows.append(BenchResult(f"png_tree_{tree_size}px_images_per_s", n / t_png, "", "img/s", None, details))
        if tree_size == size:
            rows.append(BenchResult("hdf5_shards_images_per_s", n / t_h5, "", "img/s", None, details))
    return rows
