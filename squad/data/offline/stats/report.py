"""The statistics of a dataset beside the reference ranges (`Stat`, `DomainStats`, `DatasetStats`: flags, text table,
JSON) and the driver that samples, accumulates and reports (`dataset_stats`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from squad.data.offline.stats.accumulators import (
    SHOWN,
    DomainAccumulator,
    GeometryAccumulator,
    accumulator_for,
    as_numpy,
)
from squad.data.offline.stats.references import GEOMETRY, REFERENCES, SOURCES, TOLERANCE, VALID, Reference, fmt, label
from squad.data.offline.stats.sources import ShardSource, TreeSource
from squad.data.samples import CorruptFileError
from squad.data.shards import is_shard_root
from squad.data.taskonomy import SPLITS, make_data_hint
from squad.data.transforms import compact_rgb
from squad.tasks import TASK_NAMES, DecodeError, get_task, resolve_task_names

RGB = "rgb"  # the images: every sampled view's is read and checked


# ---------------------------------------------------------------------------------------------- results
@dataclasses.dataclass
class Stat:
    """One statistic of one domain, with its real range when there is one."""

    key: str
    value: float
    reference: Reference | None = None

    @property
    def flag(self) -> str:
        """``""``, ``"LOW"``, ``"HIGH"`` or ``"n/a"`` (only statistics with a reference are flagged)."""
        return self.reference.flag(self.value) if self.reference is not None else ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "label": label(self.key),
                               "value": None if not math.isfinite(self.value) else self.value}
        if self.reference is not None:
            r = self.reference
            out.update(real=[r.lo, r.hi if math.isfinite(r.hi) else None],
                       accepted=[v if math.isfinite(v) else None for v in r.accepted],
                       source=SOURCES[r.source], note=r.note, flag=self.flag)
        return out


@dataclasses.dataclass
class DomainStats:
    """What was read of one domain and its statistics.

    Attributes:
        domain: the domain (or ``"valid pixels"`` for the geometry mask).
        files: files read and used.
        missing: sampled views lacking the file.
        corrupt: the files that could not be read or decoded (named, with the reason).
        stats: every statistic, in the accumulator's order.
    """

    domain: str
    files: int = 0
    missing: int = 0
    corrupt: list[str] = dataclasses.field(default_factory=list)
    stats: list[Stat] = dataclasses.field(default_factory=list)

    @property
    def outside(self) -> list[Stat]:
        """Statistics outside their real range."""
        return [s for s in self.stats if s.flag in ("LOW", "HIGH")]

    def get(self, key: str) -> float:
        """The value of one statistic (KeyError naming the known keys)."""
        for s in self.stats:
            if s.key == key:
                return s.value
        raise KeyError(f"{self.domain}: no statistic {key!r} (have {', '.join(s.key for s in self.stats)})")


@dataclasses.dataclass
class DatasetStats:
    """The result of `dataset_stats`: per-domain statistics and what could not be read."""

    root: str
    source: str
    views: int
    buildings: int
    split: str
    domains: dict[str, DomainStats]
    absent: list[str]
    buildings_not_found: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)  # shard files that cannot be opened (skipped)

    @property
    def outside(self) -> list[tuple[str, Stat]]:
        """(domain, statistic) pairs outside their real range."""
        return [(d, s) for d, ds in self.domains.items() for s in ds.outside]

    @property
    def corrupt(self) -> list[str]:
        """Every file that could not be read or decoded."""
        return [c for ds in self.domains.values() for c in ds.corrupt]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``--json``)."""
        return {"root": self.root, "source": self.source, "views": self.views, "buildings": self.buildings,
                "split": self.split, "tolerance": TOLERANCE, "absent_domains": self.absent,
                "buildings_not_found": self.buildings_not_found, "unreadable_files": self.unreadable,
                "outside": [f"{d}: {s.key}" for d, s in self.outside],
                "domains": {d: {"files": ds.files, "missing": ds.missing, "corrupt": ds.corrupt,
                                "stats": [s.to_dict() for s in ds.stats]} for d, ds in self.domains.items()}}

    def table(self, full: bool = False) -> str:
        """The readable report: per domain, statistic | value | real range | accepted | flag | source.

        Args:
            full: show every statistic, not only the chosen ones (the referenced ones are always shown).
        """
        w = (44, 10, 12, 18, 5)
        lines = [f"statistics of {self.root} ({self.source}; split {self.split}): {self.views} views from "
                 f"{self.buildings} buildings",
                 f"real = the range real Taskonomy files show; accepted = real widened by {TOLERANCE:.0%} of its "
                 f"larger bound (single views are indicative)"]
        lines += [f"{'sources:' if i == 0 else '':<9}{k} = {v}" for i, (k, v) in enumerate(SOURCES.items())]
        if self.buildings_not_found:
            shown = ", ".join(self.buildings_not_found[:10]) + (" ..." if len(self.buildings_not_found) > 10 else "")
            lines.append(f"{len(self.buildings_not_found)} buildings of the split have no files here: {shown}")
        if self.absent:
            lines.append(f"absent domains (not in this dataset): {', '.join(self.absent)}")
        for name in self.unreadable:
            lines.append(f"unreadable shard file, skipped: {name}")
        for domain, ds in self.domains.items():
            lines.append("")
            what = f"{ds.files} files"
            if ds.missing:
                what += f", {ds.missing} missing"
            if ds.corrupt:
                what += f", {len(ds.corrupt)} corrupt"
            lines.append(f"== {domain} ({what})")
            for name in ds.corrupt[:5]:
                lines.append(f"   corrupt: {name}")
            if len(ds.corrupt) > 5:
                lines.append(f"   ... and {len(ds.corrupt) - 5} more corrupt files")
            if not ds.stats:
                continue
            lines.append(f"   {'statistic':<{w[0]}}{'value':>{w[1]}}  {'real':<{w[2]}}{'accepted':<{w[3]}}"
                         f"{'flag':<{w[4]}} source")
            shown = set(SHOWN.get(domain, [s.key for s in ds.stats]))
            for s in ds.stats:
                if not (full or s.key in shown or s.reference is not None):
                    continue
                r = s.reference
                real = r.stated() if r else ""
                acc = f"{fmt(r.accepted[0])}…{fmt(r.accepted[1])}" if r else ""
                lines.append(f"   {label(s.key):<{w[0]}}{fmt(s.value):>{w[1]}}  {real:<{w[2]}}{acc:<{w[3]}}"
                             f"{s.flag:<{w[4]}} {r.source if r else ''}".rstrip())
        out = self.outside
        lines.append("")
        lines.append(f"{len(out)} statistic{'s' if len(out) != 1 else ''} outside the real ranges"
                     + (": " + ", ".join(f"{d} {s.key}" for d, s in out) if out else ""))
        bad = len(self.corrupt) + len(self.unreadable)
        if bad:
            lines.append(f"{bad} corrupt file{'s' if bad != 1 else ''} (named above)")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- driver
def dataset_stats(root: str | Path, max_images: int | None = 100, split: str | None = None,
                  partitions: Sequence[str] = SPLITS, domains: Iterable[str] | None = None) -> DatasetStats:
    """Statistics of a Taskonomy tree, the synthetic tree or packed shards beside the real files' ranges.

    Args:
        root: a Taskonomy root (either layout) or a shard folder (holds ``shards.json``).
        max_images: the most views to sample (evenly across buildings; None: every view).
        split: None: every building on disk (every packed shard); ``"train"``, ``"val"``, ``"test"`` or ``"all"``:
            that partition of the one split CSV in `root` (of the shards); a CSV name (``"tiny"``) or path: the
            buildings of `partitions` in that CSV (trees only).
        partitions: the partitions a named CSV contributes.
        domains: task domains or aliases to look at (default: the 13); depth_zbuffer is read for the valid mask
            whenever it exists.

    Returns:
        A `DatasetStats`; ``.table()`` prints it, ``.outside`` lists the statistics out of range.

    Raises:
        FileNotFoundError: `root` does not exist or holds no domain folder.
        ValueError: no views to read, or a bad split.
    """

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {root} does not exist. {make_data_hint(root)}")
    if max_images is not None and max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    names = list(TASK_NAMES) if domains is None else resolve_task_names(list(domains))
    wanted = list(dict.fromkeys([RGB, *names, GEOMETRY]))
    source_cls = ShardSource if is_shard_root(root) else TreeSource
    source = source_cls(root, wanted, split, partitions, max_images)
    unreadable = list(getattr(source, "unreadable", []))
    if not source.views:
        absent = getattr(source, "unlisted", [])
        raise ValueError(f"no views to read in {root} (split {split or 'all buildings'}; {len(source.buildings)} "
                         f"buildings with files" + (f"; not here: {', '.join(absent[:10])}" if absent else "")
                         + (f"; unreadable: {'; '.join(unreadable)}" if unreadable else "")
                         + f"). {make_data_hint(root)}")
    shown = [d for d in names if d in source.present]
    accs: dict[str, DomainAccumulator] = {d: accumulator_for(d) for d in shown}
    results = {d: DomainStats(d) for d in ([RGB] if RGB in source.present else [])
               + ([VALID] if GEOMETRY in source.present else []) + shown}
    geometry_acc = GeometryAccumulator()
    try:
        with _one_thread():
            _accumulate(source, shown, accs, geometry_acc, results)
    finally:
        if isinstance(source, ShardSource):
            source.close()
    for d, ds in results.items():
        if d == RGB:  # read and checked (named when corrupt), no statistics
            continue
        acc = geometry_acc if d == VALID else accs[d]
        if ds.files:
            refs = REFERENCES.get(d, {})
            ds.stats = [Stat(k, float(v), refs.get(k)) for k, v in acc.summary().items()]
    split_name = split or "all buildings on disk"
    if isinstance(source, TreeSource) and source.split_csv:
        split_name = f"{split} of {Path(source.split_csv).name}"
    return DatasetStats(root=str(root), source=source.describe(), views=len(source.views),
                        buildings=len({b for b, _ in source.views}), split=split_name, domains=results,
                        absent=[d for d in names if d not in source.present],
                        buildings_not_found=list(getattr(source, "unlisted", [])), unreadable=unreadable)


def _accumulate(source: TreeSource | ShardSource, shown: list[str], accs: dict[str, DomainAccumulator],
                geometry_acc: GeometryAccumulator, results: dict[str, DomainStats]) -> None:
    """Reads every sampled view once per domain into the accumulators; missing and bad files are counted (the rgb
    image too: a truncated, empty or non-8-bit one is named, as the reader and `pack` would refuse it)."""
    for view in source.views:
        if RGB in results:
            try:
                compact_rgb(source.read(view, RGB))
                results[RGB].files += 1
            except FileNotFoundError:
                results[RGB].missing += 1
            except (CorruptFileError, DecodeError) as e:
                results[RGB].corrupt.append(f"{source.name(view, RGB)}: {_reason(e)}")
        geometry = None
        if GEOMETRY in source.present:
            try:
                geometry = _geometry(source.read(view, GEOMETRY))
                geometry_acc.add(None, geometry)  # type: ignore[arg-type]
                results[VALID].files += 1
            except FileNotFoundError:
                results[VALID].missing += 1
            except (CorruptFileError, DecodeError) as e:
                results[VALID].corrupt.append(f"{source.name(view, GEOMETRY)}: {_reason(e)}")
        for d in shown:
            try:
                accs[d].add(source.read(view, d), geometry)
                results[d].files += 1
            except FileNotFoundError:
                results[d].missing += 1
            except (CorruptFileError, DecodeError) as e:
                results[d].corrupt.append(f"{source.name(view, d)}: {_reason(e)}")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one intra-op thread meanwhile: per-file tensors are small, and threads only contend on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _geometry(raw: np.ndarray) -> np.ndarray:
    """depth_zbuffer's valid pixels ``bool [H, W]`` (code ≠ 65535)."""
    task = get_task(GEOMETRY)
    _, mask = task.decode(raw)  # validates the encoding
    return as_numpy(mask)[0].astype(bool)


def _reason(e: BaseException) -> str:
    text = str(e)
    return text.split(": ", 1)[-1] if text.startswith("corrupt file ") else text
