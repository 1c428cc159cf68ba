"""Make data for squad: render a synthetic Taskonomy, or pack a Taskonomy tree into HDF5 shards.

    python tools/make_data.py synthetic --out data/synthetic --n 2000 --image-size 64 --seed 0
    python tools/make_data.py pack --src ROOT --split tiny --out SHARDS --image-size 256
    python tools/make_data.py stats ROOT [--max-images 100] [--split tiny] [--json stats.json] [--strict]

`synthetic` writes Taskonomy's own layout and encodings (all 13 domains + rgb, a split CSV), which the real reader
loads. `pack` stores every domain of each sample, resized to --image-size, in HDF5 shards that
`squad.data.build_dataset` reads with the same sample format, several times faster. `stats` samples views of a
tree (either layout), the synthetic tree or shards and prints, per domain, code and target-space statistics beside
the ranges real Taskonomy files show, flagging values outside them (`squad.data.offline.stats`): how to check a
download.
Exit codes: 0 done (flags are reported, not failures), 1 with --strict when a statistic is outside its real range,
2 bad input (no such root, no domain folder, unknown split or domain, an --out that cannot be written), 3 a file
could not be written (a full disk: the file and the free space are named, and what synthetic or pack had written
is removed, so rerunning the same command starts clean).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from squad.cli import run
from squad.config.tools import PackConfig, defaults, from_namespace

SYNTHETIC_SIZES = {"taskonomy": 64, "pascal_context": 128, "nyud": 128}  # default --image-size per dataset


def _synthetic(args: argparse.Namespace) -> None:
    size = SYNTHETIC_SIZES[args.dataset] if args.image_size is None else args.image_size
    if args.buildings is not None and args.dataset != "taskonomy":
        raise ValueError(f"--buildings applies to --dataset taskonomy only, not {args.dataset}")
    try:  # lazy: only this subcommand needs the renderer
        if args.dataset == "pascal_context":
            from squad.data.synthetic.pascal import render_pascal as render
        elif args.dataset == "nyud":
            from squad.data.synthetic.nyud import render_nyud as render
        else:
            from squad.data.synthetic.taskonomy import render_dataset
    except ModuleNotFoundError as e:
        raise ValueError(f"the synthetic renderer is not available ({e})") from e

    from squad.io.files import check_writable

    check_writable(args.out, "--out", folder=True)
    t0 = time.perf_counter()
    if args.dataset == "taskonomy":
        root = render_dataset(args.out, n=args.n, image_size=size, seed=args.seed, buildings=args.buildings,
                              overwrite=args.overwrite)
    else:
        root = render(args.out, n=args.n, image_size=size, seed=args.seed, overwrite=args.overwrite)
    elapsed = time.perf_counter() - t0
    print(f"rendered {args.n} {args.dataset} samples at {size} px into {args.out} ({root}) in {elapsed:.1f} s "
          f"({args.n / max(elapsed, 1e-9):.1f} images/s)")


def _pack(args: argparse.Namespace) -> None:
    from squad.data import build_dataset
    from squad.data.offline.pack import pack_shards

    t0 = time.perf_counter()
    index = pack_shards(args.src, args.out, from_namespace(PackConfig, args))
    elapsed = time.perf_counter() - t0
    info = json.loads(index.read_text())
    print(f"packed {args.src} into {args.out} in {elapsed:.1f} s")
    left = {k: info.get(k, 0) for k in ("corrupt", "wrong_size", "missing")}
    print(f"data {args.src}: " + (", ".join(f"{n} {k.replace('_', '-')} file{'s' if n != 1 else ''}"
                                            for k, n in left.items() if n) + " left out (stored as absent)"
                                  if any(left.values()) else "every file read"))
    if info.get("no_target"):
        n = info["no_target"]
        print(f"data {args.src}: {n} sample{'s' if n != 1 else ''} left out: none of {'their' if n != 1 else 'its'} "
              f"target files was usable")
    print(f"{'split':<8}{'shards':>8}{'samples':>10}")
    for part in dict.fromkeys(s["split"] for s in info["shards"]):
        shards = [s for s in info["shards"] if s["split"] == part]
        print(f"{part:<8}{len(shards):>8}{sum(s['n'] for s in shards):>10}")
    build_dataset(args.out, [d for d in info["domains"] if d != "rgb"], split="all", missing="mask")  # readable


def _stats(args: argparse.Namespace) -> int:
    from squad.data.offline.stats import dataset_stats
    from squad.io.files import atomic_write_text

    t0 = time.perf_counter()
    result = dataset_stats(args.root, max_images=args.max_images or None, split=args.split,
                           partitions=args.partitions, domains=args.domains)
    print(result.table(full=args.full))
    print(f"read {result.views} views in {time.perf_counter() - t0:.1f} s")
    if args.json:
        atomic_write_text(args.json, json.dumps(result.to_dict(), indent=1), "the statistics")
        print(f"wrote {args.json}")
    if args.strict and result.outside:
        print(f"error: {len(result.outside)} statistics outside the real ranges (--strict)", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/make_data.py`` / ``squad-make-data`` (``synthetic``, ``pack``, ``stats``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    syn = sub.add_parser("synthetic", help="render a synthetic dataset in Taskonomy's, PASCAL_MT's or NYUD_MT's layout")
    syn.add_argument("--dataset", choices=sorted(SYNTHETIC_SIZES), default="taskonomy",
                     help="layout to write: taskonomy (default), pascal_context (PASCAL_MT) or nyud (NYUD_MT)")
    syn.add_argument("--out", required=True, help="output folder")
    syn.add_argument("--n", "--images", type=int, default=2000, help="number of images")
    syn.add_argument("--image-size", type=int, default=None,
                     help="taskonomy: image side (default 64); pascal_context: long side (default 128, aspect "
                          "varies per image); nyud: width (default 128, height 3/4 of it)")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--buildings", type=int, default=None, help="number of buildings (default: the renderer's)")
    syn.add_argument("--overwrite", action="store_true", help="replace an earlier synthetic render of the same "
                     "dataset in --out (a folder holding anything else is still refused)")
    syn.set_defaults(func=_synthetic)

    pack = sub.add_parser("pack", help="pack a Taskonomy tree into HDF5 shards")  # defaults: PackConfig
    pack.add_argument("--dataset", choices=["taskonomy", "pascal_context", "nyud"],
                      help="what --src holds (default: detected from its layout)")
    pack.add_argument("--src", required=True, help="Taskonomy root (either layout), PASCAL_MT or NYUD folder")
    pack.add_argument("--out", required=True, help="output shard folder")
    pack.add_argument("--split", help="split CSV: a path or a name (tiny, medium, full, fullplus, synthetic); "
                                      "default: the one train_val_test_*.csv in --src")
    pack.add_argument("--partitions", nargs="+", help="which partitions to pack (default: train val test)")
    pack.add_argument("--image-size", type=int, help="stored size (default 256); 0 keeps the file size")
    pack.add_argument("--shard-size", type=int, help="samples per shard file (default 1024)")
    pack.add_argument("--domains", nargs="+", help="domains to pack (default: all present)")
    pack.add_argument("--compression", choices=["lzf", "gzip"], help="default: none (fastest reads)")
    pack.add_argument("--workers", type=int, help="reader processes (default 2)")
    pack.set_defaults(func=_pack, **defaults(PackConfig))

    st = sub.add_parser("stats", help="statistics of a dataset beside real Taskonomy's (check a download)",
                        description="Per domain: code and target-space statistics, masked share, ids per image, "
                                    "class spread, beside the real files' ranges (flagged when outside).")
    st.add_argument("root", type=Path, help="a Taskonomy tree (either layout), the synthetic tree or a shard folder")
    st.add_argument("--max-images", type=int, default=100,
                    help="views to sample, evenly across buildings (0: every view)")
    st.add_argument("--split", default=None,
                    help="train, val, test or all (of the one split CSV / of the shards), or a split CSV name or "
                         "path (tiny, medium, full, fullplus, synthetic); default: every building on disk")
    st.add_argument("--partitions", nargs="+", default=["train", "val", "test"],
                    help="the partitions a named split CSV contributes")
    st.add_argument("--domains", nargs="+", default=None, help="domains or aliases (default: the 13 tasks)")
    st.add_argument("--json", type=Path, default=None, help="also write every statistic to this JSON file")
    st.add_argument("--full", action="store_true", help="show every statistic, not only the main ones")
    st.add_argument("--strict", action="store_true",
                    help="exit 1 when a statistic is outside its real range")
    st.set_defaults(func=_stats)
    return parser


def _make_data(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


def main(argv: list[str] | None = None) -> int:
    """Renders, packs or checks a dataset; exit 1 for --strict stats out of range, 2 on bad input (`squad.cli.run`)."""
    return run(_make_data, argv)


if __name__ == "__main__":
    sys.exit(main())
