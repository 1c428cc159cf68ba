"""The routed-layer contract, walked over every routed layer kind: one `RouterStats` per pass through
`RoutedLayer.report`, one MAC signature, `keep_experts` on the expert layers, MoNE's α upgrade in one place."""

import inspect

import pytest
import torch

import squad.layers
from squad.config.model import BlockSpec, MoAConfig, MoDConfig, MoEConfig, MoNEConfig, RouterConfig
from squad.layers.attention import Attention
from squad.layers.base import EXPERT_KINDS, ExpertLayer, RoutedLayer
from squad.layers.block import Block
from squad.layers.context import ForwardContext
from squad.layers.mlp import Mlp
from squad.layers.mod import MoDBlock
from squad.layers.moe_attention import MoEAttention
from squad.layers.moe_mlp import MoEMlp
from squad.layers.mone import MoNEBlock, MoNERouter, upgrade_legacy_alpha
from tests.helpers import tiny_model_cfg

D, N, TASKS = 16, 9, [0, 1, 1]  # odd token count; task 1 has two rows
ROUTER = RouterConfig(noise=False)


def _randomize(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "router" in name or "proj.weight" in name:
                p.normal_(0, 0.5)


def _moe():
    return MoEMlp(D, 12, MoEConfig(num_experts=5, top_k=2, noop_experts=1, router=ROUTER), num_tasks=2)


def _moa():
    return MoEAttention(D, MoAConfig(num_experts=5, top_k=2, head_dim=8, router=ROUTER), num_tasks=2)


def _mod(routing):
    cfg = tiny_model_cfg(embed_dim=D, num_heads=2)
    block = Block(cfg, BlockSpec(attn="dense", mlp="dense"), num_tasks=2)
    return MoDBlock(block, MoDConfig(capacity=0.4, aux_loss=True), routing, D, 2, class_token=True)


def _mone():
    return MoNEBlock(D, 2, 2 * D, MoNEConfig(num_experts=3, capacity=0.5), num_tasks=2, has_router=True)


# kind → (case name, builder); MoNE's router reports from inside the first MoNE block
CASES = {"moe": [("moe", _moe)], "moa": [("moa", _moa)],
         "mod": [("mod_learned", lambda: _mod("learned")), ("mod_attention", lambda: _mod("attention"))],
         "mone": [("mone", _mone)]}


def _routed(module):
    return next(m for m in module.modules() if isinstance(m, RoutedLayer))


def _context(record=False):
    ctx = ForwardContext(task_ids=torch.tensor(TASKS), num_tasks=2, record_routing=record)
    ctx.attn_scores = torch.rand(len(TASKS), N)  # A-MoD's scores from "the previous attention layer"
    return ctx


def _all_routed_classes():
    seen, todo = set(), [RoutedLayer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("squad.layers.") and sub not in seen:
                seen.add(sub)
                todo.append(sub)
    return {c for c in seen if c.kind}


def test_every_routed_layer_kind_is_walked():
    """A new routed layer kind must join this contract test."""
    kinds = {c.kind for c in _all_routed_classes()}
    assert kinds == set(CASES)
    assert {c for c in _all_routed_classes() if issubclass(c, ExpertLayer)} == {MoEMlp, MoEAttention}
    assert set(EXPERT_KINDS) == {MoEMlp.kind, MoEAttention.kind}
    assert squad.layers.__doc__ and "base" in squad.layers.__doc__


@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("kind,case,build", [(k, n, b) for k, cases in CASES.items() for n, b in cases],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_each_pass_reports_one_stats_through_report(kind, case, build, record):
    torch.manual_seed(0)
    module = build().train()
    _randomize(module)
    layer = _routed(module)
    layer.layer_name = f"blocks.7.{case}"
    ctx = _context(record)
    reported = []
    original = RoutedLayer.report

    def spy(self, *args, **kwargs):
        reported.append(self)
        return original(self, *args, **kwargs)

    RoutedLayer.report = spy
    try:
        y = module(torch.randn(len(TASKS), N, D), ctx)
    finally:
        RoutedLayer.report = original
    assert y.shape == (len(TASKS), N, D)
    assert reported == [layer] and len(ctx.stats) == 1
    (s,) = ctx.stats
    assert (s.name, s.kind) == (layer.layer_name, kind)
    assert s.tokens.tolist() == [N, 2 * N]  # the per-task token count, made in one place
    assert s.counts.shape[0] == 2 and not s.counts.requires_grad
    per_token = s.top_k if kind in EXPERT_KINDS else 1
    assert torch.allclose(s.counts.sum(1), s.tokens * per_token)  # every token counted k times (MoD: kept or not)
    if kind == "mod":
        assert s.mass is None and (s.aux_loss is not None) == (case == "mod_learned")  # attention routing: none
    else:
        assert torch.allclose(s.mass.sum(1), s.tokens, atol=1e-4)  # probabilities sum to one per token
    assert (s.experts is not None) == record  # every routed layer records each token's choice when asked
    if s.experts is not None:  # [R·N, k]: each token's columns of the counts (MoD: 0 processed, 1 skipped)
        assert s.experts.shape == (len(TASKS) * N, s.top_k)
        rows = s.experts.view(len(TASKS), -1)
        chosen = torch.zeros(len(TASKS), s.counts.shape[1]).scatter_add_(1, rows, torch.ones(rows.shape))
        assert torch.equal(ctx.per_task_sum(chosen), s.counts)  # the record is what the counts counted


@pytest.mark.parametrize("cls", sorted(_all_routed_classes() | {Block, Mlp, Attention, MoNEBlock},
                                       key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_one_mac_signature(cls):
    params = list(inspect.signature(cls.macs).parameters.values())
    assert len(params) == 3 and params[2].name == "capacity" and params[2].default is None, params


@pytest.mark.parametrize("kind,case,build", [(k, n, b) for k, cases in CASES.items() for n, b in cases],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_macs_take_the_capacity_their_layer_has(kind, case, build):
    module = build()
    assert module.macs(N) == module.macs(N, None) > 0
    if kind == "mod":  # the share of tokens processed: at capacity C·N tokens, interpolated between whole counts
        k = module.capacity_tokens(N)
        assert module.macs(N, k / N) == pytest.approx(module.macs(N))
        assert module.macs(N, 1.0) > module.macs(N) > module.macs(N, 1 / N)
        half = module.macs(N, (k + 0.5) / N)
        assert module.macs(N, k / N) < half < module.macs(N, (k + 1) / N)
    elif kind == "mone":  # the effective capacity
        assert module.macs(N, 1.0) > module.macs(N, 0.5) == module.macs(N) > module.macs(N, 0.25)
    else:
        assert module.macs(N, 0.5) == module.macs(N)


@pytest.mark.parametrize("build", [_moe, _moa], ids=["moe", "moa"])
def test_expert_layers_remove_experts_themselves(build):
    torch.manual_seed(0)
    layer = build().eval()
    _randomize(layer)
    layer.layer_name = "blocks.0.x"
    x = torch.randn(len(TASKS), N, D)
    x[..., 0] = 5.0
    with torch.no_grad():
        layer.router.gate.weight[:, 0, 1] = -10.0  # no token picks expert 1
        before = layer(x, _context())
        used = sorted(set(layer.router(x, _context()).experts.flatten().tolist()) & set(range(layer.num_experts)))
    e, k = layer.num_experts, layer.top_k
    assert "top_k" not in vars(layer) and "num_experts" not in vars(layer)  # one home each: router, weights
    unused = [i for i in range(e) if i not in used]
    assert unused, "the test wants an expert no token chose"
    router_macs = layer.router.macs(N)

    layer.keep_experts(used, exact=True)
    assert layer.num_experts == len(used) and layer.top_k == min(k, len(used)) == layer.router.top_k
    with torch.no_grad():
        torch.testing.assert_close(layer(x, _context()), before, rtol=0, atol=0)  # nothing used was removed
    assert layer.router.macs(N) == router_macs  # exact routing still scores every expert
    with pytest.raises(ValueError, match="pruned already"):
        layer.keep_experts([0])

    fresh = build()
    for bad in ([], [0, 0], [e], [-1]):
        with pytest.raises(ValueError, match=r"blocks\.0\.x|kept experts"):
            fresh.layer_name = "blocks.0.x"
            fresh.keep_experts(bad)
    assert fresh.num_experts == e  # a refused call changes nothing
    noop = fresh.router.choices - e  # MoE MLP's no-op experts stay selectable
    fresh.keep_experts([e - 1], exact=False)
    assert fresh.num_experts == 1 and fresh.top_k == min(k, 1 + noop) and fresh.router.choices == 1 + noop
    assert fresh.router.macs(N) < router_macs  # the pruned router scores the kept experts (and no-op ones)
    with torch.no_grad():
        assert fresh(x, _context()).shape == x.shape


def test_mone_alpha_saved_zero_dim_loads_through_one_rule():
    block = _mone()
    state = block.state_dict()
    state["alpha"] = torch.tensor(0.25)  # a file written while α was 0-dim
    assert upgrade_legacy_alpha({"blocks.2.alpha": state["alpha"]})["blocks.2.alpha"].shape == (1,)
    assert upgrade_legacy_alpha({"x.weight": torch.tensor(1.0)})["x.weight"].dim() == 0  # only α
    block.load_state_dict(state)
    assert block.alpha.shape == (1,) and block.alpha.item() == 0.25
    assert isinstance(block.router, MoNERouter)
