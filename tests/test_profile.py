"""MAC counts from routed shapes against PyTorch's FLOP counter on real forward passes; paper-size figures."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

import squad
from squad.layers.experts import grouped_mm_flops
from tests.helpers import MODEL_CONFIGS, tiny_config

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@register_flop_formula(_cpu_flash, get_raw=True)
def _cpu_flash_flops(q, k, v, *args, out_val=None, **kwargs):  # QKᵀ and AV, 2 FLOPs per MAC
    b, h, n, d = q.shape
    return 2 * 2 * b * h * n * k.shape[2] * d


register_flop_formula(torch.ops.aten._grouped_mm, get_raw=True)(grouped_mm_flops)  # the routed layers' matmuls


def _counted_macs(model, task):
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, 32, 32), [task])
    return counter.get_total_flops() // 2


@pytest.mark.parametrize("path", [p for p in MODEL_CONFIGS if p.stem != "amod_vit_s"], ids=lambda p: p.stem)
def test_macs_match_flop_counter(path):
    model = squad.build_model(tiny_config(path).model).eval()
    prof = squad.profile(model)
    for task in model.task_names[:3]:
        assert prof["tasks"][task]["macs"] == _counted_macs(model, task), task


def test_amod_macs_are_mod_without_router():
    # A-MoD's CPU path spends an extra QKᵀ pass on the routing scores (an implementation cost, not model MACs);
    # its model MACs equal learned MoD's minus the router's.
    amod = squad.build_model(tiny_config("configs/model/amod_vit_s.yaml").model)
    mod = squad.build_model(tiny_config("configs/model/mod_vit_s.yaml").model)
    routers = sum(b.router.weight.shape[1] * mod.cfg.num_tokens for b in mod.blocks if hasattr(b, "router"))
    assert squad.profile(amod)["backbone_macs"] == squad.profile(mod)["backbone_macs"] - routers


def test_paper_size_figures():
    torch.set_default_device("meta")  # parameter shapes only: nothing is allocated
    try:
        prof = {n: squad.profile(squad.build_model(squad.load_config(f"configs/model/{n}.yaml").model))
                for n in ["modsquad_vit_b", "mtl_vit_b", "stl_vit_b", "modsquad_vit_s", "mone_vit_s", "mod_vit_s"]}
    finally:
        torch.set_default_device("cpu")
    assert 190e6 <= prof["modsquad_vit_b"]["params"] <= 207e6
    for t in prof["modsquad_vit_b"]["tasks"].values():
        assert 18.5e9 <= t["macs"] <= 21e9
    assert 86e6 <= prof["mtl_vit_b"]["params"] <= 91e6
    assert abs(prof["stl_vit_b"]["backbone_macs"] - 17.6e9) <= 0.3e9
    assert prof["mone_vit_s"]["backbone_macs"] < 0.5 * prof["modsquad_vit_s"]["backbone_macs"]
    # active parameters per token: k of E experts
    msq = prof["modsquad_vit_b"]["tasks"]["depth_euclidean"]
    assert msq["active_params"] < 0.6 * prof["modsquad_vit_b"]["params"]
