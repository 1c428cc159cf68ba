"""Bench case ``data``: reading HDF5 shards against reading the PNG tree, all 13 domains, images per second.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from torch.utils.data import DataLoader

from squad.data.offline.pack import pack_shards
from squad.data.offline.random_tree import write_random_tree
from squad.data.samples import collate
from squad.data.shards import ShardDataset
from squad.data.taskonomy import TaskonomyDataset
from squad.timing import BenchResult, ratio_row, time_interleaved


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
        pack_shards(tree, shards, image_size=size, partitions=("train",), workers=2)
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
