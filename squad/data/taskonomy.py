"""Reading Taskonomy as it is shipped: folder layouts, split CSVs, corrupt files, and the PNG-tree Dataset.

Layouts (per domain, detected by the presence of the ``taskonomy`` folder):
``{root}/{domain}/taskonomy/{building}/point_{p}_view_{v}_domain_{domain}.png`` (the official download tool) or
``{root}/{domain}/{building}/...`` (other loaders); class labels are ``.npy`` files with the same naming.

Split CSVs have columns ``id,train,val,test`` (one building per row, flags 0/1) and often CR-only line endings.
With ``split_csv=None`` the reader looks for ``train_val_test_*.csv`` in ``root``, ``root/splits_taskonomy`` and
``root/splits`` and uses it if there is exactly one (the synthetic renderer writes ``train_val_test_synthetic.csv``;
the official ones are ``train_val_test_{tiny,medium,full,fullplus}.csv``). ``split_csv`` may also be a path or a
short name (``"tiny"`` → ``train_val_test_tiny.csv`` in those folders).

A sample is ``{"rgb": float32 [3, H, W] in [0, 1], "targets": {task: value}, "masks": {task: bool}, "id": str}``
with values in the units `Task.decode` gives (`squad.tasks.base`); the id is ``"{building}/point_{p}_view_{v}"``.
Augmentation draws come from ``(seed, epoch, index)``, not from global RNG state, so a sample is the same whichever
worker or rank loads it; call `set_epoch` each epoch (before creating the loader iterator, or with
non-persistent workers) to vary them.

Unusable files are counted once per file, whichever worker or rank meets them, in three kinds
(`squad.data.accounting`): corrupt (truncated, bad PNG or .npy), wrong size (non-square where it would be resized,
or not the size of its rgb image: refused, never stretched) and missing (a domain file the sample lacks, found
while indexing; with ``missing="skip"`` the sample is left out of the index, counted in `unindexed`). The first
file of each kind is logged as a warning; `report` gives the totals over all ranks, and every run and tool prints
them in one line at its end. A bad rgb file — or, with ``missing="skip"``, a bad target — makes the sample
unusable: training (``substitute=True``, the default) is served the next index instead, so the epoch goes on at
full length; evaluation (`without_substitutes`, used by `squad.data.eval_loader`) leaves it out, so no
sample is scored twice. With ``missing="mask"`` a bad target is masked like a missing one. A file found bad is not
read again.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, default_collate

from squad.data.accounting import FileIssues, register
from squad.data.transforms import SamplePipeline, WrongSizeError
from squad.tasks import DecodeError, TaskOptions, get_task, resolve_task_names

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
OFFICIAL_SPLIT_CSVS = ("tiny", "medium", "full", "fullplus")
_SPLIT_DIRS = (".", "splits_taskonomy", "splits")
_MAX_SKIP = 64  # consecutive unreadable samples before giving up


class CorruptFileError(OSError):
    """A data file could not be read (truncated, bad PNG chunk, bad .npy header)."""


class EmptyDatasetError(ValueError):
    """A split selects no samples."""


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


class TaskonomyBase(Dataset):
    """Shared sample logic of the PNG-tree and HDF5 readers: index, presence bits, unusable-file accounting.

    Subclasses fill `_ids` (``str`` array), `_present` (``int64`` bit mask over `domains`), call `_indexed` once
    the index is built, and implement `_read`.
    """

    def __init__(self, tasks: str | Sequence[str], image_size: int | None, resize: int | None, augment: bool,
                 missing: Literal["skip", "mask"], geometry_mask: bool, seed: int,
                 task_options: TaskOptions | None = None) -> None:
        if missing not in ("skip", "mask"):
            raise ValueError(f"missing must be 'skip' or 'mask', got {missing!r}")
        self.tasks = resolve_task_names(tasks)
        self.task_options = {str(k): dict(v or {}) for k, v in (task_options or {}).items()}
        self.pipeline = SamplePipeline(self.task_objects(), image_size, resize, augment, geometry_mask)
        self.domains = self.pipeline.domains
        self.task_domains = [t.domain for t in self.task_objects()]
        self.required = ["rgb", *self.task_domains] if missing == "skip" else ["rgb"]
        self.missing = missing
        self.seed = seed
        self.epoch = 0
        self.substitute = True  # serve the next index for an unusable sample (training); False: None (evaluation)
        self.reported = False  # a report (squad.data.accounting) was made: the tools do not print another
        self.split: str | Sequence[str] = "all"
        self.missing_files = 0  # domain files the indexed (and left-out) samples lack
        self.unindexed = 0  # samples left out of the index (a required domain file is missing)
        self.unreadable_files: list[str] = []  # whole files that could not be opened (a truncated HDF5 shard)
        self.lost_samples = 0  # the samples those files held
        self._ids = np.array([], dtype=str)
        self._present = np.zeros(0, dtype=np.int64)
        self.issues = FileIssues(0, len(self.domains))

    def _indexed(self, missing_files: int, unindexed: int, examples: Sequence[str]) -> None:
        """Finishes the index: the shared per-file record and the missing-file count (warned about once)."""
        self.issues = FileIssues(len(self._ids), len(self.domains))
        self.missing_files, self.unindexed = int(missing_files), int(unindexed)
        if missing_files:
            what = (f"{unindexed} samples lacking a file of {', '.join(self.required[1:])} are left out of the "
                    f"index (missing='skip')" if unindexed else "their targets are masked (missing='mask')")
            logger.warning("%s: %d domain files are missing; %s. First: %s", getattr(self, "root", "data"),
                           missing_files, what, ", ".join(examples[:3]))
        register(self)

    # ------------------------------------------------------------------------------------------ public
    def __len__(self) -> int:
        return len(self._ids)

    @property
    def ids(self) -> list[str]:
        """Sample ids ``"{building}/point_{p}_view_{v}"`` in index order."""
        return self._ids.tolist()

    @property
    def num_corrupt(self) -> int:
        """Distinct corrupt files met so far by this dataset in this process and its DataLoader workers."""
        return self.issues.count("corrupt")

    @property
    def num_wrong_size(self) -> int:
        """Distinct files refused for their size so far (this process and its workers)."""
        return self.issues.count("wrong_size")

    def without_substitutes(self) -> TaskonomyBase:
        """The same dataset (sharing its file record) yielding None for an unusable sample instead of the next one.

        `squad.data.eval_loader` uses it so that an evaluation leaves such samples out rather than scoring
        a neighbour twice.
        """
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.substitute = False
        return view

    def set_epoch(self, epoch: int) -> None:
        """Changes the augmentation draws (as `DistributedSampler.set_epoch` changes the order)."""
        self.epoch = int(epoch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        rng = np.random.default_rng([self.seed, self.epoch, index]) if self.pipeline.augment else None
        self.issues.mark_used()
        if not self.substitute:
            return self._load(index, rng)
        for attempt in range(min(_MAX_SKIP, n)):
            sample = self._load((index + attempt) % n, rng)
            if sample is not None:
                return sample
        raise RuntimeError(f"{min(_MAX_SKIP, n)} consecutive samples from index {index} are unreadable "
                           f"({self.num_corrupt} corrupt and {self.num_wrong_size} wrong-size files so far)")

    # ---------------------------------------------------------------------------------------- internals
    def _read(self, index: int, domain: str) -> np.ndarray:
        raise NotImplementedError

    def _describe(self, index: int, domain: str) -> str:
        return f"{self._ids[index]} ({domain})"

    def _load(self, index: int, rng: np.random.Generator | None) -> dict[str, Any] | None:
        """One sample, or None when it has to be skipped."""
        bits = int(self._present[index])
        raws: dict[str, np.ndarray | None] = {}
        for k, domain in enumerate(self.domains):
            if not bits >> k & 1:
                raws[domain] = None
                continue
            bad = self.issues.known(index, k)
            if bad is None:
                try:
                    raws[domain] = self._read(index, domain)
                    continue
                except (CorruptFileError, DecodeError) as e:
                    self._note(index, domain, "wrong_size" if isinstance(e, WrongSizeError) else "corrupt", str(e))
            if domain in self.required:
                return None
            raws[domain] = None
        while True:
            try:
                rgb, targets, masks = self.pipeline(raws, rng)
                break
            except DecodeError as e:
                domain = getattr(e, "domain", None) or "rgb"
                kind = "wrong_size" if isinstance(e, WrongSizeError) else "corrupt"
                self._note(index, domain, kind, f"{self._describe(index, domain)}: {e}")
                if domain in self.required or raws.get(domain) is None:
                    return None
                raws[domain] = None  # mask mode: a target that does not decode is treated as missing
        return {"rgb": rgb, "targets": targets, "masks": masks, "id": str(self._ids[index])}

    def _note(self, index: int, domain: str, kind: str, what: str) -> None:
        """Records an unusable file once; the first of each kind is a warning, the others DEBUG lines."""
        k = self.domains.index(domain) if domain in self.domains else 0
        if not self.issues.note(index, k, kind):
            return
        label = {"corrupt": "unreadable", "wrong_size": "wrong-size"}[kind]
        if self.issues.count(kind) == 1:
            logger.warning("skipping %s data: %s (further ones are counted, reported at the end and logged at "
                           "DEBUG level)", label, what)
        else:
            logger.debug("skipping %s data: %s", label, what)


    def task_objects(self) -> list:
        """The `Task` of every task of this dataset, configured by its ``task_options`` (a model's
        ``model.task_options``: how targets are decoded, e.g. occlusion edges blurred or clipped)."""
        return [get_task(t, self.task_options) for t in self.tasks]


class TaskonomyDataset(TaskonomyBase):
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
        super().__init__(tasks, image_size, resize, augment, missing, geometry_mask, seed, task_options)
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


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stacks samples into a batch with the same keys: ``rgb [B, 3, H, W]``, ``targets[t] [B, C, H, W]`` or
    ``[B, C]``, ``masks[t] [B, 1, H, W]`` or ``[B, 1]``, ``id`` a list of str.

    Raises:
        ValueError: an empty list, or samples with different task sets.
    """
    if not samples:
        raise ValueError("collate: no samples")
    names = list(samples[0]["targets"])
    for s in samples[1:]:
        if list(s["targets"]) != names:
            raise ValueError(f"collate: samples hold different tasks: {names} vs {list(s['targets'])}")
    # default_collate stacks straight into shared memory inside DataLoader workers (no extra copy on the way out)
    return {
        "rgb": default_collate([s["rgb"] for s in samples]),
        "targets": {t: default_collate([s["targets"][t] for s in samples]) for t in names},
        "masks": {t: default_collate([s["masks"][t] for s in samples]) for t in names},
        "id": [s["id"] for s in samples],
    }
