"""Reading Taskonomy as it is shipped: folder layouts, split CSVs, corrupt files, and the PNG-tree Dataset.

Layouts (per domain, detected by the presence of the ``taskonomy`` folder):
``{root}/{domain}/taskonomy/{building}/point_{p}_view_{v}_domain_{domain}.png`` (the official download tool) or
``{root}/{domain}/{building}/...`` (other loaders); class labels are ``.npy`` files with the same naming.

Split CSVs have columns ``id,train,val,test`` (one building per row, flags 0/1) and often CR-only line endings.
With ``split_csv=None`` the reader looks for ``train_val_test_*.csv`` in ``root``, ``root/splits_taskonomy`` and
``root/splits`` and uses it if there is exactly one (the synthetic renderer writes ``train_val_test_synthetic.csv``;
the official ones are ``train_val_test_{tiny,medium,full,fullplus}.csv``). ``split_csv`` may also be a path or a
short name (``"tiny"`` → ``train_val_test_tiny.csv`` in those folders).

Samples, their accounting of unusable files and `collate` are every reader's (`squad.data.samples`);
`TaskonomyDataset` is the `squad.data.samples.SampleDataset` over a tree, with Taskonomy's square-crop pipeline
(`squad.data.transforms.SamplePipeline`); its sample ids are ``"{building}/point_{p}_view_{v}"``.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from squad.data.samples import CorruptFileError, EmptyDatasetError, SampleDataset
from squad.data.transforms import SamplePipeline
from squad.tasks import TaskOptions, get_task

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
OFFICIAL_SPLIT_CSVS = ("tiny", "medium", "full", "fullplus")
_SPLIT_DIRS = (".", "splits_taskonomy", "splits")


def make_data_hint(root: str | Path) -> str:
    """The sentence every missing-data error ends with."""
    return (f"Make a small synthetic Taskonomy there with: python tools/make_data.py synthetic --out {root} "
            f"--n 2000 --image-size 64 --seed 0 (or point root at a Taskonomy download or packed shards)")


def read_raw(path: str | Path) -> np.ndarray:
    """Reads one Taskonomy file: PNG → integer array ``[H, W]`` / ``[H, W, C]`` as stored (16-bit stays
    uint16, palette images give their indices); ``.npy`` → its array.

    Raises:
        CorruptFileError: the file is truncated or not a valid PNG / .npy.
        FileNotFoundError: the file does not exist.
    """
    path = Path(path)
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        with Image.open(path) as im:
            im.load()
            arr = np.array(im)  # writable (torch.from_numpy warns on read-only arrays)
            wide = im.mode.startswith("I")
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error) as e:
        raise CorruptFileError(f"corrupt file {path}: {e}") from e
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if wide and arr.dtype == np.int32 and arr.size and 0 <= arr.min() and arr.max() <= 65535:
        arr = arr.astype(np.uint16)  # 16-bit PNGs that Pillow opened as 32-bit "I"
    return arr


def read_split_csv(path: str | Path) -> dict[str, list[str]]:
    """Parses a Taskonomy split CSV (``id,train,val,test``; CR, LF or CRLF line endings).

    Returns:
        ``{"train": [...], "val": [...], "test": [...]}`` buildings in file order.

    Raises:
        ValueError: a row without four columns or with flags other than 0/1 (names file and line).
    """
    path = Path(path)
    text = path.read_bytes().decode("utf-8-sig")
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cols = [c.strip() for c in line.split(",")]
        if lineno == 1 and not all(c.replace(".", "", 1).isdigit() for c in cols[1:4]):
            continue  # header
        if len(cols) < 4:
            raise ValueError(f"{path}:{lineno}: expected 'id,train,val,test', got {line!r}")
        try:
            flags = [int(float(c)) for c in cols[1:4]]
        except ValueError:
            raise ValueError(f"{path}:{lineno}: split flags must be 0 or 1, got {cols[1:4]}") from None
        if any(f not in (0, 1) for f in flags):
            raise ValueError(f"{path}:{lineno}: split flags must be 0 or 1, got {cols[1:4]}")
        for split, flag in zip(SPLITS, flags, strict=True):
            if flag:
                out[split].append(cols[0])
    return out


def find_split_csv(root: str | Path, split_csv: str | Path | None = None) -> Path | None:
    """Locates the split CSV for `root` by the rule in the module docstring.

    Returns:
        The CSV path, or None when `split_csv` is None and no candidate exists.

    Raises:
        FileNotFoundError: a named CSV does not exist.
        ValueError: `split_csv` is None and several candidates exist.
    """
    root = Path(root)
    dirs = [root / d for d in _SPLIT_DIRS]
    if split_csv is not None:
        p = Path(split_csv)
        if p.suffix == ".csv":
            for cand in (p, root / p):
                if cand.is_file():
                    return cand
            raise FileNotFoundError(f"split CSV {split_csv} not found (looked at {p} and {root / p})")
        name = f"train_val_test_{split_csv}.csv"
        for d in dirs:
            if (d / name).is_file():
                return d / name
        raise FileNotFoundError(f"split CSV {name} not found in {', '.join(str(d) for d in dirs)}")
    found = sorted({p for d in dirs if d.is_dir() for p in d.glob("train_val_test_*.csv")})
    if len(found) > 1:
        names = ", ".join(p.stem.removeprefix("train_val_test_") for p in found)
        raise ValueError(f"several split CSVs in {root}: {', '.join(map(str, found))}; choose one with "
                         f"split_csv= (one of: {names})")
    return found[0] if found else None


def domain_dir(root: str | Path, domain: str) -> Path | None:
    """The folder holding the buildings of a domain in either layout, or None if the domain is absent."""
    d = Path(root) / domain
    if (d / "taskonomy").is_dir():
        return d / "taskonomy"
    return d if d.is_dir() else None


def file_ext(domain: str) -> str:
    """File extension of a domain (``.png``, ``.npy`` for class labels)."""
    return ".png" if domain == "rgb" else get_task(domain).file_ext


def list_stems(folder: Path, domain: str) -> list[str]:
    """Sample stems ``point_{p}_view_{v}`` of one building folder of one domain (empty if it is absent)."""
    suffix = f"_domain_{domain}{file_ext(domain)}"
    try:
        with os.scandir(folder) as it:
            return [e.name[: -len(suffix)] for e in it if e.name.endswith(suffix)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def select_buildings(root: str | Path, split: str | Sequence[str], split_csv: str | Path | None,
                     buildings: Sequence[str] | None) -> list[str] | None:
    """Buildings of a split: `buildings` if given; else from the split CSV; None means every building on disk.

    Raises:
        ValueError: no CSV is found and `split` is not ``"all"``, or an unknown split name.
    """
    if buildings is not None:
        return list(buildings)
    splits = [split] if isinstance(split, str) else list(split)
    bad = [s for s in splits if s not in (*SPLITS, "all")]
    if bad:
        raise ValueError(f"unknown split {bad}; use train, val, test, all or a list of them")
    csv = find_split_csv(root, split_csv)
    if csv is None:
        if "all" in splits:
            return None
        raise ValueError(f"no split CSV (train_val_test_*.csv) in {root}; pass split_csv=, buildings=, "
                         f"or split='all'")
    table = read_split_csv(csv)
    chosen = SPLITS if "all" in splits else splits
    return list(dict.fromkeys(b for s in chosen for b in table[s]))


class TaskonomyDataset(SampleDataset):
    """Taskonomy from its folder tree (PNG / .npy files), in either layout.

    Args:
        root: dataset root holding one folder per domain (``rgb`` is required).
        tasks: task names or aliases (``"all"`` for the 13).
        split: ``"train"``, ``"val"``, ``"test"``, ``"all"`` or a list of them (e.g. ``["train", "val"]``).
        split_csv: a CSV path or short name; None finds one in `root` (module docstring).
        buildings: use exactly these buildings (the CSV is then not read).
        image_size: output size; None keeps the stored size.
        resize: size before cropping `image_size` (e.g. 256 → crop 224); None means `image_size`.
        augment: random crop + horizontal flip (normals' x negated); else a centred crop.
        missing: ``"skip"`` drops samples lacking a requested domain; ``"mask"`` keeps them with zero values
            and all-False masks.
        geometry_mask: AND depth_zbuffer's valid mask into geometric tasks' masks when the file exists; the file
            is then read for every sample with a geometric task, and also masks the resize of the geometric
            domains (`squad.data.transforms`: fill values never blend into valid pixels).
        seed: augmentation seed.
        task_options: the options of the model the data is for (``model.task_options``, e.g.
            ``{"edge_occlusion": {"decode": "clip"}}``): targets are decoded as that model's tasks decode them.

    Raises:
        FileNotFoundError: `root` or its ``rgb`` folder is missing (with a hint on how to make data), or a
            requested domain folder is missing with ``missing="skip"``.
        EmptyDatasetError: no samples were found (a ValueError).
        ValueError: bad arguments.
    """

    def __init__(self, root: str | Path, tasks: str | Sequence[str], split: str | Sequence[str] = "train",
                 split_csv: str | Path | None = None, buildings: Sequence[str] | None = None,
                 image_size: int | None = None, resize: int | None = None, augment: bool = False,
                 missing: Literal["skip", "mask"] = "skip", geometry_mask: bool = True, seed: int = 0,
                 task_options: TaskOptions | None = None) -> None:
        pipeline = functools.partial(SamplePipeline, image_size=image_size, resize=resize, augment=augment,
                                     geometry_mask=geometry_mask)
        super().__init__(tasks, pipeline, missing, seed, task_options)
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"Taskonomy root {self.root} does not exist. {make_data_hint(self.root)}")
        self.dirs: dict[str, Path | None] = {d: domain_dir(self.root, d) for d in self.domains}
        if self.dirs["rgb"] is None:
            raise FileNotFoundError(f"no rgb folder in {self.root} (expected {self.root / 'rgb'}). "
                                    f"{make_data_hint(self.root)}")
        for d in self.required:
            if self.dirs[d] is None:
                raise FileNotFoundError(f"domain folder {self.root / d} is missing; with missing='skip' every "
                                        f"sample would be dropped (use missing='mask' to train without it)")
        for d in self.domains[1:]:
            if self.dirs[d] is None and d not in self.required and d in self.task_domains:
                logger.warning("domain folder %s is missing; its targets are masked", self.root / d)
        chosen = select_buildings(self.root, split, split_csv, buildings)
        if chosen is None:
            chosen = sorted(e.name for e in os.scandir(self.dirs["rgb"]) if e.is_dir())
        self.buildings = chosen
        self.split = split
        self._index(chosen)
        if len(self) == 0:
            raise EmptyDatasetError(f"no samples in {self.root} for split {split!r} with tasks {self.tasks} "
                             f"(buildings: {chosen[:5]}{'...' if len(chosen) > 5 else ''}; missing={self.missing!r})")

    def _index(self, buildings: Sequence[str]) -> None:
        ids: list[str] = []
        present: list[int] = []
        required = sum(1 << k for k, d in enumerate(self.domains) if d in self.required)
        # missing files are counted for the task domains whose folder exists (an absent folder is warned about)
        counted = sum(1 << k for k, d in enumerate(self.domains) if d in self.task_domains and self.dirs[d])
        absent = []
        missing_files, unindexed, examples = 0, 0, []
        for b in buildings:
            rgb = sorted(list_stems(self.dirs["rgb"] / b, "rgb"))
            if not rgb:
                absent.append(b)
                continue
            have = {d: set(list_stems(self.dirs[d] / b, d)) for d in self.domains[1:] if self.dirs[d] is not None}
            for stem in rgb:
                bits = 1 | sum(1 << k for k, d in enumerate(self.domains) if k and d in have and stem in have[d])
                lacking = counted & ~bits
                if lacking:
                    missing_files += lacking.bit_count()
                    if len(examples) < 3:
                        names = ", ".join(d for k, d in enumerate(self.domains) if lacking >> k & 1)
                        examples.append(f"{b}/{stem} ({names})")
                if bits & required == required:
                    ids.append(f"{b}/{stem}")
                    present.append(bits)
                else:
                    unindexed += 1
        if absent:
            logger.warning("%d buildings of the split have no rgb images in %s and are skipped: %s",
                           len(absent), self.dirs["rgb"], ", ".join(absent[:10]) + (" ..." if len(absent) > 10 else ""))
        self._ids = np.array(ids, dtype=str)  # one numpy buffer, not millions of objects, for worker forks
        self._present = np.array(present, dtype=np.int64)
        self._indexed(missing_files, unindexed, examples)

    def path(self, index: int, domain: str) -> Path:
        """File of one domain of one sample."""
        return self.dirs[domain] / f"{self._ids[index]}_domain_{domain}{file_ext(domain)}"

    def _read(self, index: int, domain: str) -> np.ndarray:
        return read_raw(self.path(index, domain))
