"""Figures of routing, for every kind of routed layer:

- MoE attention / MoE MLP: tasks × experts selection heatmaps per layer (paper Fig. 4 style) and task × task
  relation matrices (paper Fig. 5 style, from a calibration pass);
- Mixture-of-Depths (learned or attention routing) and Mixture of Nested Experts: for a few images of the calibration
  split, per task, the tokens each MoD block processed and each token's nested width, as maps over the image
  (`squad.analysis.token_maps`; the share of tokens each block processed is in ``figures.json``);
- Mixture of Nested Experts: tasks × nested experts, the share of each task's tokens assigned to each width (fixed
  by e_c), and the task's mean router probability per width (where the tasks differ).

A model with no routed layer (a dense ViT) is refused: there is no routing to draw.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import torch

from squad.analysis.relations import TaskRelations, task_relations
from squad.analysis.token_maps import has_token_maps, token_figure, token_maps
from squad.config.tools import VisualizeConfig
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


def calibration_data(model: SquadViT, data: str | Path, split: str = "val"):
    """The images of ``split`` at the model's size, in order (their targets unused: the dataset reads one task the
    data provides — the model's own Taskonomy / PASCAL / NYUD task)."""
    probe = next((t for t in model.task_names if t in (*TASK_NAMES, *DENSE_LABEL_TASKS)), TASK_NAMES[0])
    return build_dataset(data, [probe], split, image_size=model.cfg.img_size, augment=False, missing="mask",
                         task_options=model.cfg.task_options)


def calibration_pass(model: SquadViT, data: str | Path, split: str = "val", batches: int = 4, batch_size: int = 8,
                     device: str | torch.device = "cpu",
                     workers: int = 0) -> tuple[ExpertUsage, TaskRelations | None]:
    """Usage statistics of ``model`` over ``batches`` batches of ``split`` (every task fused), and the task
    relations when it has MoE attention / MoE MLP layers (None otherwise: MoD and MoNE routing has no experts two
    tasks could share)."""
    usage = ExpertUsage(model.task_names)
    loader = eval_loader(calibration_data(model, data, split), batch_size, workers)
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


def first_images(model: SquadViT, data: str | Path, split: str, count: int) -> torch.Tensor:
    """The first ``count`` images of ``split`` [count, C, H, W] (fewer when the split is smaller)."""
    ds = calibration_data(model, data, split)
    return torch.stack([ds[i]["rgb"] for i in range(min(count, len(ds)))])


def _mone_widths(model: SquadViT) -> list[str]:
    e = model.cfg.mone.num_experts
    return [f"D/{2 ** (e - 1 - j)}" if j < e - 1 else "D" for j in range(e)]


def draw_figures(model: SquadViT, out_dir: str | Path, cfg: VisualizeConfig | None = None,
                 tb_dir: str | Path | None = None) -> dict:
    """Draws every figure into ``out_dir`` (and TensorBoard) and returns what was written.

    The model and its statistics are checked before anything is created: a model without routed layers or no
    statistics to draw from leave no folder behind.

    Args:
        model: the model (`squad.load_model`); without ``cfg.data`` the usage statistics saved with it (its
            ``usage``, from training) are drawn, and its ``meta["extra"]["step"]`` is the TensorBoard step.
        out_dir: folder for the PNGs and ``figures.json``.
        cfg: the calibration data (recommended: relation matrices and token maps need it), its split, batches and
            batch size, the images the token maps show, device, loader workers and inference settings
            (`squad.config.tools.VisualizeConfig`; default: the saved statistics only).
        tb_dir: TensorBoard log folder (None or ``""``: no TensorBoard).

    Returns:
        ``{"files": [png paths], "json": path, "usage_source": ..., "tensorboard": dir or None, "token_maps":
        [png paths of the token maps]}``.

    Raises:
        ValueError: a model without routed layers; no data and no saved usage statistics; an inference setting
            the model cannot take, or one given without data (saved statistics come from training).
        FileNotFoundError: missing data.
    """
    cfg = cfg or VisualizeConfig()
    cfg.check()
    data, split, device = cfg.data, cfg.split, cfg.device
    mone_capacity, mod_inference = cfg.inference.mone_capacity, cfg.inference.mod_inference
    out_dir = Path(out_dir)
    saved = getattr(model, "usage", None)
    step = int(((getattr(model, "meta", None) or {}).get("extra") or {}).get("step", 0) or 0)
    if not any(isinstance(m, RoutedLayer) for m in model.modules()):
        raise ValueError(f"{model.cfg.name} has no routed layers (MoE attention, MoE MLP, Mixture-of-Depths or "
                         f"nested experts): there is no routing to draw")
    settings = set_inference(model, **dataclasses.asdict(cfg.inference))
    if data is None and (mone_capacity is not None or mod_inference is not None):
        raise ValueError("--mone-capacity / --mod-inference change how the model routes, which only a calibration "
                         "pass shows: pass data= (--data DIR); the saved statistics come from training")
    model.to(device)
    rel = None
    if data is not None:
        usage, rel = calibration_pass(model, data, split, cfg.batches, cfg.batch_size, device, cfg.workers)
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
               "mone": None, "token_maps": None}
    token_files: list[str] = []

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
        if mod:  # [T, blocks] share of each task's tokens processed (which ones: the token maps)
            share = torch.stack([usage.counts[b][:, 0] / usage.tokens[b].clamp_min(1.0) for b in mod], dim=1)
            mode = ("training, top-k" if data is None else settings.get("mod_inference", "topk"))
            numbers["mod"] = {"mode": mode, "blocks": mod, "share": share.tolist()}
        if data is not None and cfg.images and has_token_maps(model):
            images = first_images(model, data, split, cfg.images)
            maps = token_maps(model, images.to(device))
            for task in maps.tasks:
                emit(token_figure(images, maps, task), f"figures/tokens/{task}", f"tokens_{_slug(task)}.png")
                token_files.append(files[-1])
            numbers["token_maps"] = {"images": images.shape[0], "layers": maps.layers, "kinds": maps.kinds}
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
            "tensorboard": str(tb_dir) if tb_dir else None, "token_maps": token_files}
