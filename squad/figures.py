"""Figures of expert usage: tasks × experts selection heatmaps per routed layer (paper Fig. 4 style) and task × task
relation matrices (paper Fig. 5 style)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

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


def relation_figure(matrix: np.ndarray, tasks: Sequence[str], title: str):
    """Task × task relation matrix (mean share of experts two tasks select for the same token), in [0, 1]."""
    return heatmap(matrix, tasks, tasks, f"task relations — {title}", "mean share of shared experts", vmin=0.0,
                   vmax=1.0)


def save_figure(fig, path) -> None:
    """Writes a figure as PNG and closes it."""
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
