"""The sample contract every reader keeps (`SampleDataset`), the interface of the sample pipelines it runs
(`Pipeline`), and `collate`.

A sample is ``{"rgb": float32 [3, H, W] in [0, 1], "targets": {task: value}, "masks": {task: bool}, "id": str}``
with values in the units `Task.decode` gives (`squad.tasks.base`). Augmentation draws come from
``(seed, epoch, index)``, not from global RNG state, so a sample is the same whichever worker or rank loads it; call
`SampleDataset.set_epoch` each epoch (`squad.data.loaders.set_epoch` does) to vary them.

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

Two pipelines keep `Pipeline`: Taskonomy's square crops (`squad.data.transforms.SamplePipeline`) and the
benchmarks' fit-and-pad of any aspect ratio (`squad.data.benchmark.BenchmarkPipeline`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from squad.data.accounting import FileIssues, register
from squad.data.transforms import WrongSizeError
from squad.tasks import DecodeError, Task, TaskOptions, get_task, resolve_task_names

logger = logging.getLogger(__name__)

_MAX_SKIP = 64  # consecutive unreadable samples before giving up


class CorruptFileError(OSError):
    """A data file could not be read (truncated, bad PNG chunk, bad .npy header)."""


class EmptyDatasetError(ValueError):
    """A split selects no samples."""


class UnusableDataError(ValueError):
    """Training met only unusable samples (every one of a small dataset, or `_MAX_SKIP` in a row): bad input (exit 2),
    named with the last file found bad."""

    def __init__(self, message: str):
        # torch's DataLoader re-raises a worker's exception as ``type(text)`` with the worker's traceback in the text:
        # keep the message alone (the tools print it as one ``error:`` line)
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


class Pipeline(Protocol):
    """What a reader needs of its sample pipeline: the domains a sample reads, whether it augments, how one raw array
    is stored (the packer), and the raw arrays of one sample → ``(rgb, targets, masks)``."""

    augment: bool

    @property
    def domains(self) -> list[str]:
        """Domains read per sample, ``"rgb"`` first."""

    def task(self, domain: str) -> Task:
        """The pipeline's task for a domain."""

    def prepare_raw(self, domain: str, raw: np.ndarray, size: int | None = None) -> np.ndarray:
        """One raw array as it is stored at a packed ``size`` (None: the pipeline's own)."""

    def __call__(self, raws: dict[str, np.ndarray | None], rng: np.random.Generator | None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``{domain: raw array or None}`` → rgb [3, H, W], targets and masks per task; ``rng`` draws the
        augmentation (None: none)."""


class SampleDataset(Dataset):
    """The sample logic every reader shares (Taskonomy trees, PASCAL-Context / NYUD-v2 trees, HDF5 shards): index,
    presence bits, unusable-file accounting, substitution in training and omission in evaluation.

    Subclasses fill `_ids` (``str`` array), `_present` (``int64`` bit mask over `domains`), call `_indexed` once
    the index is built, and implement `_read`.

    Args:
        tasks: task names or aliases (``"all"``).
        pipeline: builds the sample pipeline from the dataset's `Task` objects (e.g.
            ``functools.partial(SamplePipeline, image_size=64)``).
        missing: ``"skip"`` leaves out samples lacking a task's file; ``"mask"`` keeps them masked.
        seed: augmentation seed.
        task_options: the options of the model the data is for (``model.task_options``).
    """

    def __init__(self, tasks: str | Sequence[str], pipeline: Callable[[list[Task]], Pipeline],
                 missing: Literal["skip", "mask"] = "skip", seed: int = 0,
                 task_options: TaskOptions | None = None) -> None:
        if missing not in ("skip", "mask"):
            raise ValueError(f"missing must be 'skip' or 'mask', got {missing!r}")
        self.tasks = resolve_task_names(tasks)
        self.task_options = {str(k): dict(v or {}) for k, v in (task_options or {}).items()}
        self.pipeline = pipeline(self.task_objects())
        self.domains = self.pipeline.domains
        self.task_domains = [t.domain for t in self.task_objects()]
        self.required = ["rgb", *self.task_domains] if missing == "skip" else ["rgb"]
        self.missing = missing
        self.seed = seed
        self.epoch = 0
        self.integer_batches = False  # __getitems__ gives integer samples (`squad.data.device`); __getitem__ never
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
        self._last_problem = ""  # the last unusable file this process met, for `UnusableDataError`

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

    def identity(self, probes: int = 4) -> dict:
        """What a resume compares to know it reads the data a checkpoint was trained on
        (`squad.train.tags.check_same_data`): the sample count and a fingerprint of the index (every sample
        id, in order) and of the raw rgb bytes of ``probes`` samples spread over it — the same data moved elsewhere
        keeps it, another dataset (or another render of one) does not."""
        digest = hashlib.sha256(np.ascontiguousarray(self._ids).view(np.uint8))  # no copy of a large index
        n = len(self)
        for index in sorted({k * n // probes for k in range(probes)}) if n else ():
            try:
                digest.update(np.ascontiguousarray(self._read(index, "rgb")).tobytes())
            except (OSError, DecodeError) as e:  # a corrupt file (counted when training meets it), one gone
                digest.update(type(e).__name__.encode())
        return {"samples": n, "fingerprint": digest.hexdigest()[:16]}

    def without_substitutes(self) -> SampleDataset:
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
        return self._fetch(index)

    def _fetch(self, index: int, integers: bool = False) -> dict[str, Any] | None:
        """`__getitem__`'s sample, or with `integers` the pipeline's integer sample (plus its ``id``)."""
        n = len(self)
        index, epoch = int(index), getattr(index, "epoch", self.epoch)  # the training sampler's index carries it
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        rng = np.random.default_rng([self.seed, epoch, index]) if self.pipeline.augment else None
        self.issues.mark_used()
        if not self.substitute:
            return self._load(index, rng, integers)
        for attempt in range(min(_MAX_SKIP, n)):
            sample = self._load((index + attempt) % n, rng, integers)
            if sample is not None:
                return sample
        what = (f"every one of the {n} samples is" if n <= _MAX_SKIP else
                f"{_MAX_SKIP} consecutive samples from index {index} are")
        raise UnusableDataError(
            f"{getattr(self, 'root', 'the data')}: {what} unusable ({self.num_corrupt} corrupt and "
            f"{self.num_wrong_size} wrong-size files so far; the last: {self._last_problem or 'unknown'}); check the "
            f"data (data.root, or re-make it)")

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The samples of one batch (a DataLoader worker's fetch). With ``integer_batches`` (set by
        `squad.data.build_loader` when the pipeline has an integer stage) they are the pipeline's integer samples
        (`squad.data.transforms.SamplePipeline.integers`, for `squad.data.device.collate_integers`), read through
        `_prefetch` (shards: one contiguous read per run of neighbouring samples and domain); else
        ``[self[i] for i in indices]``."""
        if not self.integer_batches:
            return [self[i] for i in indices]
        t0 = time.thread_time()
        self._prefetch(indices)
        try:
            out = [self._fetch(i, integers=True) for i in indices]
        finally:
            self._prefetch(())
        if out:
            out[0]["cpu_s"] = time.thread_time() - t0  # this thread's CPU seconds for the batch (the run log's rate)
        return out

    # ---------------------------------------------------------------------------------------- internals
    def _prefetch(self, indices: Sequence[int]) -> None:
        """Reads what `indices` need ahead of their `_read` calls (empty: drop it); a no-op unless overridden."""

    def _read(self, index: int, domain: str) -> np.ndarray:
        raise NotImplementedError

    def _describe(self, index: int, domain: str) -> str:
        return f"{self._ids[index]} ({domain})"

    def _load(self, index: int, rng: np.random.Generator | None, integers: bool = False) -> dict[str, Any] | None:
        """One sample (with `integers`: the pipeline's integer sample), or None when it has to be skipped."""
        bits = int(self._present[index])
        raws: dict[str, np.ndarray | None] = {}
        any_bad = self.issues.count("corrupt") or self.issues.count("wrong_size")
        for k, domain in enumerate(self.domains):
            if not bits >> k & 1:
                raws[domain] = None
                continue
            bad = self.issues.known(index, k) if any_bad else None
            if bad is not None:
                self._last_problem = self._last_problem or f"{self._describe(index, domain)}: {bad}"
            else:
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
                if integers:
                    return {**self.pipeline.integers(raws, rng), "id": str(self._ids[index])}
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
        self._last_problem = what
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
