"""Make data for squad: render a synthetic Taskonomy, or pack a Taskonomy tree into HDF5 shards.

    python tools/make_data.py synthetic --out data/synthetic --n 2000 --image-size 64 --seed 0
    python tools/make_data.py pack --src ROOT --split tiny --out SHARDS --image-size 256

`synthetic` writes Taskonomy's own layout and encodings (all 13 domains + rgb, a split CSV), which the real reader
loads. `pack` stores every domain of each sample, resized to --image-size, in HDF5 shards that
`squad.data.build_dataset` reads with the same sample format, several times faster.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from squad.cli import run


def _synthetic(args: argparse.Namespace) -> None:
    try:
        from squad.data.synthetic import render_dataset  # lazy: only this subcommand needs the renderer
    except ModuleNotFoundError as e:
        raise ValueError(f"the synthetic renderer is not available ({e})") from e

    t0 = time.perf_counter()
    root = render_dataset(args.out, n=args.n, image_size=args.image_size, seed=args.seed, buildings=args.buildings)
    print(f"rendered {args.n} samples at {args.image_size} px into {args.out} ({root}) in "
          f"{time.perf_counter() - t0:.1f} s")


def _pack(args: argparse.Namespace) -> None:
    from squad.data import ShardDataset, pack_shards

    t0 = time.perf_counter()
    index = pack_shards(args.src, args.out, split_csv=args.split, splits=args.partitions,
                        image_size=args.image_size or None, shard_size=args.shard_size,
                        domains=args.domains, compression=args.compression, workers=args.workers)
    elapsed = time.perf_counter() - t0
    info = json.loads(index.read_text())
    print(f"packed {args.src} into {args.out} in {elapsed:.1f} s")
    left = {k: info.get(k, 0) for k in ("corrupt", "wrong_size", "missing")}
    print(f"data {args.src}: " + (", ".join(f"{n} {k.replace('_', '-')} file{'s' if n != 1 else ''}"
                                            for k, n in left.items() if n) + " left out (stored as absent)"
                                  if any(left.values()) else "every file read"))
    print(f"{'split':<8}{'shards':>8}{'samples':>10}")
    for part in dict.fromkeys(s["split"] for s in info["shards"]):
        shards = [s for s in info["shards"] if s["split"] == part]
        print(f"{part:<8}{len(shards):>8}{sum(s['n'] for s in shards):>10}")
    ShardDataset(args.out, [d for d in info["domains"] if d != "rgb"], split="all", missing="mask")  # readable


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/make_data.py`` / ``squad-make-data`` (subcommands ``synthetic`` and ``pack``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    syn = sub.add_parser("synthetic", help="render a synthetic Taskonomy-format dataset")
    syn.add_argument("--out", required=True, help="output folder")
    syn.add_argument("--n", type=int, default=2000, help="number of images")
    syn.add_argument("--image-size", type=int, default=64, help="image side in pixels")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--buildings", type=int, default=None, help="number of buildings (default: the renderer's)")
    syn.set_defaults(func=_synthetic)

    pack = sub.add_parser("pack", help="pack a Taskonomy tree into HDF5 shards")
    pack.add_argument("--src", required=True, help="Taskonomy root (either layout)")
    pack.add_argument("--out", required=True, help="output shard folder")
    pack.add_argument("--split", default=None,
                      help="split CSV: a path or a name (tiny, medium, full, fullplus, synthetic); "
                           "default: the one train_val_test_*.csv in --src")
    pack.add_argument("--partitions", nargs="+", default=["train", "val", "test"], help="which partitions to pack")
    pack.add_argument("--image-size", type=int, default=256, help="stored size; 0 keeps the file size")
    pack.add_argument("--shard-size", type=int, default=1024, help="samples per shard file")
    pack.add_argument("--domains", nargs="+", default=None, help="domains to pack (default: all present)")
    pack.add_argument("--compression", choices=["lzf", "gzip"], default=None, help="default: none (fastest reads)")
    pack.add_argument("--workers", type=int, default=2, help="reader processes")
    pack.set_defaults(func=_pack)
    return parser


def _make_data(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.func(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Renders or packs a dataset; exit 2 on bad input (`squad.cli.run`)."""
    return run(_make_data, argv)


if __name__ == "__main__":
    sys.exit(main())
