"""Token maps (squad.analysis.token_maps): the tokens each MoD / A-MoD block processed and each token's MoNE width, as
drawn over the image, are the layers' recorded choices — checked on a fixed image against what the blocks actually
received, and against the arrays the figure draws."""

import pytest
import torch

from squad.analysis.token_maps import token_figure, token_maps
from squad.layers.mod import MoDBlock
from squad.layers.mone import MoNERouter
from tests.helpers import tiny_model

HEADS = ["depth_euclidean", "normal", "edge_texture"]
MOD_VARIANTS = {
    "learned": {},
    "attention": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "attention"}]),
    "threshold": dict(mod={"capacity": 0.5, "aux_loss": True, "inference": "threshold"}),
}


def _image(n: int = 2) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(7))  # the fixed images


def _overlays(fig, maps):
    """The map arrays the figure draws: per image row, the last image of each layer's panel."""
    cols = 1 + len(maps.layers)
    return [[fig.axes[i * cols + j].images[-1].get_array() for j in range(1, cols)]
            for i in range(len(fig.axes) // cols)]


@pytest.mark.parametrize("variant", sorted(MOD_VARIANTS))
def test_mod_map_is_the_set_of_tokens_the_block_received(variant):
    model = tiny_model(HEADS, **MOD_VARIANTS[variant])
    if variant == "threshold":  # a router bias that lets some rows through more than others
        with torch.no_grad():
            model.blocks[1].router.weight.mul_(4.0)
    x = _image()
    received: dict[str, list[torch.Tensor]] = {}  # per task pass: [R, N] bool, the tokens each block processed

    def outer(module, args):
        received["input"] = args[0]

    def inner(module, args, kwargs):
        given, mask = args[0], kwargs.get("key_mask")
        full = received.pop("input")  # [R, N, D]; each given token is one of them, copied unchanged
        hit = (given[:, :, None, :] == full[:, None, :, :]).all(-1)  # [R, k, N]
        if mask is not None:
            hit &= mask[:, :, None]
        received.setdefault("done", []).append(hit.any(1))

    mod = [m for m in model.modules() if isinstance(m, MoDBlock)]
    handles = [h for m in mod for h in (m.register_forward_pre_hook(outer),
                                        m.block.register_forward_pre_hook(inner, with_kwargs=True))]
    try:
        maps = token_maps(model, x)
    finally:
        for h in handles:
            h.remove()
    assert maps.layers == [m.layer_name for m in mod] and set(maps.kinds.values()) == {"mod"}
    g = model.cfg.grid
    for t, task in enumerate(HEADS):  # token_maps runs one task per pass, MoD blocks in order
        done = received["done"][t * len(mod):(t + 1) * len(mod)]
        for layer, truth in zip(maps.layers, done, strict=True):
            drawn = maps.maps[task][layer]  # [B, g, g]
            assert drawn.shape == (2, g, g)
            assert torch.equal(drawn.bool(), truth[:, 1:].reshape(2, g, g)), (variant, task, layer)
            if variant != "threshold":
                k = mod[0].capacity_tokens(model.cfg.num_tokens) - int(mod[0].keep_cls)  # patches processed
                assert drawn.flatten(1).sum(1).tolist() == [k, k]
        fig = token_figure(x, maps, task)
        for i, row in enumerate(_overlays(fig, maps)):
            for layer, array in zip(maps.layers, row, strict=True):
                assert (array == maps.maps[task][layer][i].numpy()).all()
    if variant == "threshold":
        counts = {tuple(maps.maps[t][maps.layers[0]].flatten(1).sum(1).tolist()) for t in HEADS}
        assert len({c for pair in counts for c in pair}) > 1  # threshold: rows keep different numbers of tokens


def test_mone_map_is_each_tokens_nested_width():
    model = tiny_model(HEADS, plan=[{"mone": True}, {"mone": True}], mone={"num_experts": 3, "capacity": 0.5})
    x = _image()
    states = []
    router = next(m for m in model.modules() if isinstance(m, MoNERouter))
    handle = router.register_forward_hook(lambda m, args, out: states.append(args[1].mone))
    try:
        maps = token_maps(model, x)
    finally:
        handle.remove()
    assert maps.layers == [router.layer_name] and maps.mone_experts == 3
    d, g = model.cfg.embed_dim, model.cfg.grid
    for task, state in zip(HEADS, states, strict=True):
        width = torch.empty(state.order.shape)  # [R, N]: the width each original token ran at, from the state
        for start, end, w in state.slices:
            width.scatter_(1, state.order[:, start:end], w / d)
        drawn = maps.maps[task][router.layer_name]
        assert torch.equal(drawn, width[:, 1:].reshape(2, g, g))
        assert len(drawn.unique()) > 1  # e_c 0.5: several widths
        fig = token_figure(x, maps, task)
        for i, row in enumerate(_overlays(fig, maps)):
            assert (row[0] == drawn[i].numpy()).all()


def test_token_maps_need_mod_or_mone():
    with pytest.raises(ValueError, match="no token maps"):
        token_maps(tiny_model(HEADS, plan=[{"attn": "moa", "mlp": "moe"}] * 2), _image())
