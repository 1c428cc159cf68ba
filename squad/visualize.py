"""The library side of tools/visualize.py: expert-usage heatmaps of every MoE layer and task-relation matrices,
as PNG files (with a JSON of the numbers) and in TensorBoard.

    files = draw_figures("runs/demo", "runs/demo/figures", data="data/synthetic")

With ``data`` the model is run over that split once (fused, all tasks) and both figure families come from that
pass; without it the heatmaps use the usage statistics saved in ``model.pt`` (training-time routing) and the
relation matrices, which need per-token selections, are skipped.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from squad.figures import relation_figure, save_figure, usage_figure
from squad.loading import load_full_model
from squad.model import SquadViT
from squad.relations import TaskRelations, task_relations
from squad.usage import ExpertUsage

log = logging.getLogger(__name__)
KIND_NAMES = {"moe": "MoE MLP", "moa": "MoE attention"}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def calibration_pass(model: SquadViT, data: str | Path, split: str = "val", batches: int = 4, batch_size: int = 8,
                     device: str | torch.device = "cpu", workers: int = 0) -> tuple[ExpertUsage, TaskRelations]:
    """Usage statistics and task relations of ``model`` over ``batches`` batches of ``split`` (every task fused)."""
    from squad.data import build_dataset
    from squad.evaluation import eval_loader
    from squad.tasks import TASK_NAMES

    probe = next((t for t in model.task_names if t in TASK_NAMES), TASK_NAMES[0])  # images only: targets unused
    ds = build_dataset(data, [probe], split, image_size=model.cfg.img_size, augment=False, missing="mask")
    usage = ExpertUsage(model.task_names)
    rel = task_relations(model, eval_loader(ds, batch_size, workers), max_batches=batches, device=device, usage=usage)
    return usage, rel


def draw_figures(source: str | Path | SquadViT, out_dir: str | Path, *, data: str | Path | None = None,
                 split: str = "val", batches: int = 4, batch_size: int = 8, tb_dir: str | Path | None = None,
                 device: str | torch.device = "cpu", workers: int = 0) -> dict:
    """Draws every figure into ``out_dir`` (and TensorBoard) and returns what was written.

    Args:
        source: run folder, ``model.pt``, or a model in memory.
        out_dir: folder for the PNGs and ``figures.json``.
        data: dataset root for a calibration pass (recommended; needed for relation matrices).
        split: split of the calibration pass.
        batches: calibration batches (0 = the whole split).
        batch_size: images per batch.
        tb_dir: TensorBoard log folder (default: the run's ``tensorboard/`` when ``source`` is a run folder;
            pass ``""`` to skip TensorBoard).
        device: where to run.
        workers: data loader workers.

    Returns:
        ``{"files": [png paths], "json": path, "usage_source": ..., "tensorboard": dir or None}``.

    Raises:
        ValueError: no data and no saved usage statistics.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    step = 0
    if isinstance(source, SquadViT):
        model, saved = source, None
    else:
        model, saved, meta = load_full_model(source)
        step = int((meta.get("extra") or {}).get("step", 0) or 0)
        if tb_dir is None and Path(source).is_dir() and (Path(source) / "tensorboard").is_dir():
            tb_dir = Path(source) / "tensorboard"
    model.to(device)
    rel = None
    if data is not None:
        usage, rel = calibration_pass(model, data, split, batches, batch_size, device, workers)
        usage_source = f"calibration pass over {data} ({split})"
    elif saved is not None:
        usage, usage_source = saved, "usage statistics saved in model.pt (training)"
        log.warning("no data given: task-relation matrices need a calibration pass (--data); drawing heatmaps only")
    else:
        raise ValueError("no usage statistics saved with the model; pass data= (--data DIR) for a calibration pass")
    writer = None
    if tb_dir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(tb_dir))
    files, numbers = [], {"usage_source": usage_source, "usage": {}, "relations": None}
    try:
        shares = usage.selection_share()
        for layer, share in shares.items():
            kind = KIND_NAMES.get(usage.kinds[layer], usage.kinds[layer])
            fig = usage_figure(share.numpy(), usage.tasks, f"{layer} ({kind})")
            if writer is not None:
                writer.add_figure(f"figures/usage/{layer}", fig, step, close=False)
            path = out_dir / f"usage_{_slug(layer)}.png"
            save_figure(fig, path)
            files.append(str(path))
            numbers["usage"][layer] = {"kind": usage.kinds[layer], "share": share.tolist()}
        if rel is not None:
            for key, (title, matrix) in rel.summary().items():
                fig = relation_figure(matrix.numpy(), rel.tasks, title)
                if writer is not None:
                    writer.add_figure(f"figures/relations/{key}", fig, step, close=False)
                path = out_dir / f"relations_{key}.png"
                save_figure(fig, path)
                files.append(str(path))
            numbers["relations"] = rel.to_dict()
    finally:
        if writer is not None:
            writer.close()
    json_path = out_dir / "figures.json"
    json_path.write_text(json.dumps(numbers, indent=1) + "\n")
    log.info("wrote %d figures to %s", len(files), out_dir)
    return {"files": files, "json": str(json_path), "usage_source": usage_source,
            "tensorboard": str(tb_dir) if tb_dir else None}
