"""Run any squad model on image files and write readable pictures and raw values per task.

    python tools/predict.py --checkpoint runs/demo --images photos/ --out predictions
    python tools/predict.py --checkpoint runs/demo/depth_theta0.01.pt --images a.jpg b.png --out pred --encode taskonomy
    python tools/predict.py --checkpoint runs/mone --images photos/ --out pred --tasks depth normal --mone-capacity 0.5

The checkpoint is anything squad.load opens: a run folder, model.pt, a checkpoint tag, an extracted single-task
model (tools/extract.py), an adapted MoD / A-MoD model (tools/adapt_pretrained.py); MoD, A-MoD and MoNE models take
--mod-inference / --mone-capacity as in tools/evaluate.py. --tasks (names or aliases; default: all of the model's)
picks the heads to run; all run in one fused pass per batch.

Images: files, or folders (their .jpg/.jpeg/.png files, sorted; not recursive), any size and mode. Each image's
centred square (side min(H, W)) is resized to the model's img_size with the evaluation pipeline's resize — the
same input tools/evaluate.py gives a square image; not tiled. Outputs are at img_size; predictions.json records
each image's crop box in the original pixels (upsample a .npy onto it for a full-size map).

Outputs, in OUT/<image stem>/: <task>.png, a readable picture (depth and curvature colour maps, normals as RGB,
edges grey, keypoints heat maps, segment palettes, reshading grey), or <task>.json, the top-5 classes of a class
task (index, probability; names with --class-names TASK=FILE); and the raw values: <task>.npy in task units
(metres, unit normals, probabilities; float32 [C, H, W]), or with --encode taskonomy <task>_taskonomy.png in the
dataset's own encoding (16-bit depth in 1/512 m, 8-bit normals, ...). OUT/predictions.json summarises the run.

A file that cannot be read (corrupt, not an image) is reported on stderr and in predictions.json and skipped; the
run goes on. Exit status: 0 every image written; 1 some were skipped; 2 bad input (a missing path, no images, a
task the model lacks, a bad checkpoint or setting, an --out that cannot be written); 3 a file could not be written
(a full disk: the file and the free space are named; every file is whole or absent, and predictions.json, written
last, lists only complete runs). The progress bar (stderr) shows on a terminal unless --quiet.
"""

from __future__ import annotations

import argparse
import logging
import sys

from squad.cli import device_arg, require_paths, run
from squad.cli.evaluate import add_compile_argument, add_inference_arguments, add_precision_argument
from squad.config.tools import PredictConfig, defaults, from_namespace

_SHOWN = 20  # images whose top-1 classes are printed


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/predict.py`` / ``squad-predict``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="run folder, model.pt, checkpoint tag, extracted model, "
                   "Hugging Face-style folder or hf-hub:ORG/NAME")
    p.add_argument("--images", nargs="+", required=True, help="image files and/or folders of images")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--tasks", nargs="+", help="tasks to predict, names or aliases, space- or comma-separated "
                   "(default: every task of the model)")
    p.add_argument("--encode", choices=["npy", "taskonomy"], help="raw values as .npy in task units (default) or as "
                   "Taskonomy's own PNG encodings")
    p.add_argument("--batch-size", type=int, help="images per forward pass (default 8)")
    p.add_argument("--class-names", action="append", default=[], metavar="TASK=FILE", help="names of a class task's "
                   "classes, one per line (or a JSON list), shown in its top-5; repeatable")
    add_inference_arguments(p)
    add_compile_argument(p)
    add_precision_argument(p)
    p.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(**defaults(PredictConfig))
    return p


def _class_names(items: list[str]) -> dict[str, list[str]]:
    from squad.deploy.predict import read_class_names

    out = {}
    for item in items:
        task, sep, path = item.partition("=")
        if not sep or not task.strip() or not path.strip():
            raise ValueError(f"--class-names takes TASK=FILE, got {item!r}")
        out[task.strip()] = read_class_names(path.strip())
    return out


def _predict(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[squad] %(message)s")
    cfg = from_namespace(PredictConfig, args)  # the tool's options, checked, in one place
    require_paths(args.checkpoint)  # before anything heavy is imported

    from tqdm.contrib.logging import logging_redirect_tqdm

    from squad.deploy.predict import SUMMARY, predict
    from squad.io import load
    from squad.io.files import check_writable

    check_writable(args.out, "--out", folder=True)  # before the model is loaded
    names = _class_names(args.class_names)
    model = load(args.checkpoint)
    with logging_redirect_tqdm():
        summary = predict(model, args.images, args.out, cfg, class_names=names,
                          progress=not args.quiet and sys.stderr.isatty())
    done, skipped = summary["images"], summary["skipped"]
    settings = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary["inference"].items())
    print(f"predicted {', '.join(summary['tasks'])} on {len(done)} image(s) at {summary['image_size']} px on "
          f"{summary['device']} in {summary['precision']}" + (f" ({settings})" if settings else ""))
    for entry in done[:_SHOWN]:
        for task, top in entry.get("top5", {}).items():
            best = top[0]
            label = best.get("name", f"class {best['index']}")
            print(f"  {entry['out']} {task}: {label} ({best['probability']:.1%})")
    if len(done) > _SHOWN and "top5" in done[0]:
        print(f"  ... (the top-5 of every image: {SUMMARY} and <image>/<task>.json)")
    if skipped:  # each was logged when it was met, with its reason
        print(f"skipped {len(skipped)} file(s) that could not be read: "
              f"{', '.join(s['path'] for s in skipped)} (reasons above and in {SUMMARY})", file=sys.stderr)
    print(f"outputs: {args.out}/<image>/ ; summary: {args.out}/{SUMMARY}")
    return 1 if skipped else 0


def main(argv: list[str] | None = None) -> int:
    """Predicts every task on every image; exit 1 when some files were skipped, 2 on bad input (`squad.cli.run`)."""
    return run(_predict, argv)


if __name__ == "__main__":
    sys.exit(main())
