"""Data accounting: which files a dataset could not use, each counted once, across DataLoader workers and ranks.

Three kinds of problem are kept apart:

* ``corrupt``: a file that exists but does not read or decode (truncated PNG, bad ``.npy`` header, wrong dtype);
* ``wrong_size``: a file whose size the reader refuses — a non-square image that would have to be resized (that
  distorts it: 96×80 is never stretched to 64×64), or a target whose size differs from its rgb image's. Square
  images of another size than asked for are resized (aspect kept), as documented in `squad.data.transforms`;
* ``missing``: a domain file a sample lacks, found while indexing. With ``missing="skip"`` the sample is left
  out of the index (``unindexed`` counts those samples); with ``missing="mask"`` its target is masked.

A shard file that cannot be opened at all (truncated, not HDF5) is found while indexing: it counts as one corrupt
file, it is named in a warning, and its samples are skipped and counted as ``lost`` (the index records how many a
shard holds).

`FileIssues` records corrupt and wrong-size files per (sample, domain) in a bit set in shared memory, so every
DataLoader worker of the process sees the same record, a file is counted (and warned about) once however often it
is visited, and a known-bad file is not read again. `report` unites the records of all ranks (a collective when a
process group is running) into a `DataReport`, whose `DataReport.line` is the summary every run and tool prints.
Tools run through `squad.cli.run` print that line for every dataset they read that nothing else reported
(`track` / `pending`).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np

logger = logging.getLogger("squad.data")

KINDS = ("corrupt", "wrong_size")  # found while reading; "missing" is found while indexing


class FileIssues:
    """Per-file record of unusable files, shared with DataLoader workers (forked or spawned).

    Args:
        num_samples: samples in the dataset's index.
        num_domains: domains read per sample.
    """

    def __init__(self, num_samples: int, num_domains: int) -> None:
        self.num_samples, self.num_domains = int(num_samples), int(num_domains)
        nbytes = max(1, -(-self.num_samples * self.num_domains // 8))
        self._bits = {k: multiprocessing.RawArray("B", nbytes) for k in KINDS}
        self._counts = multiprocessing.RawArray("q", len(KINDS))
        self._used = multiprocessing.RawValue("b", 0)
        self._lock = multiprocessing.Lock()
        self._views: dict[str, np.ndarray] | None = None

    # pickling: shared handles when a worker is spawned, plain copies otherwise (e.g. copy.deepcopy)
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_views"] = None
        if get_spawning_popen() is None:
            state["_bits"] = {k: bytes(v) for k, v in self._bits.items()}
            state["_counts"] = list(self._counts)
            state["_used"] = int(self._used.value)
            state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_used"], int):
            bits = {}
            for k, raw in state["_bits"].items():
                bits[k] = multiprocessing.RawArray("B", len(raw))
                bits[k][:] = raw
            counts = multiprocessing.RawArray("q", len(KINDS))
            counts[:] = state["_counts"]
            used = multiprocessing.RawValue("b", state["_used"])
            state.update(_bits=bits, _counts=counts, _used=used, _lock=multiprocessing.Lock())
        self.__dict__.update(state)

    def _view(self, kind: str) -> np.ndarray:
        if self._views is None:
            self._views = {k: np.frombuffer(v, dtype=np.uint8) for k, v in self._bits.items()}
        return self._views[kind]

    def mark_used(self) -> None:
        """Notes that samples were read (the tools report only datasets that were)."""
        if not self._used.value:
            self._used.value = 1

    @property
    def used(self) -> bool:
        return bool(self._used.value)

    def known(self, index: int, k: int) -> str | None:
        """The kind recorded for domain `k` of sample `index`, or None."""
        pos = index * self.num_domains + k
        for kind in KINDS:
            if self._view(kind)[pos >> 3] >> (pos & 7) & 1:
                return kind
        return None

    def note(self, index: int, k: int, kind: str) -> bool:
        """Records a bad file; True when it is new (the caller then warns about it)."""
        pos = index * self.num_domains + k
        bit = np.uint8(1 << (pos & 7))
        view = self._view(kind)
        with self._lock:
            if view[pos >> 3] & bit:
                return False
            view[pos >> 3] |= bit
            self._counts[KINDS.index(kind)] += 1
        return True

    def count(self, kind: str) -> int:
        """Distinct files of `kind` this process (and its workers) found."""
        return int(self._counts[KINDS.index(kind)])

    def positions(self, kind: str) -> np.ndarray:
        """Flat positions ``index * num_domains + k`` of the files of `kind` (for uniting ranks)."""
        view = self._view(kind)
        nz = np.flatnonzero(view)
        if not nz.size:
            return np.zeros(0, dtype=np.int64)
        bits = np.unpackbits(view[nz][:, None], axis=1, bitorder="little")  # [n, 8]
        rows, cols = np.nonzero(bits)
        return nz[rows].astype(np.int64) * 8 + cols


@dataclasses.dataclass
class DataReport:
    """What a dataset could not use, over all ranks (see the module docstring for the kinds)."""

    name: str  # e.g. "train", "val"
    root: str
    samples: int  # samples in the index
    corrupt: int = 0  # distinct files that did not read or decode
    wrong_size: int = 0  # distinct files refused for their size
    missing: int = 0  # domain files the indexed or left-out samples lack
    unindexed: int = 0  # samples left out of the index because a required domain file is missing
    lost: int = 0  # samples of shard files that could not be opened (each such file is one corrupt file)
    images: int | None = None  # images an evaluation pass scored (unusable samples are left out, never replaced)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.wrong_size or self.missing or self.unindexed or self.lost)

    def line(self) -> str:
        """The one-line summary, e.g. ``data val (data/x): 240 samples; 2 corrupt files, 1 wrong-size file``."""
        head = f"data {self.name} ({self.root}): {self.samples} samples"
        if self.images is not None:
            head += f", {self.images} images scored"
        if self.clean:
            return head + "; every file read"
        parts = []
        for n, what in ((self.corrupt, "corrupt"), (self.wrong_size, "wrong-size"), (self.missing, "missing")):
            if n:
                parts.append(f"{n} {what} file{'s' if n != 1 else ''}")
        if self.unindexed:
            parts.append(f"{self.unindexed} sample{'s' if self.unindexed != 1 else ''} left out of the index")
        if self.lost:
            parts.append(f"{self.lost} sample{'s' if self.lost != 1 else ''} lost in unreadable shard files")
        return f"{head}; {', '.join(parts)} (the first of each kind is logged as a warning)"


def report(dataset, name: str, images: int | None = None) -> DataReport:
    """The accounting of `dataset` (a `squad.data.SampleDataset`) over every rank; marks it reported.

    A collective when a process group with several ranks is running: call it on every rank.
    """
    issues: FileIssues = dataset.issues
    counts = {k: issues.count(k) for k in KINDS}
    from squad.distributed import is_distributed

    if is_distributed():
        import torch.distributed as dist

        mine = {k: issues.positions(k) for k in KINDS}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        counts = {k: int(np.unique(np.concatenate([g[k] for g in gathered])).size) for k in KINDS}
    dataset.reported = True
    counts["corrupt"] += len(dataset.unreadable_files)  # the same on every rank (found while indexing)
    return DataReport(name=name, root=str(getattr(dataset, "root", "")), samples=len(dataset),
                      missing=int(dataset.missing_files), unindexed=int(dataset.unindexed),
                      lost=int(dataset.lost_samples), images=images, **counts)


# ------------------------------------------------------------------------------------ what the tools print
_tracking = threading.local()


class track:
    """Context manager collecting the datasets created inside it (`squad.cli.run` wraps every tool in one)."""

    def __enter__(self) -> track:
        self.previous = getattr(_tracking, "sets", None), getattr(_tracking, "tracker", None)
        self.sets: list[Any] = []  # strong references: a tool's datasets live until it ends anyway
        _tracking.sets, _tracking.tracker = self.sets, self
        return self

    def __exit__(self, *exc: object) -> None:
        _tracking.sets, _tracking.tracker = self.previous

    def pending(self) -> list[DataReport]:
        """Reports (this process's records) of the datasets read inside and not reported by the tool itself."""
        out = []
        for ds in self.sets:
            if not getattr(ds, "reported", False) and ds.issues.used:
                split = ds.split if isinstance(ds.split, str) else "+".join(ds.split)
                out.append(report(ds, split) if _safe_collective() else _local(ds, split))
        return out


def report_pending() -> list[str]:
    """The summary lines (`DataReport.line`) of the datasets the running tool read and did not report, marking them
    reported — for a tool whose last line must be its own (the demo's verdict): it prints these earlier, and
    `squad.cli.run` has none left to print after it."""
    tracker = getattr(_tracking, "tracker", None)
    return list(dict.fromkeys(d.line() for d in tracker.pending())) if tracker is not None else []


def register(dataset) -> None:
    """Called by each dataset once its index is built."""
    sets = getattr(_tracking, "sets", None)
    if sets is not None:
        sets.append(dataset)


def _safe_collective() -> bool:
    from squad.distributed import is_distributed

    return not is_distributed()  # at a tool's exit, ranks may not all be here: never start a collective then


def _local(dataset, name: str) -> DataReport:
    dataset.reported = True
    counts = {k: dataset.issues.count(k) for k in KINDS}
    counts["corrupt"] += len(dataset.unreadable_files)
    return DataReport(name=f"{name} (this rank)", root=str(getattr(dataset, "root", "")), samples=len(dataset),
                      missing=int(dataset.missing_files), unindexed=int(dataset.unindexed),
                      lost=int(dataset.lost_samples), **counts)
