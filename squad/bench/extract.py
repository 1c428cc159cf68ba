"""Bench case: the extracted depth model (θ = 0.01) against the full multi-task model it came from.

Two rows: its parameters / the full model's (target ≤ 0.6) and its forward time / the full model's forward for the
same task (target ≤ 1.0, "not slower"), timed interleaved in this process. The model is the demo run's
(``runs/demo/model.pt`` of the current folder, where ``make demo`` and the README's commands put it) when it exists,
calibrated on the run's own data if that is still on disk (its ``data.root``, relative paths taken from the
current folder as training took them; else on the usage statistics saved with it); otherwise a short run of the
packaged configs/demo.yaml is trained in a temporary folder on a freshly rendered small synthetic dataset. The
rows' details say which.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from squad.config.base import config_root
from squad.config.tools import ExtractConfig
from squad.data.synthetic.taskonomy import render_dataset
from squad.io import load_extracted, load_model
from squad.posttrain.extract import extract_to_file
from squad.timing import BenchResult, check, ratio_row, time_interleaved

log = logging.getLogger(__name__)
TASK = "depth_euclidean"
DEMO_RUN = Path("runs") / "demo"  # relative to the current folder
THETA = 0.01


def _train_tiny_run(folder: Path, quick: bool) -> tuple[Path, Path]:
    """Renders a small synthetic dataset and trains configs/demo.yaml briefly (one plain-python process)."""
    data = folder / "data"
    render_dataset(data, n=24 if quick else 96, image_size=64, seed=0, workers=1)
    run = folder / "run"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    config = config_root() / "demo.yaml"  # squad's own configs: a checkout's configs/ or a wheel's package data
    cmd = [sys.executable, "-m", "squad.cli.train", "--config", str(config),
           "--out", str(run), "--set", f"data.root={data}", "--set", f"optim.steps={10 if quick else 150}",
           "--set", "data.workers=0", "--set", "data.val_batches=1", "--set", "train.progress=false",
           "--set", "train.ckpt_every=0", "--set", "train.eval_every=0"]
    res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"training the bench model failed: {res.stderr[-2000:]}")
    return run, data


def _run_data(run: Path) -> Path | None:
    """The data root the run was trained on, if it is still there (a relative ``data.root`` is taken from the
    current folder, as training took it)."""
    cfg = run / "config.yaml"
    if not cfg.is_file():
        return None
    root = Path((yaml.safe_load(cfg.read_text()).get("data") or {}).get("root", ""))
    root = root if root.is_absolute() else Path.cwd() / root
    return root if (root / "rgb").is_dir() or (root / "shards.json").is_file() else None


def _measure(run: Path, data: Path | None, source: str, folder: Path, quick: bool) -> list[BenchResult]:
    out = folder / f"{TASK}_theta{THETA:g}.pt"
    full = load_model(run)
    cfg = ExtractConfig(theta=THETA, data=None if data is None else str(data), calib_batches=4 if quick else 16,
                        eval_split=None, saved_usage=data is None)
    report = extract_to_file(full, TASK, out, cfg)
    full = load_model(run)  # extraction set its inference settings: a fresh copy for timing
    ext = load_extracted(out)
    size = full.cfg.img_size
    images = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def run_full() -> None:
        full(images, [TASK])

    @torch.no_grad()
    def run_ext() -> None:
        ext(images)

    t_full, t_ext = time_interleaved([run_full, run_ext], repeats=10 if quick else 40, warmup=3)
    usage = f"calibration on {data}" if data is not None else "usage statistics saved in model.pt"
    details = {"model": source, "usage": usage, "theta": THETA, "task": TASK,
               "params_full": report["params"]["full"], "params_extracted": report["params"]["extracted"],
               "experts_kept": {k: f"{v['experts_after']}/{v['experts_before']}" for k, v in report["layers"].items()}}
    ratio = report["params"]["ratio"]
    params_row = BenchResult("extract_depth_params", ratio, "<= 0.6", "x params", check(ratio, "<= 0.6"), details)
    time_row = ratio_row("extract_depth_forward", t_ext, t_full, "<= 1.0", batch=8, image_size=size, model=source)
    return [params_row, time_row]


def bench_extraction(quick: bool = False) -> list[BenchResult]:
    """Extracted depth model (θ = 0.01) vs the full model: parameter ratio and forward-time ratio."""
    with tempfile.TemporaryDirectory(prefix="squad_bench_extract_") as tmp:
        folder = Path(tmp)
        demo = Path.cwd() / DEMO_RUN
        if (demo / "model.pt").is_file():
            return _measure(demo, _run_data(demo), str(demo / "model.pt"), folder, quick)
        log.info("no runs/demo/model.pt: training a short demo run for the extraction bench")
        run, data = _train_tiny_run(folder, quick)
        return _measure(run, data, f"short run of configs/demo.yaml trained for this bench ({run})", folder, quick)
