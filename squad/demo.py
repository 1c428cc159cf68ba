"""Step 5 of the demo (tools/demo.py): extract depth from the trained run, score it beside the full model, and draw
the expert-usage and task-relation figures and the token maps (which tokens the MoD block processed, over the
image). Thin wrappers over `squad.posttrain.extract.extract_to_file` and `squad.analysis.figures.draw_figures` that
print what they did."""

from __future__ import annotations

import json
from pathlib import Path

from squad.analysis.figures import draw_figures as _draw
from squad.config.tools import ExtractConfig, VisualizeConfig
from squad.deploy.hf import save_pretrained
from squad.eval.evaluate import format_results
from squad.io import load_model
from squad.posttrain.extract import extract_to_file, format_report


def extract_and_compare(run: str | Path, data: str | Path, task: str = "depth_euclidean", theta: float = 0.01,
                        split: str = "val", calib_batches: int = 8) -> dict:
    """Extracts ``task`` at θ into ``<run>/<task>_theta<θ>.pt`` (report beside it) and prints the extraction summary
    and the full and extracted models' metrics on ``split`` side by side. Returns the report."""
    run = Path(run)
    out = run / f"{task}_theta{theta:g}.pt"
    cfg = ExtractConfig(theta=theta, data=str(data), calib_batches=calib_batches, eval_split=split)
    report = extract_to_file(load_model(run), task, out, cfg)
    print(format_report({**report, "metrics": None}))  # the metrics follow as a side-by-side table
    m = report["metrics"]
    if m:
        print(f"\n{task} on {m['split']} ({m['images']} images), full model beside the extracted one:")
        print(format_results({"full": {report["task"]: m["full"]}, f"extracted θ={theta:g}": {report["task"]:
                                                                                           m["extracted"]}}))
    print(f"extracted model: {out} (load with squad.load)")
    return report


def draw_figures(run: str | Path, data: str | Path, split: str = "val", batches: int = 4) -> Path:
    """Draws the figures of ``run`` into ``<run>/figures`` (and its TensorBoard) from a pass over ``split``, and
    names one token map (the tokens the MoD block processed, over the first images, for the first task); returns
    the folder."""
    folder = Path(run) / "figures"
    tb = Path(run) / "tensorboard"
    cfg = VisualizeConfig(data=str(data), split=split, batches=batches)
    result = _draw(load_model(run), folder, cfg, tb_dir=tb if tb.is_dir() else None)
    print(f"{len(result['files'])} figures in {folder} (numbers in {result['json']})")
    if result["token_maps"]:
        shown = json.loads(Path(result["json"]).read_text())["token_maps"]["images"]
        print(f"which tokens the MoD block processed, over {shown} validation images: {result['token_maps'][0]} "
              f"(one such map per task: tokens_<task>.png)")
    return folder


def share(run: str | Path) -> Path:
    """Writes the run's model as a Hugging Face-style folder, ``<run>/hf`` (`squad.save_pretrained`: safetensors,
    config.json and the model card, its numbers from the run); returns the folder."""
    folder = save_pretrained(load_model(run), Path(run) / "hf")
    print(f"Hugging Face-style folder: {folder} ({', '.join(sorted(p.name for p in folder.iterdir()))})")
    return folder
