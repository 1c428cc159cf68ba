"""Figures of routing, for every kind of routed layer:

- MoE attention / MoE MLP: tasks × experts selection heatmaps per layer (paper Fig. 4 style) and task × task
  relation matrices (paper Fig. 5 style, from a calibration pass);
- Mixture-of-Depths: tasks × MoD blocks, the share of each task's tokens each block processed (top-k: the capacity;
  threshold inference: what the routers let through);
- Mixture of Nested Experts: tasks × nested experts, the share of each task's tokens assigned to each width (fixed
  by e_c), and the task's mean router probability per width (where the tasks differ).

A model with no routed layer (a dense ViT) is refused: there is no routing to draw.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import torch

from squad.analysis.relations import TaskRelations, task_relations
from squad.data import build_dataset, eval_loader
from squad.io.files import atomic_save, atomic_write_text
from squad.layers.base import EXPERT_KINDS, RoutedLayer
from squad.models.inference import set_inference
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT
from squad.tasks import DENSE_LABEL_TASKS, TASK_NAMES

matplotlib.use("Agg")  # files and TensorBoard only; never a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def heatmap(matrix: np.ndarray, rows: Sequence[str], cols: Sequence[str], title: str, cbar: str = "",
            annotate: bool | None = None, vmin: float | None = 0.0, vmax: float | None = None):
    """A labelled heatmap figure (rows × columns); values annotated when the grid is small."""
    matrix = np.asarray(matrix, dtype=float)
    h, w = matrix.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * w + 3.0), max(3.0, 0.38 * h + 1.5)), dpi=110)
    im = ax.imshow(matrix, cmap="viridis", aspect="auto", vmin=vmin, vmax=vmax)
    ax.set_xticks(range(w), labels=list(cols), rotation=90 if max(len(str(c)) for c in cols) > 3 else 0,
                  fontsize=8)
    ax.set_yticks(range(h), labels=list(rows), fontsize=8)
    ax.set_title(title, fontsize=10)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if cbar:
        cb.set_label(cbar, fontsize=8)
    if annotate is None:
        annotate = h * w <= 400
    if annotate:
        top = np.nanmax(matrix) if matrix.size else 0.0
        for i in range(h):
            for j in range(w):
                v = matrix[i, j]
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if top and v > 0.6 * top else "white")
    fig.tight_layout()
    return fig


def usage_figure(share: np.ndarray, tasks: Sequence[str], layer: str):
    """Expert selection frequency per task for one layer: rows = tasks, columns = experts (rows sum to 1)."""
    experts = [str(e) for e in range(share.shape[1])]
    fig = heatmap(share, tasks, experts, f"expert selection frequency — {layer}", "share of selections")
    fig.axes[0].set_xlabel("expert", fontsize=8)
    return fig


def mod_figure(share: np.ndarray, tasks: Sequence[str], blocks: Sequence[str], mode: str):
    """Share of each task's tokens each MoD block processed: rows = tasks, columns = MoD blocks, in [0, 1]."""
    fig = heatmap(share, tasks, blocks, f"Mixture-of-Depths: tokens processed ({mode})", "share of tokens",
                  vmin=0.0, vmax=1.0)
    fig.axes[0].set_xlabel("MoD block", fontsize=8)
    return fig


def mone_figure(share: np.ndarray, tasks: Sequence[str], widths: Sequence[str], title: str, cbar: str):
    """Per task, a share per nested expert: rows = tasks, columns = expert widths (smallest first)."""
    fig = heatmap(share, tasks, widths, title, cbar, vmin=0.0, vmax=1.0)
    fig.axes[0].set_xlabel("nested expert (width)", fontsize=8)
    return fig


def relation_figure(matrix: np.ndarray, tasks: Sequence[str], title: str):
    """Task × task relation matrix (mean share of experts two tasks select for the same token), in [0, 1]."""
    return heatmap(matrix, tasks, tasks, f"task relations — {title}", "mean share of shared experts", vmin=0.0,
                   vmax=1.0)


def save_figure(fig, path) -> None:
    """Writes a figure as PNG and closes it."""
    try:
        atomic_save(path, lambda f: fig.savefig(f, format="png", dpi=130, bbox_inches="tight"), "a figure")
    finally:
        plt.close(fig)


log = logging.getLogger(__name__)


KIND_NAMES = {"moe": "MoE MLP", "moa": "MoE attention"}


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _has_moe(model: SquadViT) -> bool:
    return any(isinstance(m, RoutedLayer) and m.kind in EXPERT_KINDS for m in model.modules())


def calibration_pass(model: SquadViT, data: str | Path, split: str = "val", batches: int = 4, batch_size: int = 8,
                     device: str | torch.device = "cpu",
                     workers: int = 0) -> tuple[ExpertUsage, TaskRelations | None]:
    """Usage statistics of ``model`` over ``batches`` batches of ``split`` (every task fused), and the task
    relations when it has MoE attention / MoE MLP layers (None otherwise: MoD and MoNE routing has no experts two
    tasks could share)."""
    # a task the data provides (images only: targets unused): the model's own Taskonomy / PASCAL / NYUD task
    probe = next((t for t in model.task_names if t in (*TASK_NAMES, *DENSE_LABEL_TASKS)), TASK_NAMES[0])
    ds = build_dataset(data, [probe], split, image_size=model.cfg.img_size, augment=False, missing="mask",
                       task_options=model.cfg.task_options)
    usage = ExpertUsage(model.task_names)
    loader = eval_loader(ds, batch_size, workers)
    if _has_moe(model):
        rel = task_relations(model, loader, max_batches=batches, device=device, usage=usage)
        return usage, rel
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if batches and i >= batches:
                    break
                usage.update(model(batch["rgb"].to(device)).stats)
    finally:
        model.train(was)
    return usage, None


def _mone_widths(model: SquadViT) -> list[str]:
    e = model.cfg.mone.num_experts
    return [f"D/{2 ** (e - 1 - j)}" if j < e - 1 else "D" for j in range(e)]


def draw_figures(model: SquadViT, out_dir: str | Path, *, data: str | Path | None = None,
                 split: str = "val", batches: int = 4, batch_size: int = 8, tb_dir: str | Path | None = None,
                 device: str | torch.device = "cpu", workers: int = 0, mone_capacity: float | None = None,
                 mod_inference: str | None = None) -> dict:
    """Draws every figure into ``out_dir`` (and TensorBoard) and returns what was written.

    The model and its statistics are checked before anything is created: a model without routed layers or no
    statistics to draw from leave no folder behind.

    Args:
        model: the model (`squad.load_model`); without ``data`` the usage statistics saved with it (its ``usage``,
            from training) are drawn, and its ``meta["extra"]["step"]`` is the TensorBoard step.
        out_dir: folder for the PNGs and ``figures.json``.
        data: dataset root for a calibration pass (recommended; needed for relation matrices).
        split: split of the calibration pass.
        batches: calibration batches (0 = the whole split).
        batch_size: images per batch.
        tb_dir: TensorBoard log folder (None or ``""``: no TensorBoard).
        device: where to run.
        workers: data loader workers.
        mone_capacity: MoNE effective capacity e_c for the calibration pass (MoNE models).
        mod_inference: MoD inference mode for the calibration pass, topk or threshold (MoD models).

    Returns:
        ``{"files": [png paths], "json": path, "usage_source": ..., "tensorboard": dir or None}``.

    Raises:
        ValueError: a model without routed layers; no data and no saved usage statistics; an inference setting
            the model cannot take, or one given without data (saved statistics come from training).
        FileNotFoundError: missing data.
    """
    out_dir = Path(out_dir)
    saved = getattr(model, "usage", None)
    step = int(((getattr(model, "meta", None) or {}).get("extra") or {}).get("step", 0) or 0)
    if not any(isinstance(m, RoutedLayer) for m in model.modules()):
        raise ValueError(f"{model.cfg.name} has no routed layers (MoE attention, MoE MLP, Mixture-of-Depths or "
                         f"nested experts): there is no routing to draw")
    settings = set_inference(model, mone_capacity, mod_inference)
    if data is None and (mone_capacity is not None or mod_inference is not None):
        raise ValueError("--mone-capacity / --mod-inference change how the model routes, which only a calibration "
                         "pass shows: pass data= (--data DIR); the saved statistics come from training")
    model.to(device)
    rel = None
    if data is not None:
        usage, rel = calibration_pass(model, data, split, batches, batch_size, device, workers)
        usage_source = f"calibration pass over {data} ({split})"
    elif saved is not None:
        usage, usage_source = saved, "usage statistics saved in model.pt (training)"
        if _has_moe(model):
            log.warning("no data given: task-relation matrices need a calibration pass (--data); drawing heatmaps "
                        "only")
    else:
        raise ValueError("no usage statistics saved with the model; pass data= (--data DIR) for a calibration pass")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = None
    if tb_dir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(tb_dir))
    files = []
    numbers = {"usage_source": usage_source, "inference": settings, "usage": {}, "relations": None, "mod": None,
               "mone": None}

    def emit(fig, tag: str, name: str) -> None:
        if writer is not None:
            writer.add_figure(tag, fig, step, close=False)
        path = out_dir / name
        save_figure(fig, path)
        files.append(str(path))

    try:
        for layer, share in usage.selection_share().items():
            kind = KIND_NAMES.get(usage.kinds[layer], usage.kinds[layer])
            emit(usage_figure(share.numpy(), usage.tasks, f"{layer} ({kind})"), f"figures/usage/{layer}",
                 f"usage_{_slug(layer)}.png")
            numbers["usage"][layer] = {"kind": usage.kinds[layer], "share": share.tolist()}
        mod = [name for name in usage.counts if usage.kinds[name] == "mod"]
        if mod:  # [T, blocks] share of each task's tokens processed
            share = torch.stack([usage.counts[b][:, 0] / usage.tokens[b].clamp_min(1.0) for b in mod], dim=1)
            mode = ("training, top-k" if data is None else settings.get("mod_inference", "topk"))
            emit(mod_figure(share.numpy(), usage.tasks, mod, mode), "figures/mod/tokens", "mod_tokens.png")
            numbers["mod"] = {"mode": mode, "blocks": mod, "share": share.tolist()}
        mone = [name for name in usage.counts if usage.kinds[name] == "mone"]
        if mone:
            numbers["mone"] = {"widths": _mone_widths(model), "routers": {}}
        for layer in mone:
            tokens = usage.tokens[layer].clamp_min(1.0).unsqueeze(1)
            share, prob = usage.counts[layer] / tokens, usage.mass[layer] / tokens
            widths = _mone_widths(model)
            emit(mone_figure(share.numpy(), usage.tasks, widths, f"nested experts: tokens per expert — {layer}",
                             "share of tokens"), f"figures/mone/tokens/{layer}", f"mone_tokens_{_slug(layer)}.png")
            emit(mone_figure(prob.numpy(), usage.tasks, widths, f"nested experts: mean router probability — {layer}",
                             "mean probability"), f"figures/mone/router/{layer}", f"mone_router_{_slug(layer)}.png")
            numbers["mone"]["routers"][layer] = {"tokens": share.tolist(), "router_probability": prob.tolist()}
        if rel is not None:
            for key, (title, matrix) in rel.summary().items():
                emit(relation_figure(matrix.numpy(), rel.tasks, title), f"figures/relations/{key}",
                     f"relations_{key}.png")
            numbers["relations"] = rel.to_dict()
    finally:
        if writer is not None:
            writer.close()
    numbers["tasks"] = list(usage.tasks)
    json_path = out_dir / "figures.json"
    atomic_write_text(json_path, json.dumps(numbers, indent=1) + "\n", "the figures' numbers")
    log.info("wrote %d figures to %s", len(files), out_dir)
    return {"files": files, "json": str(json_path), "usage_source": usage_source,
            "tensorboard": str(tb_dir) if tb_dir else None}
