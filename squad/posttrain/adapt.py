"""Turning a trained dense ViT into a Mixture-of-Depths model with no training (A-MoD, Gadhikar et al., Table 3).

Every other block (the 2nd, 4th, ...) gets MoD routing at a capacity C; its attention and MLP weights are the dense
block's. With attention routing the scores come from the previous (dense) block's attention, need no parameters
and leave the block's output unscaled, so the adapted model keeps most of the dense model's quality; a learned
router has nothing to route by before it is trained (and scales the block output by its weight).
"""

from __future__ import annotations

import dataclasses

import torch

from squad.config.base import to_dict
from squad.config.loading import load_config
from squad.config.model import BlockSpec
from squad.models.vit import SquadViT, build_model


def mod_plan(depth: int, routing: str, every: int = 2) -> list[BlockSpec]:
    """Dense blocks with MoD (``routing``) on blocks every-1, 2·every-1, ... (never block 0)."""
    return [BlockSpec(mod=routing if (i + 1) % every == 0 else None) for i in range(depth)]


def remap_dense_state(state: dict[str, torch.Tensor], target: SquadViT) -> dict[str, torch.Tensor]:
    """Maps a dense model's keys (``blocks.i.attn...``) onto a model whose blocks may be MoD-wrapped
    (``blocks.i.block.attn...``); a key with no place in ``target`` raises."""
    own = target.state_dict()
    out = {}
    for key, value in state.items():
        if key in own:
            out[key] = value
            continue
        parts = key.split(".")
        if parts[0] == "blocks":
            wrapped = ".".join(parts[:2] + ["block"] + parts[2:])
            if wrapped in own:
                out[wrapped] = value
                continue
        raise ValueError(f"weight {key!r} has no place in the adapted model")
    return out


def to_mod(model: SquadViT, capacity: float, routing: str, every: int = 2) -> SquadViT:
    """A copy of a dense ``model`` with MoD blocks carrying its weights (learned routers freshly initialised).

    Args:
        model: a dense SquadViT (every block attn=dense, mlp=dense, no MoD/MoNE).
        capacity: share of tokens each MoD block processes.
        routing: ``"attention"`` (A-MoD) or ``"learned"``.
        every: MoD on every ``every``-th block.
    """
    for i, spec in enumerate(model.cfg.blocks()):
        if spec.attn != "dense" or spec.mlp != "dense" or spec.mod is not None or spec.mone:
            raise ValueError(f"to_mod needs a dense model; block {i} is {spec}")
    data = to_dict(model.cfg)
    data["plan"] = [to_dict(b) for b in mod_plan(model.cfg.depth, routing, every)]
    data["mod"] = {**data["mod"], "capacity": capacity}
    cfg = load_config({"model": data}).model
    adapted = build_model(cfg)
    missing, _ = adapted.load_state_dict(remap_dense_state(model.state_dict(), adapted), strict=False)
    fresh = [k for k in missing if ".router." not in k]
    if fresh:
        raise ValueError(f"adapted model left weights uninitialised: {fresh[:3]}")
    adapted.mone_capacity = model.mone_capacity
    return adapted.train(model.training)


@dataclasses.dataclass
class Fidelity:
    """How closely a model follows a reference on the same images (no labels needed)."""

    top1_agreement: float  # share of images whose argmax class equals the reference's (token/class heads)
    feature_cosine: float  # mean cosine similarity of the final normed tokens


@torch.no_grad()
def fidelity(model: SquadViT, reference: SquadViT, images: torch.Tensor, task: str, batch: int = 16) -> Fidelity:
    """Agreement of ``model`` with ``reference`` on ``images`` for ``task``'s head."""
    agree, cos, n, is_class = 0.0, 0.0, 0, False
    for i in range(0, images.shape[0], batch):
        x = images[i : i + batch]
        fa, fb = model.forward_features(x, task), reference.forward_features(x, task)
        cos += torch.nn.functional.cosine_similarity(fa, fb, dim=-1).mean(1).sum().item()
        pa, pb = model.heads[task](fa), reference.heads[task](fb)
        is_class = pa.dim() == 2
        if is_class:
            agree += (pa.argmax(1) == pb.argmax(1)).float().sum().item()
        n += x.shape[0]
    return Fidelity(agree / n if is_class else float("nan"), cos / n)
