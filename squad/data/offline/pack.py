"""Packing a Taskonomy tree into HDF5 shards (`pack_shards`, behind ``tools/make_data.py pack``).

The shard format is described in `squad.data.shards`. What is stored is the raw file after the reader's own steps
1–2 (compact, resize to `image_size` in the encoded domain), so the shards yield exactly the samples the PNG-tree
reader yields at that size; unusable files are counted as the reader counts them. The resize is the reader's
mask-aware one (`squad.data.transforms`): when depth_zbuffer is packed, its valid pixels mask the resize of every
geometric domain, and an output pixel less than half covered holds the task's fill and, in depth_zbuffer, 65535 —
so the geometry mask read back from the shards masks exactly those pixels. Packing without depth_zbuffer falls
back to each domain's own mask (depth, normal) or a plain resize. Filters such as edge_occlusion's blur are not
applied when packing (the reader applies them), so one shard set serves every decoding variant.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from torch.utils.data import DataLoader, Dataset

from squad.config.tools import PackConfig
from squad.data.benchmark import BenchmarkBase, check_dataset_tasks
from squad.data.nyud import NYUDDataset
from squad.data.pascal import PascalContextDataset
from squad.data.samples import CorruptFileError, EmptyDatasetError
from squad.data.shards import FORMAT, HW_KEY, INDEX_NAME, VERSION, detect_dataset, logger
from squad.data.taskonomy import (
    TaskonomyDataset,
    domain_dir,
    find_split_csv,
    make_data_hint,
    read_raw,
)
from squad.data.transforms import GEOMETRY_DOMAIN, SamplePipeline, WrongSizeError, check_size
from squad.io.files import atomic_path, atomic_write_text, check_writable, removed_on_failure
from squad.tasks import TASK_NAMES, DecodeError, get_task


class _PackSource(Dataset):
    """Reads and prepares every domain of the samples of a PNG tree (runs inside DataLoader workers)."""

    def __init__(self, tree: TaskonomyDataset, domains: list[str], image_size: int | None) -> None:
        self.tree = tree
        self.domains = domains
        self.image_size = image_size
        self.pipeline = SamplePipeline([d for d in domains if d != "rgb"], geometry_mask=False)

    def __len__(self) -> int:
        return len(self.tree)

    def __getitem__(self, index: int) -> tuple[str, dict[str, np.ndarray | None], list[tuple[str, str]]]:
        bits = int(self.tree._present[index])
        raws: dict[str, np.ndarray] = {}
        arrays: dict[str, np.ndarray | None] = {d: None for d in self.domains}
        errors: list[tuple[str, str]] = []  # (kind, what): kinds of squad.data.accounting

        def bad(domain: str, e: Exception) -> None:
            kind = "wrong_size" if isinstance(e, WrongSizeError) else "corrupt"
            errors.append((kind, f"{self.tree._ids[index]} ({domain}): {e}"))

        sid = str(self.tree._ids[index])
        for domain in self.domains:  # read every file first: the sizes are compared, the geometry resizes the others
            if not bits >> self.tree.domains.index(domain) & 1:
                continue
            try:
                raws[domain] = read_raw(self.tree.path(index, domain))
            except (CorruptFileError, DecodeError) as e:
                bad(domain, e)
                if domain == "rgb":
                    return sid, arrays, errors  # not packed; other files are not read
        if "rgb" not in raws:
            return sid, arrays, errors
        try:
            check_size("rgb", raws["rgb"], None, self.image_size is not None)
            rgb_hw = tuple(raws["rgb"].shape[:2])
            odd = odd_rgb(rgb_hw, {d: r.shape[:2] for d, r in raws.items() if d != "rgb" and _spatial(d)})
            if odd:
                raise WrongSizeError(f"rgb: {odd}", "rgb")
        except DecodeError as e:
            bad("rgb", e)  # one wrong file, not one per target that disagrees with it
            return sid, arrays, errors
        for domain in [d for d in raws if d != "rgb"]:
            try:
                check_size(domain, raws[domain], rgb_hw, self.image_size is not None)
            except DecodeError as e:
                bad(domain, e)
                del raws[domain]
        footprint = None
        if GEOMETRY_DOMAIN in raws:
            try:
                footprint = self.pipeline.footprint(raws[GEOMETRY_DOMAIN])
            except DecodeError:
                footprint = None  # reported below, when the depth_zbuffer file itself is prepared
        for domain, raw in raws.items():
            try:
                raw = self.pipeline.prepare_raw(domain, raw, self.image_size, footprint)
                if domain != "rgb":
                    task = get_task(domain)
                    if task.head_kind == "class":
                        raw = np.asarray(raw, dtype=np.float32).reshape(-1)
                    task.decode(raw)  # validates the contents; the stored array is the raw one
                arrays[domain] = raw
            except DecodeError as e:
                bad(domain, e)
                if domain == "rgb":
                    break
        return str(self.tree._ids[index]), arrays, errors


def _first(batch: list) -> Any:
    return batch[0]


def _spatial(domain: str) -> bool:
    return get_task(domain).head_kind != "class"


def odd_rgb(rgb_hw: tuple[int, int], target_hw: dict[str, tuple[int, ...]]) -> str | None:
    """Why the rgb image is the wrong-size file of a sample, or None: when two or more target files agree on one size
    and the rgb has another, the rgb is the odd one out (counted once), not each target."""
    sizes = {tuple(hw) for hw in target_hw.values()}
    if len(target_hw) < 2 or len(sizes) != 1:
        return None
    (hw,) = sizes
    if hw == tuple(rgb_hw):
        return None
    return (f"size {rgb_hw[0]}×{rgb_hw[1]} differs from all {len(target_hw)} target files' {hw[0]}×{hw[1]} "
            f"(the image is the odd one out)")


def _has_target(arrays: dict[str, Any]) -> bool:
    """Whether a prepared sample holds at least one target (not only its image)."""
    return any(a is not None for d, a in arrays.items() if d not in ("rgb", HW_KEY))


def _keep(sample_id: str, arrays: dict[str, Any], index: dict[str, Any], tasks: list[str]) -> bool:
    """Whether a prepared sample is packed: it has its image and, when tasks are packed, at least one target. A
    sample whose every target is missing or unusable teaches nothing: left out, counted (``no_target``), warned."""
    if arrays.get("rgb") is None:
        return False
    if tasks and not _has_target(arrays):
        index["no_target"] += 1
        (logger.warning if index["no_target"] == 1 else logger.debug)(
            "pack: leaving out %s: none of its target files (%s) is usable", sample_id, ", ".join(tasks))
        return False
    return True


def pack_shards(src: str | Path, out: str | Path, config: PackConfig | None = None, **options: Any) -> Path:
    """Packs a Taskonomy, PASCAL-Context or NYUD-v2 tree into HDF5 shards.

    The options are `squad.config.tools.PackConfig`'s (what ``tools/make_data.py pack`` takes): ``split`` (a split
    CSV path or short name such as ``"tiny"``; None finds one in `src`; without any CSV every building is packed as
    partition ``"all"``), ``partitions``, ``image_size`` (raw files are resized in the encoded domain; None keeps
    the file size), ``shard_size``, ``domains`` (default: rgb and every task domain present in `src`),
    ``compression``, ``workers`` (DataLoader workers reading and resizing files in parallel) and ``dataset`` (None:
    detected from `src`'s layout, `squad.data.shards.detect_dataset`). PASCAL-Context and NYUD-v2
    (`pack_benchmark`): ``split`` is not used, ``partitions`` are taken among the dataset's own (train, val),
    ``domains`` are its task names.

    Args:
        src: Taskonomy root (either layout), PASCAL_MT or NYUD folder.
        out: output folder (created); an existing index there is overwritten.
        config: the options (default `PackConfig`'s).
        **options: options replacing the config's, by field name (``pack_shards(src, out, image_size=16)``).

    Returns:
        Path of the written ``shards.json``; its ``corrupt``, ``wrong_size`` and ``missing`` hold the number of
        files of each kind left out (`squad.data.accounting`; the first of each kind is logged as a warning; a
        sample whose rgb image differs in size from all its targets counts one wrong-size file, the image), and
        ``no_target`` the samples left out because none of their target files was usable.

    Raises:
        FileNotFoundError: `src` or its rgb folder does not exist.
        PermissionError: `out` cannot be written (checked first).
        squad.io.files.WriteError: a shard could not be written (a full disk): every shard this pack wrote is
            removed, and no index is left.
    """
    cfg = dataclasses.replace(config or PackConfig(), **options)
    cfg.check()
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"source {src} does not exist. {make_data_hint(src)}")
    found = detect_dataset(src)
    dataset = cfg.dataset or found  # a known name: checked by the config, or detected
    if dataset != "taskonomy" or found != "taskonomy":
        if found != dataset:
            raise ValueError(f"{src} holds a {found} layout, not {dataset}")
        return pack_benchmark(src, out, dataset, splits=cfg.partitions, image_size=cfg.image_size,
                              shard_size=cfg.shard_size, tasks=[d for d in cfg.domains or () if d != "rgb"] or None,
                              compression=cfg.compression, workers=cfg.workers)
    domains = cfg.domains
    if domains is None:
        domains = ["rgb", *(t for t in TASK_NAMES if domain_dir(src, t) is not None)]
    domains = list(dict.fromkeys(["rgb", *domains]))
    tasks = [d for d in domains if d != "rgb"]
    csv = find_split_csv(src, cfg.split)
    parts = list(cfg.partitions) if csv is not None else ["all"]
    _start(out)
    written: list[Path] = []
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "dataset": "taskonomy", "tasks": tasks,
                             "image_size": cfg.image_size, "domains": domains,
                             "source": str(src), "split_csv": str(csv) if csv else None, "shards": [],
                             "shapes": {}, "corrupt": 0, "wrong_size": 0, "missing": 0, "no_target": 0}
    with removed_on_failure(written, f"the pack into {out}"):  # a full disk leaves no partial shard set
        for part in parts:
            try:
                tree = TaskonomyDataset(src, tasks, split=part, split_csv=csv, missing="mask", geometry_mask=False)
            except EmptyDatasetError as e:
                logger.warning("pack: split %s is empty, nothing packed (%s)", part, e)
                continue
            loader = DataLoader(_PackSource(tree, domains, cfg.image_size), batch_size=1, num_workers=cfg.workers,
                                collate_fn=_first)
            writer = _ShardWriter(out, part, domains, cfg.shard_size, cfg.compression, index, written)
            index["missing"] += tree.missing_files
            for sample_id, arrays, errors in loader:
                for kind, e in errors:
                    index[kind] += 1
                    first = index[kind] == 1
                    (logger.warning if first else logger.debug)("pack: skipping %s %s", kind.replace("_", "-"), e)
                if _keep(sample_id, arrays, index, tasks):
                    writer.add(sample_id, arrays)
            writer.close()
            logger.info("packed %s: %d samples in %d shards", part, writer.total, writer.count)
        return _write_index(out, index)


def _start(out: Path) -> None:
    """Creates the output folder and removes an earlier index there: until the new one is written, the folder is
    not a shard set (a pack that fails half-way never leaves an index describing other shards)."""
    check_writable(out, "--out", folder=True)
    (out / INDEX_NAME).unlink(missing_ok=True)


def _write_index(out: Path, index: dict[str, Any]) -> Path:
    """Writes ``shards.json`` last, atomically: the shards it lists are on disk (each was synced when written)."""
    return atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1), "the shard index")


class _ShardWriter:
    """Buffers samples and writes one shard file per `shard_size` samples."""

    def __init__(self, out: Path, split: str, domains: list[str], shard_size: int, compression: str | None,
                 index: dict[str, Any], written: list[Path]) -> None:
        self.out, self.split, self.domains = out, split, domains
        self.shard_size, self.compression, self.index = shard_size, compression, index
        self.buffer: list[tuple[str, dict[str, np.ndarray | None]]] = []
        self.written = written  # every shard file of this pack (removed if the pack fails)
        self.count = 0
        self.total = 0

    def add(self, sample_id: str, arrays: dict[str, np.ndarray | None]) -> None:
        shapes = self.index["shapes"]
        for d, a in arrays.items():
            if a is None or d == HW_KEY:
                continue
            spec = {"shape": list(a.shape), "dtype": a.dtype.str}
            if d not in shapes:
                shapes[d] = spec
            elif shapes[d] != spec:
                logger.warning("pack: %s (%s) has shape %s %s, expected %s; stored as missing", sample_id, d,
                               spec["shape"], spec["dtype"], shapes[d])
                self.index["wrong_size"] += 1
                arrays[d] = None
        self.buffer.append((sample_id, arrays))
        if len(self.buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"{self.split}_{self.count:05d}.h5"
        n = len(self.buffer)
        self.written.append(self.out / name)
        # whole or absent (squad.io.files); no chunk cache: HDF5 then reports a full disk as an OSError at the write
        # that failed, where with its cache a failed flush crashes the process when the file is closed
        with atomic_path(self.out / name, f"shard {name}") as tmp, h5py.File(tmp, "w", rdcc_nbytes=0) as f:
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
            if any(HW_KEY in a for _, a in self.buffer):  # benchmark shards: the stored (unpadded) size
                f.create_dataset(HW_KEY, data=np.array([a[HW_KEY] for _, a in self.buffer], dtype=np.int32))
        self.index["shards"].append({"file": name, "split": self.split, "n": n})
        self.count += 1
        self.total += n
        self.buffer = []

    def close(self) -> None:
        self.flush()


# ------------------------------------------------------------------------------------------- benchmarks
class _BenchmarkPackSource(Dataset):
    """Reads and prepares the files of one PASCAL-Context / NYUD sample (runs inside DataLoader workers)."""

    def __init__(self, tree: BenchmarkBase, image_size: int) -> None:
        self.tree, self.image_size = tree, image_size

    def __len__(self) -> int:
        return len(self.tree)

    def __getitem__(self, index: int) -> tuple[str, dict[str, np.ndarray | None], list[tuple[str, str]]]:
        tree, size = self.tree, self.image_size
        sid = str(tree._ids[index])
        bits = int(tree._present[index])
        arrays: dict[str, Any] = {d: None for d in tree.domains}
        errors: list[tuple[str, str]] = []
        rgb_hw = None
        for k, domain in enumerate(tree.domains):
            if not bits >> k & 1:
                continue
            try:
                raw = tree._read(index, domain)
                if rgb_hw is not None and tuple(raw.shape[:2]) != rgb_hw:
                    raise WrongSizeError(f"size {raw.shape[0]}×{raw.shape[1]} differs from the rgb image's "
                                         f"{rgb_hw[0]}×{rgb_hw[1]}", domain)
                prepared = tree.pipeline.prepare_raw(domain, raw, size)
                if domain != "rgb":
                    tree.pipeline.task(domain).decode(prepared)  # validates the contents
            except (CorruptFileError, DecodeError) as e:
                kind = "wrong_size" if isinstance(e, WrongSizeError) else "corrupt"
                errors.append((kind, f"{sid} ({domain}): {e}"))
                if domain == "rgb":
                    return sid, arrays, errors
                continue
            if domain == "rgb":
                rgb_hw = tuple(raw.shape[:2])
                arrays[HW_KEY] = prepared.shape[:2]
            padded = np.zeros((size, size, *prepared.shape[2:]), dtype=prepared.dtype)
            padded[: prepared.shape[0], : prepared.shape[1]] = prepared
            arrays[domain] = padded
        return sid, arrays, errors


def pack_benchmark(src: str | Path, out: str | Path, dataset: str, splits: Sequence[str] = ("train", "val"),
                   image_size: int | None = 512, shard_size: int = 1024, tasks: Sequence[str] | None = None,
                   compression: str | None = None, workers: int = 0) -> Path:
    """Packs a PASCAL-Context or NYUD-v2 tree into HDF5 shards (format: `squad.data.shards`).

    Each array is stored as the reader prepares it for `image_size` — resized so its longer side is
    `image_size`, aspect kept (`squad.data.benchmark.BenchmarkPipeline.prepare_raw`) — zero-padded at the bottom
    and right to a square, with its unpadded size in the shard's ``hw`` dataset. PASCAL's derived targets (edges,
    masked normals, the parts map) are stored derived. The index records ``dataset`` and ``tasks``.

    Args:
        src: the dataset folder (PASCAL_MT or NYUD MTI-Net layout).
        out: output folder (created; an existing index is overwritten).
        dataset: ``"pascal_context"`` or ``"nyud"``.
        splits: which split lists to pack (others, such as Taskonomy's ``test``, are skipped with a note).
        image_size: stored longer side (required).
        shard_size: samples per shard file.
        tasks: tasks to pack (default: all of the dataset's).
        compression: h5py compression.
        workers: DataLoader workers.

    Returns:
        Path of the written ``shards.json`` (with ``corrupt``, ``wrong_size`` and ``missing`` counts).

    Raises:
        ValueError: no `image_size`, or an unknown dataset or task.
    """

    readers = {"pascal_context": PascalContextDataset, "nyud": NYUDDataset}
    if dataset not in readers:
        raise ValueError(f"pack_benchmark: dataset must be one of {', '.join(readers)}, got {dataset!r}")
    if not image_size:
        raise ValueError(f"packing {dataset} needs an image size (its images are not square and differ in size)")
    src, out = Path(src), Path(out)
    names = check_dataset_tasks(dataset, tasks or "all")
    parts = [s for s in splits if s in readers[dataset].splits]
    skipped = [s for s in splits if s not in readers[dataset].splits]
    if skipped:
        logger.info("pack: %s has no split %s; packing %s", dataset, ", ".join(skipped), ", ".join(parts))
    _start(out)
    written: list[Path] = []
    domains: list[str] = []
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "dataset": dataset, "tasks": names,
                             "image_size": image_size, "domains": domains, "source": str(src), "split_csv": None,
                             "shards": [], "shapes": {}, "corrupt": 0, "wrong_size": 0, "missing": 0, "no_target": 0}
    with removed_on_failure(written, f"the pack into {out}"):  # a full disk leaves no partial shard set
        for part in parts:
            try:
                tree = readers[dataset](src, names, split=part, missing="mask")
            except (EmptyDatasetError, FileNotFoundError) as e:
                logger.warning("pack: split %s is empty or absent, nothing packed (%s)", part, e)
                continue
            domains[:] = tree.domains
            loader = DataLoader(_BenchmarkPackSource(tree, int(image_size)), batch_size=1, num_workers=workers,
                                collate_fn=_first)
            writer = _ShardWriter(out, part, tree.domains, shard_size, compression, index, written)
            index["missing"] += tree.missing_files
            for sample_id, arrays, errors in loader:
                for kind, e in errors:
                    index[kind] += 1
                    (logger.warning if index[kind] == 1 else logger.debug)("pack: skipping %s %s",
                                                                           kind.replace("_", "-"), e)
                if _keep(sample_id, arrays, index, names):
                    writer.add(sample_id, arrays)
            writer.close()
            logger.info("packed %s %s: %d samples in %d shards", dataset, part, writer.total, writer.count)
        return _write_index(out, index)
