"""The demo (`make demo`): the whole pipeline on the embedded synthetic Taskonomy, on this machine, in minutes.

1. renders the synthetic dataset into data/synthetic if it is missing;
2. prints the paper configs' parameter / MAC table;
3. trains configs/demo.yaml (a small Mod-Squad: MoE attention, MoE MLP, one MoD block, all 13 tasks) with the
   deepspeed launcher on 2 ranks (CPU: DeepSpeed's CPU accelerator and gloo);
4. compares validation metrics at step 0 and at the end for every task;
5. extracts the depth subnetwork at θ = 0.01, evaluates it beside the full model, and draws the expert-usage and
   task-relation figures and the token maps (which tokens the MoD block processed, over validation images);
   and writes the model as a Hugging Face-style folder with its model card (<run>/hf);
6. prints where the run, its TensorBoard logs, the figures and the folder are.

    python tools/demo.py [--out runs/demo] [--data data/synthetic] [--steps N] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from squad.cli import run

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the demo uses its configs/ and tools/train.py


def say(msg: str) -> None:
    print(f"\n=== {msg}", flush=True)


def ensure_data(root: Path, n: int) -> None:
    from squad.data.synthetic.taskonomy import render_dataset

    if (root / "synthetic.json").is_file():
        print(f"data: {root} (already rendered)")
        return
    t0 = time.time()
    render_dataset(root, n=n, image_size=64, seed=0)
    print(f"data: rendered {n} synthetic Taskonomy images at 64 px into {root} in {time.time() - t0:.0f} s")


def train(out: Path, data: Path, steps: int | None, ranks: int) -> None:
    import torch

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    from squad.distributed import free_port

    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port",
           str(free_port()), "tools/train.py", "--config", "configs/demo.yaml", "--out", str(out),
           "--set", f"data.root={data}"]
    if steps:
        cmd += ["--set", f"optim.steps={steps}"]
    print(" ".join(cmd[0:1] + [c for c in cmd[1:]]), flush=True)
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, env=env)
    if res.returncode != 0:
        raise SystemExit(f"training failed (exit {res.returncode}); see {out / 'train.log'}")
    print(f"trained in {time.time() - t0:.0f} s")


def compare_validation(out: Path) -> bool:
    from squad.tasks import get_task

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = lines[0], lines[-1]
    print(f"{'task':<22}{'metric':<10}{'step ' + str(first['step']):>12}{'step ' + str(last['step']):>12}  better")
    all_better = True
    for task, metrics in last["metrics"].items():
        spec = get_task(task)
        a, b = first["metrics"][task][spec.primary_metric], metrics[spec.primary_metric]
        better = b < a if spec.lower_is_better else b > a
        all_better &= better
        print(f"{task:<22}{spec.primary_metric:<10}{a:>12.4f}{b:>12.4f}  {'yes' if better else 'NO'}")
    return all_better


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/demo.py`` / ``squad-demo``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/demo", help="run folder")
    ap.add_argument("--data", default="data/synthetic", help="synthetic data folder (rendered if missing)")
    ap.add_argument("--images", type=int, default=1200, help="images to render when the data is missing")
    ap.add_argument("--steps", type=int, default=None, help="override optim.steps of configs/demo.yaml")
    ap.add_argument("--ranks", type=int, default=2, help="deepspeed ranks (--num_gpus)")
    ap.add_argument("--fresh", action="store_true", help="delete the run folder first (else an old run resumes)")
    return ap


def _demo(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for needed in ("configs/demo.yaml", "tools/train.py"):
        if not (ROOT / needed).is_file():
            raise FileNotFoundError(f"the demo runs from a squad checkout: {ROOT / needed} not found (install the "
                                    "checkout with `pip install -e .` and run `make demo` there)")
    t0 = time.time()
    out, data = (ROOT / args.out).resolve(), (ROOT / args.data).resolve()

    say("1. data")
    ensure_data(data, args.images)

    say("2. paper configs: parameters and MACs per image per task (counted from the routed shapes)")
    from squad.bench.cases import profile_table

    print(profile_table())

    say("3. training configs/demo.yaml with the deepspeed launcher")
    if args.fresh and out.exists():
        shutil.rmtree(out)
    if (out / "model.pt").is_file():
        print(f"{out / 'model.pt'} exists: skipping training (use --fresh to train again)")
    else:
        train(out, data, args.steps, args.ranks)

    say("4. validation metrics: step 0 vs the end")
    learned = compare_validation(out)

    say("5. extracting the depth subnetwork (θ = 0.01), evaluating it beside the full model, drawing figures")
    from squad.demo import draw_figures, extract_and_compare

    extract_and_compare(out, data)
    figures = draw_figures(out, data)
    from squad.data.accounting import report_pending
    from squad.demo import share

    folder = share(out)
    for line in report_pending():  # here, so that the verdict stays the demo's last line
        print(f"[squad] {line}")

    say("6. where things are")
    print(f"run folder:      {out}")
    print(f"model:           {out / 'model.pt'}")
    print(f"TensorBoard:     .venv/bin/tensorboard --logdir {out / 'tensorboard'}")
    print(f"figures:         {figures}")
    print(f"to share:        {folder} (model card: {folder / 'README.md'}; squad.load opens the folder)")
    print(f"demo finished in {time.time() - t0:.0f} s; every task improved: {'yes' if learned else 'NO'}")
    return 0 if learned else 1


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; exit 1 when a task did not improve, 2 on bad input (`squad.cli.run`)."""
    return run(_demo, argv)


if __name__ == "__main__":
    sys.exit(main())
