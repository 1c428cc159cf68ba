"""Where the sampled views come from: a Taskonomy tree (either layout, split CSVs as the reader takes them) or HDF5
shards, sampled evenly across buildings (`sample_views`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from squad.data.offline.stats.references import GEOMETRY
from squad.data.samples import CorruptFileError
from squad.data.shards import FORMAT, INDEX_NAME
from squad.data.taskonomy import (
    SPLITS,
    domain_dir,
    file_ext,
    find_split_csv,
    list_stems,
    make_data_hint,
    read_raw,
    read_split_csv,
)


# ---------------------------------------------------------------------------------------------- sources
def sample_views(groups: dict[str, Sequence[str]], max_images: int | None) -> list[tuple[str, str]]:
    """Chooses views evenly across buildings (module docstring), deterministically.

    Args:
        groups: building → its view stems (any order; sorted here).
        max_images: the most views to take (None: all).

    Returns:
        ``(building, stem)`` pairs, buildings in sorted order.
    """
    names = sorted(b for b, stems in groups.items() if len(stems))
    total = sum(len(groups[b]) for b in names)
    budget = total if max_images is None else min(int(max_images), total)
    quota: dict[str, int] = {}
    if budget < len(names):  # more buildings than views: one each from evenly spaced buildings
        picks = set(np.linspace(0, len(names) - 1, budget).round().astype(int).tolist()) if budget else set()
        quota = {b: int(i in picks) for i, b in enumerate(names)}
    else:  # water filling, smallest buildings first: each takes its share or all it has
        left = budget
        for i, b in enumerate(sorted(names, key=lambda b: (len(groups[b]), b))):
            quota[b] = min(len(groups[b]), left // (len(names) - i))
            left -= quota[b]
    out = []
    for b in names:
        stems = sorted(groups[b])
        q = quota.get(b, 0)
        if q == 1:
            out.append((b, stems[len(stems) // 2]))
        elif q:
            out.extend((b, stems[i]) for i in np.linspace(0, len(stems) - 1, q).round().astype(int))
    return out


class TreeSource:
    """Views of a Taskonomy tree (either layout)."""

    kind = "tree"

    def __init__(self, root: Path, domains: list[str], split: str | None, partitions: Sequence[str],
                 max_images: int | None) -> None:
        self.root = root
        self.dirs = {d: domain_dir(root, d) for d in ["rgb", *domains]}
        self.present = [d for d in domains if self.dirs[d] is not None]
        self.absent = [d for d in domains if self.dirs[d] is None]
        self.layouts = {d: ("{domain}/taskonomy/{building}" if p.name == "taskonomy" else "{domain}/{building}")
                        for d, p in self.dirs.items() if p is not None}
        ref = next((d for d in ("rgb", GEOMETRY, *domains) if self.dirs.get(d) is not None), None)
        if ref is None:
            raise FileNotFoundError(f"no Taskonomy domain folder in {root} (looked for rgb and "
                                    f"{', '.join(domains)} in either layout). {make_data_hint(root)}")
        self.listed = ref
        on_disk = sorted(e.name for e in os.scandir(self.dirs[ref]) if e.is_dir())
        self.split_csv: str | None = None
        if split is None:
            buildings = on_disk
        else:
            csv = find_split_csv(root, None if split in (*SPLITS, "all") else split)
            if csv is None:
                raise ValueError(f"no split CSV (train_val_test_*.csv) in {root}: --split {split} needs one")
            self.split_csv = str(csv)
            table = read_split_csv(csv)
            chosen = SPLITS if split == "all" else [split] if split in SPLITS else list(partitions)
            wanted = list(dict.fromkeys(b for s in chosen for b in table[s]))
            have = set(on_disk)
            self.unlisted = [b for b in wanted if b not in have]
            buildings = [b for b in wanted if b in have]
        self.buildings = buildings
        self.views = self._sample(buildings, max_images)

    def _sample(self, buildings: list[str], max_images: int | None) -> list[tuple[str, str]]:
        folder = self.dirs[self.listed]
        if max_images is not None and len(buildings) > max_images:  # list only the buildings that give a view
            picks = sorted(set(np.linspace(0, len(buildings) - 1, max_images).round().astype(int).tolist()))
            buildings = [buildings[i] for i in picks]
        groups = {b: list_stems(folder / b, self.listed) for b in buildings}
        return sample_views(groups, max_images)

    def name(self, view: tuple[str, str], domain: str) -> str:
        b, stem = view
        return str(self.dirs[domain] / b / f"{stem}_domain_{domain}{file_ext(domain)}")

    def read(self, view: tuple[str, str], domain: str) -> np.ndarray:
        """The raw file (FileNotFoundError when the view lacks it; CorruptFileError)."""
        return read_raw(self.name(view, domain))

    def describe(self) -> str:
        layouts = sorted(set(self.layouts.values()))
        return f"Taskonomy tree, layout {' and '.join(layouts)}"


class ShardSource:
    """Views of HDF5 shards written by ``make_data.py pack``."""

    kind = "shards"

    def __init__(self, root: Path, domains: list[str], split: str | None, partitions: Sequence[str],
                 max_images: int | None) -> None:
        import h5py

        self.root = root
        self.index = json.loads((root / INDEX_NAME).read_text())
        if self.index.get("format") != FORMAT:
            raise ValueError(f"{root / INDEX_NAME}: not a squad shard index (format {self.index.get('format')!r})")
        packed = self.index["domains"]
        self.present = [d for d in domains if d in packed]
        self.absent = [d for d in domains if d not in packed]
        if split is not None and split not in (*SPLITS, "all"):
            raise ValueError(f"--split {split!r}: shards were split when packed; use one of "
                             f"{', '.join((*SPLITS, 'all'))} (packed: "
                             f"{sorted({s['split'] for s in self.index['shards']})})")
        chosen = None if split in (None, "all") else [split] if split in SPLITS else list(partitions)
        self.files = [s["file"] for s in self.index["shards"] if chosen is None or s["split"] in chosen]
        self.split_csv = self.index.get("split_csv")
        self.cols = {d: packed.index(d) for d in self.present}
        groups: dict[str, list[str]] = {}
        self.where: dict[tuple[str, str], tuple[int, int, np.ndarray]] = {}
        self.unreadable: list[str] = []  # shard files that cannot be opened, with the samples they held
        sizes = {s["file"]: int(s.get("n", 0)) for s in self.index["shards"]}
        for fi, name in enumerate(self.files):
            try:
                with h5py.File(root / name, "r") as f:
                    ids = f["id"].asstr()[...]
                    present = f["present"][...]
            except (OSError, KeyError, ValueError) as e:  # truncated, not HDF5, or without squad's datasets
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.unreadable.append(f"{root / name}: {reason[:200]} ({sizes.get(name, 0)} samples lost)")
                continue
            for row, sid in enumerate(ids):
                b, _, stem = str(sid).partition("/")
                groups.setdefault(b, []).append(stem)
                self.where[(b, stem)] = (fi, row, present[row])
        self.buildings = sorted(groups)
        self.views = sample_views(groups, max_images)
        self._handles: dict[int, Any] = {}

    def name(self, view: tuple[str, str], domain: str) -> str:
        fi, row, _ = self.where[view]
        return f"{self.root / self.files[fi]}[{row}] {view[0]}/{view[1]} ({domain})"

    def read(self, view: tuple[str, str], domain: str) -> np.ndarray:
        import h5py

        fi, row, present = self.where[view]
        if not present[self.cols[domain]]:
            raise FileNotFoundError(self.name(view, domain))
        try:
            if fi not in self._handles:
                self._handles[fi] = h5py.File(self.root / self.files[fi], "r")
            return self._handles[fi][domain][row]
        except (OSError, KeyError) as e:
            raise CorruptFileError(f"unreadable {self.name(view, domain)}: {e}") from e

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles = {}

    def describe(self) -> str:
        return f"HDF5 shards ({len(self.files)} files, stored at {self.index.get('image_size')} px)"


