"""How a loaded model runs at inference: MoNE's effective capacity e_c and MoD's routing mode (top-k or threshold),
set on the model and refused where the model cannot take them (`set_inference`), and read back
(`inference_settings`). Every tool that runs a saved model uses them.
"""

from __future__ import annotations

import dataclasses

from squad.layers.mod import MoDBlock
from squad.layers.mone import MoNEBlock


def set_inference(model, mone_capacity: float | None = None, mod_inference: str | None = None) -> dict:
    """Sets how a loaded model runs at inference: MoNE's effective capacity and MoD's routing mode.

    Args:
        model: a `SquadViT` or `SingleTaskModel` (changed in place; an extraction of it keeps the settings).
        mone_capacity: MoNE effective capacity e_c in [1/2^(E-1), 1] (None: leave it).
        mod_inference: ``"topk"`` (k = ceil(C · N) tokens per MoD block) or ``"threshold"`` (the tokens whose
            learned router logit is > 0, i.e. sigmoid > 0.5; needs learned MoD routers trained with
            ``model.mod.aux_loss``) (None: leave it).

    Returns:
        The settings now in effect (`inference_settings`).

    Raises:
        ValueError: a setting for a model without such blocks, e_c out of range, an unknown mode, or threshold
            inference the model's MoD routers were not trained for.
    """
    inner = getattr(model, "model", model)
    mod = [m for m in inner.modules() if isinstance(m, MoDBlock)]
    if mone_capacity is not None:
        if not any(isinstance(m, MoNEBlock) for m in inner.modules()):
            raise ValueError(f"mone_capacity (--mone-capacity) applies to Mixture of Nested Experts models; this "
                             f"model ({inner.cfg.name}) has no MoNE blocks")
        inner.set_mone_capacity(float(mone_capacity))
    if mod_inference is not None:
        if mod_inference not in ("topk", "threshold"):
            raise ValueError(f"mod_inference (--mod-inference) must be topk or threshold, got {mod_inference!r}")
        if not mod:
            raise ValueError(f"mod_inference (--mod-inference) applies to Mixture-of-Depths models; this model "
                             f"({inner.cfg.name}) has no MoD blocks")
        if mod_inference == "threshold":
            if not any(b.routing == "learned" for b in mod):
                raise ValueError("threshold MoD inference keeps the tokens whose learned router logit is > 0; this "
                                 "model's MoD blocks route on attention (A-MoD) and have no router to threshold: "
                                 "use topk")
            if not inner.cfg.mod.aux_loss:
                raise ValueError("threshold MoD inference needs routers trained to threshold (model.mod.aux_loss="
                                 "true, the BCE against top-k membership); this model was trained without it, so "
                                 "its router logits carry no threshold: use topk")
        new = dataclasses.replace(inner.cfg.mod, inference=mod_inference)
        new.check("model.mod")
        for block in mod:
            block.cfg = new
        inner.cfg = dataclasses.replace(inner.cfg, mod=new)
    return inference_settings(inner)


def inference_settings(model) -> dict:
    """``{"mone_capacity": e_c}`` for a MoNE model, ``{"mod_inference": mode, "mod_capacity": C}`` for a MoD model
    (both for a model with both kinds; ``{}`` for neither)."""
    inner = getattr(model, "model", model)
    out: dict = {}
    if any(isinstance(m, MoNEBlock) for m in inner.modules()):
        out["mone_capacity"] = float(inner.mone_capacity)
    mod = [m for m in inner.modules() if isinstance(m, MoDBlock)]
    if mod:
        learned = any(b.routing == "learned" for b in mod)
        out["mod_inference"] = mod[0].cfg.inference if learned else "topk"
        out["mod_capacity"] = float(mod[0].cfg.capacity)
    return out
