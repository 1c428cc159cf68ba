"""Shared rows run once (issue 20): the blocks before the first task-specific block run on the B images, the rows
fan out to the T task rows there, and everything the model returns is what the old layout (every image copied once
per task before the first block) gave, bit for bit — on every layer kind and plan, with and without `assignment`,
in training and evaluation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import squad
from squad.analysis.relations import task_relations
from squad.deploy.export import ExportedSquad
from tests.helpers import randomize_routers

HEADS = [{"name": "a", "kind": "dense", "channels": 2}, {"name": "b", "kind": "class", "channels": 3},
         {"name": "c", "kind": "dense", "channels": 1}]
D = {"attn": "dense", "mlp": "dense"}

# name → (plan, task_embed, index of the first task-specific block (depth 4: 4 = none), extra model fields)
PLANS = {
    "dense_mtl": ([D], "none", 4, {}),
    "every_block_embedding": ([{"attn": "moa", "mlp": "dense"}, {"attn": "dense", "mlp": "moe"}], "every_block", 0,
                              {}),
    "moe_inputs_embedding": ([D, {"attn": "dense", "mlp": "moe"}], "moe_inputs", 1, {}),
    "moa_late": ([D, D, {"attn": "moa", "mlp": "dense"}, D], "none", 2, {}),
    "moe_noisy_router": ([D, D, D, {"attn": "dense", "mlp": "moe"}], "none", 3,
                         {"moe": {"num_experts": 6, "top_k": 2, "router": {"noise": True}}}),
    "mod_learned": ([D, {**D, "mod": "learned"}], "none", 1, {}),
    "amod_dense": ([D, {**D, "mod": "attention"}], "none", 4, {}),  # A-MoD on shared rows: never fans out
    "amod_around_moa": ([D, {"attn": "moa", "mlp": "dense", "mod": "attention"}], "none", 1, {}),  # scores fan out
    "mone_router_late": ([D, {"mone": True}, D, {"mone": True}], "none", 1,
                         {"mone": {"num_experts": 2, "capacity": 0.6}}),  # routed order undone around block 2
}


def _model(name: str) -> squad.SquadViT:
    plan, embed, _, extra = PLANS[name]
    data = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 4, "num_heads": 2, "plan": plan,
            "task_embed": embed, "heads": HEADS,
            "moa": {"num_experts": 6, "top_k": 2, "head_dim": 8, "router": {"noise": False}},
            "moe": {"num_experts": 6, "top_k": 2, "router": {"noise": False}}, "mod": {"capacity": 0.5}, **extra}
    torch.manual_seed(0)
    model = squad.build_model(squad.model_config(data))
    randomize_routers(model, 0, std=1.0)
    with torch.no_grad():
        if model.task_embed is not None:
            model.task_embed.normal_(0, 0.5)  # tasks that differ from block 0 on
    model.record_routing = True
    return model


def _layout(model, b: int, tasks: list[str], assignment):
    tidx = model.task_index(tasks)
    per_task = ([torch.arange(b)] * len(tasks) if assignment is None else
                [assignment[:, j].nonzero().flatten() for j in range(len(tasks))])
    task_ids = torch.cat([torch.full((len(p),), t, dtype=torch.long) for p, t in zip(per_task, tidx, strict=True)])
    segments, start = [], 0
    for t, p in zip(tidx, per_task, strict=True):
        if len(p):
            segments.append((t, start, start + len(p)))
        start += len(p)
    return tidx, per_task, task_ids, segments


def _old_forward(model, images, tasks, assignment=None) -> squad.SquadOutput:
    """The layout before issue 20: every task row copied from its image before the first block."""
    x0 = model.embed(images)
    tidx, per_task, task_ids, segments = _layout(model, images.shape[0], tasks, assignment)
    rows = torch.cat(per_task)
    x = x0.index_select(0, rows) if assignment is not None or len(tasks) > 1 else x0
    tokens, ctx = model.forward_tokens(x, task_ids, segments)
    preds, index, start = {}, {}, 0
    for t, p in zip(tidx, per_task, strict=True):
        name = model.task_names[t]
        preds[name] = model.heads[name](tokens[start:start + len(p)])
        index[name] = p
        start += len(p)
    return squad.SquadOutput(preds, index, ctx.stats)


def _assert_same(new: squad.SquadOutput, old: squad.SquadOutput) -> None:
    assert new.preds.keys() == old.preds.keys()
    for t in old.preds:
        assert torch.equal(new.preds[t], old.preds[t]), f"{t}: {(new.preds[t] - old.preds[t]).abs().max()}"
        assert torch.equal(new.image_index[t], old.image_index[t])
    assert [s.name for s in new.stats] == [s.name for s in old.stats]
    for s_new, s_old in zip(new.stats, old.stats, strict=True):
        for field in dataclasses.fields(s_old):
            a, b = getattr(s_new, field.name), getattr(s_old, field.name)
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b), f"{s_old.name}.{field.name}"
            else:
                assert a == b, f"{s_old.name}.{field.name}"


def _loss(out: squad.SquadOutput) -> torch.Tensor:
    total = sum(p.float().square().mean() for p in out.preds.values())
    for s in out.stats:
        if s.mass is not None:
            total = total + s.mass.square().sum() * 1e-3
        if s.aux_loss is not None:
            total = total + s.aux_loss
    return total


def _assignment(b: int, t: int) -> torch.Tensor:
    a = torch.rand(b, t, generator=torch.Generator().manual_seed(3)) < 0.5
    a[0] = True  # every image runs some task; image 0 all of them
    a[1, 0] = False
    return a


@pytest.mark.parametrize("assigned", [False, True], ids=["all_images", "assignment"])
@pytest.mark.parametrize("name", list(PLANS))
def test_shared_rows_match_the_old_layout(name, assigned):
    model = _model(name)
    images = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tasks = ["a", "b", "c"]
    assignment = _assignment(5, 3) if assigned else None
    for training in (False, True):
        model.train(training)
        torch.manual_seed(7)  # router noise, MoNE capacity draws
        new = model(images, tasks, assignment)
        torch.manual_seed(7)
        old = _old_forward(model, images, tasks, assignment)
        _assert_same(new, old)
        if training:  # gradients: the same sums, added in another order
            grads = []
            for out in (new, old):
                model.zero_grad()
                _loss(out).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            assert grads[0].keys() == grads[1].keys()
            for n in grads[1]:
                torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(PLANS))
def test_blocks_before_the_first_task_specific_one_see_each_image_once(name):
    """A forward hook on every block: B rows before the first task-specific block, T·B from it on."""
    model = _model(name).eval()
    first = PLANS[name][2]
    assert model.first_task_block() == first
    seen = {}
    hooks = [block.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, args[0].shape[0]))
             for i, block in enumerate(model.blocks)]
    try:
        b, tasks = 4, ["a", "b", "c"]
        with torch.no_grad():
            out = model(torch.randn(b, 3, 32, 32), tasks)
    finally:
        for h in hooks:
            h.remove()
    assert seen == {i: (b if i < first else len(tasks) * b) for i in range(4)}
    assert {t: p.shape[0] for t, p in out.preds.items()} == {"a": b, "b": b, "c": b}


def test_shared_model_heads_read_their_images():
    """No task-specific block: with an assignment each head gets only its images' shared rows."""
    model = _model("dense_mtl").eval()
    images = torch.randn(5, 3, 32, 32)
    assignment = _assignment(5, 3)
    with torch.no_grad():
        out = model(images, ["a", "b", "c"], assignment)
        single = {t: model(images[assignment[:, j]], [t]).preds[t] for j, t in enumerate("abc")}
    for t in "abc":
        assert torch.equal(out.preds[t], single[t])


def test_export_program_shares_rows():
    """The export wrapper lays the rows out as the model's forward does (its outputs equal the forward's)."""
    for name in ("dense_mtl", "moa_late", "amod_around_moa"):
        model = _model(name).eval()
        images = torch.randn(3, 3, 32, 32)
        with torch.no_grad():
            wrapped = ExportedSquad(model, ["a", "b", "c"])(images)
            direct = model(images, ["a", "b", "c"]).preds
        for t in direct:
            assert torch.equal(wrapped[t], direct[t]), (name, t)


@pytest.mark.parametrize("name", ["amod_around_moa", "moa_late"])
def test_task_relations_unchanged(name):
    """Task relations read every row's recorded experts (and MoD selections): the same as with copied rows."""
    images = [torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))]
    model = _model(name)
    new = task_relations(model, images).to_dict()
    model.forward = lambda images, tasks=None, assignment=None: _old_forward(model, images, tasks, assignment)
    assert task_relations(model, images).to_dict() == new
