"""Routing you can see: for a few images and each task, which tokens every Mixture-of-Depths block (learned or
attention routing) processed, and each token's nested width in a MoNE model, as maps over the image.

The maps are the layers' own records, not a second computation of their rule: `token_maps` runs one task at a time
with ``model.record_routing`` on, and every routed layer reports each token's choice in its `RouterStats.experts`
([R·N, 1]: a MoD block 0 for a processed token and 1 for a skipped one, the columns of its counts; a MoNE router the
nested expert, 0 the narrowest). The prefix tokens (the class token) have no place on the image and are left out;
the patch tokens fold into the g × g grid of patches.

`token_figure` draws one task's maps: a row per image, the image itself first, then a panel per layer with the map
over it — a MoD block darkens the patches it skipped, a MoNE router colours each patch by its width (d_j / D).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import matplotlib
import torch

from squad.models.vit import SquadViT

matplotlib.use("Agg")  # files and TensorBoard only; never a window

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

MAP_KINDS = ("mod", "mone")  # the routed layers whose per-token choice is drawn
_SKIPPED = ListedColormap([(0.0, 0.0, 0.0, 0.72), (0.0, 0.0, 0.0, 0.0)])  # 0: skipped (dark), 1: processed (clear)


@dataclasses.dataclass
class TokenMaps:
    """Per task and layer, a map over the grid of patches for each image.

    Attributes:
        tasks: the tasks drawn (canonical names).
        layers: the MoD blocks and MoNE routers in forward order.
        kinds: layer → ``"mod"`` or ``"mone"``.
        maps: task → layer → float [B, g, g]: a MoD block's 1.0 where the token was processed and 0.0 where it was
            skipped; a MoNE router's width share d_j / D of the token's nested expert.
        mone_experts: the MoNE model's nested experts E (0 without MoNE).
    """

    tasks: list[str]
    layers: list[str]
    kinds: dict[str, str]
    maps: dict[str, dict[str, torch.Tensor]]
    mone_experts: int = 0

    def processed_share(self, task: str, layer: str) -> float:
        """A MoD block's share of patch tokens processed for ``task`` over the images."""
        return float(self.maps[task][layer].mean())


def has_token_maps(model: SquadViT) -> bool:
    """Whether the model has a layer `token_maps` draws (a MoD block or a MoNE router)."""
    return any(getattr(m, "kind", None) in MAP_KINDS for m in model.modules())


@torch.no_grad()
def token_maps(model: SquadViT, images: torch.Tensor, tasks: Sequence[str] | None = None) -> TokenMaps:
    """The tokens each MoD block processed and each token's MoNE width, per task, for ``images`` [B, C, H, W].

    The model runs in eval mode (as at inference: its MoD mode and MoNE capacity as set, `set_inference`), one task
    per pass, with its routing recorded; its mode and recording flag are restored.

    Raises:
        ValueError: a model without MoD blocks or MoNE routers, or an unknown task.
    """
    if not has_token_maps(model):
        raise ValueError(f"{model.cfg.name} has no Mixture-of-Depths block or nested-experts router: no token maps")
    tasks = [model.task_names[i] for i in model.task_index(list(tasks or model.task_names))]
    prefix, g, b = int(model.cfg.class_token), model.cfg.grid, images.shape[0]
    e = model.cfg.mone.num_experts
    widths = torch.tensor([1.0 / 2 ** (e - 1 - j) for j in range(e)])  # nested expert j's share of D
    out = TokenMaps(tasks, [], {}, {t: {} for t in tasks}, e if any(
        getattr(m, "kind", None) == "mone" for m in model.modules()) else 0)
    was_training, was_recording = model.training, model.record_routing
    model.eval()
    model.record_routing = True
    try:
        for task in tasks:
            for s in model(images, [task]).stats:
                if s.kind not in MAP_KINDS:
                    continue
                choice = s.experts.view(b, -1)[:, prefix:].reshape(b, g, g).cpu()  # [B, g, g] per patch
                value = (choice == 0).float() if s.kind == "mod" else widths[choice]
                out.maps[task][s.name] = value
                if s.name not in out.kinds:
                    out.layers.append(s.name)
                    out.kinds[s.name] = s.kind
    finally:
        model.record_routing = was_recording
        model.train(was_training)
    return out


def token_figure(images: torch.Tensor, maps: TokenMaps, task: str):
    """One task's token maps over ``images`` [B, 3, H, W] (values in [0, 1]): a row per image, the image and then a
    panel per layer (`TokenMaps.layers`), each map drawn at the grid's resolution over the image."""
    b, layers = images.shape[0], maps.layers
    cols = 1 + len(layers)
    fig, axes = plt.subplots(b, cols, figsize=(1.9 * cols + 0.6, 1.9 * b + 0.5), dpi=110, squeeze=False)
    pictures = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()  # [B, H, W, 3]
    h, w = pictures.shape[1:3]
    box = (-0.5, w - 0.5, h - 0.5, -0.5)  # the image's own pixel extent: a map cell covers its patch exactly
    shown = None
    for i in range(b):
        axes[i][0].imshow(pictures[i])
        for j, layer in enumerate(layers, start=1):
            ax = axes[i][j]
            ax.imshow(pictures[i])
            value = maps.maps[task][layer][i].numpy()
            if maps.kinds[layer] == "mod":
                ax.imshow(value, cmap=_SKIPPED, vmin=0.0, vmax=1.0, extent=box, interpolation="nearest")
            else:
                shown = ax.imshow(value, cmap="viridis", vmin=0.0, vmax=1.0, alpha=0.6, extent=box,
                                  interpolation="nearest")
            if i == 0:
                what = (f"processed {maps.processed_share(task, layer):.0%}" if maps.kinds[layer] == "mod"
                        else "nested width d/D")
                ax.set_title(f"{layer} ({maps.kinds[layer]})\n{what}", fontsize=7)
        for ax in axes[i]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[0][0].set_title("image", fontsize=7)
    kinds = set(maps.kinds.values())
    what = [w for k, w in (("mod", "the tokens each MoD block processed (dark: skipped)"),
                           ("mone", "each token's nested width")) if k in kinds]
    fig.suptitle(f"{task}: {' and '.join(what)}", fontsize=9)
    if shown is not None:
        fig.colorbar(shown, ax=axes.ravel().tolist(), fraction=0.03, pad=0.02).set_label("d_j / D", fontsize=7)
    return fig
