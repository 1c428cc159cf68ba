"""Expert parallelism (squad.layers.parallel): layers whose experts are spread over ranks equal the single-process
layers (outputs and every gradient, float64, 4 gloo ranks under the deepspeed launcher: groups of 2 and of 4), the
exchange moves what it should, shards are invisible to DeepSpeed, and bad sizes are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

import squad
from squad.config.base import ConfigError
from squad.layers.parallel import ExpertGroups, check_size, is_sharded, shard_module, sharded_parameters
from tests.helpers import ROOT, launcher, run_command, tiny_model, tool_env


def _fake_groups(size: int, rank: int) -> ExpertGroups:
    """A layout without a process group: enough to cut shards (nothing is exchanged)."""
    return ExpertGroups(size=size, rank=rank, group=None, data_group=None, data_size=1, name=f"ep_size_{size}")


# ---------------------------------------------------------------------------------------------- no process group
@pytest.mark.parametrize("key,value,words", [
    ("model.moe.expert_parallel", 3, "does not divide model.moe.num_experts=4"),
    ("model.moa.expert_parallel", 0, "must be >= 1"),
])
def test_config_refuses_sizes_that_cannot_split_the_experts(key, value, words):
    data = {"heads": ["depth_euclidean"], "moe": {"num_experts": 4, "top_k": 2}, "moa": {"num_experts": 6,
                                                                                         "top_k": 2}}
    section = key.split(".")[1]
    data[section]["expert_parallel"] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*" + words):
        squad.model_config(data)


def test_world_size_must_be_a_multiple_of_the_group():
    with pytest.raises(ValueError, match=r"model\.moe\.expert_parallel=4 does not divide the 6 ranks"):
        check_size(4, 8, 6, "model.moe.expert_parallel")
    with pytest.raises(ValueError, match="does not divide the layer's 6 experts"):
        check_size(4, 6, 8, "model.moa.expert_parallel")


def test_deepspeed_group_helpers_squad_names_exist():
    """The private `deepspeed.utils.groups` names squad.layers.parallel.groups wraps (a DeepSpeed upgrade that drops
    one fails here, not in a launched run)."""
    from deepspeed.utils import groups

    for name in ("_create_expert_and_data_parallel", "_get_expert_parallel_group", "_get_expert_data_parallel_group",
                 "_get_expert_parallel_group_dict"):
        assert callable(getattr(groups, name)), name


def test_shards_hold_their_rows_and_are_invisible_to_parameters():
    model = tiny_model(["depth_euclidean", "class_scene"])  # MoA (6 heads) + MoE (6 experts) in block 0
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    names_before = {n for n, _ in model.named_parameters()}
    moe, moa = model.blocks[0].mlp.experts, model.blocks[0].attn
    shard_module(moe, 6, _fake_groups(3, 1))
    shard_module(moa, 6, _fake_groups(2, 1))
    assert is_sharded(model)
    shards = {s.name: s for s in sharded_parameters(model)}
    assert set(shards) == {"blocks.0.mlp.experts.w1", "blocks.0.mlp.experts.w2", "blocks.0.mlp.experts.b1",
                           "blocks.0.mlp.experts.b2", "blocks.0.attn.q", "blocks.0.attn.o"}
    assert torch.equal(shards["blocks.0.mlp.experts.w1"].param, whole["blocks.0.mlp.experts.w1"][2:4])
    assert torch.equal(shards["blocks.0.attn.o"].param, whole["blocks.0.attn.o"][3:6])
    assert shards["blocks.0.attn.q"].first == 3 and moa.num_experts == 6 and moe.num_experts == 6
    # DeepSpeed sees neither: not in parameters(), state_dict(), nor moved by .to()
    assert names_before - {n for n, _ in model.named_parameters()} == set(shards)
    assert not set(shards) & set(model.state_dict())
    model.to(torch.float64)
    assert moe.w1.dtype == torch.float32
    with pytest.raises(ValueError, match="sharded already"):
        shard_module(moe, 6, _fake_groups(3, 1))
    with pytest.raises(ValueError, match="cannot drop"):
        model.blocks[0].attn.keep_experts([0, 1])


# ---------------------------------------------------------------------------------------- launched: 2 and 4 ranks
@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    """tests/ep_worker.py on 4 CPU ranks, one launch shared by the assertions: expert-parallel groups of 2 (two of
    them, each expert on 2 ranks: gradients summed over the expert-data-parallel group) and of 4. The 2-rank case
    (groups of 2, no expert-data parallelism) trains in tests/test_expert_parallel_training.py."""
    out = tmp_path_factory.mktemp("ep4") / "results.json"
    cmd = launcher(4) + ["tests/ep_worker.py", "--out", str(out)]
    res = run_command(cmd, ROOT, tool_env(), 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_expert_parallel_layers_equal_the_single_process_layer(worker_results):
    """Every case on every rank: outputs and the gradients of the tokens, gates, routers and the local experts equal
    the single-process layer's in float64 (MoE attention's whole layer in float32: its attention takes no float64;
    its two projections are checked in float64)."""
    assert worker_results["world"] == 4
    cases = 0
    for rank, results in enumerate(worker_results["ranks"]):
        for case in results:
            tol = 1e-5 if case["case"].startswith("moa_layer") else 1e-12
            worst = max(case["diffs"], key=case["diffs"].get)
            assert case["diffs"][worst] < tol, (rank, case["case"], worst, case["diffs"][worst])
            cases += 1
    assert cases >= 10 * worker_results["world"]


@pytest.mark.slow
def test_exchange_moves_every_real_slot_and_nothing_else(worker_results):
    """Dropless: every slot of a real expert is sent (no-op slots are not); when every token chooses the first
    rank's experts, the other ranks of the group receive nothing and the first receives the group's slots."""
    world = worker_results["world"]
    by_case: dict[str, list[dict]] = {}
    for results in worker_results["ranks"]:
        for case in results:
            if "sent" in case:
                by_case.setdefault(case["case"], []).append(case)
    assert by_case
    for name, ranks in by_case.items():
        assert len(ranks) == world
        for case in ranks:
            assert case["sent"] == case["real_slots"], name
        p = int(name.split("P=")[1])
        for start in range(0, world, p):  # per expert-parallel group: what is sent is what is received
            group = ranks[start : start + p]
            assert sum(c["sent"] for c in group) == sum(c["received"] for c in group), name
        if name.startswith("all_on_first_rank"):
            for start in range(0, world, p):
                group = ranks[start : start + p]
                assert group[0]["received"] == sum(c["sent"] for c in group) > 0
                assert all(c["received"] == 0 for c in group[1:])
        if name.startswith("noop_experts"):  # some slots stayed home
            assert any(c["real_slots"] < c["slots"] for c in ranks), name
        else:
            assert all(c["real_slots"] == c["slots"] for c in ranks), name


# ------------------------------------------------------------------------------- the plan: memory and traffic
def test_plan_layouts_count_experts_memory_and_all_to_all():
    """squad.bench.layouts on the ViT-L config: parameter counts, model state per GPU by the ZeRO paper's rules with
    expert shards at 16 bytes per parameter over the group, and all-to-all bytes by the slots that leave a rank."""
    from squad.bench.layouts import GPU_BYTES, all_to_all_bytes, expert_parameters, layout_table, state_bytes

    cfg = squad.load_config("configs/taskonomy/modsquad_vit_l.yaml")
    with torch.device("meta"):
        model = squad.build_model(cfg.model)
    experts = expert_parameters(model)
    assert experts == {"moe": 24 * 64 * (2 * 1024 * 2048 + 2048 + 1024), "moa": 12 * 2 * 64 * 1024 * 64}
    params = sum(p.numel() for p in model.parameters())
    assert 6e9 < params < 7e9 and params * 16 > GPU_BYTES  # its AdamW state alone fills more than one GPU
    dense = params - experts["moe"]
    assert state_bytes(params, experts, "bf16", 1, {"moe": 8, "moa": 1}, 64) == pytest.approx(
        dense * (2 + 2 + 12 / 64) + experts["moe"] / 8 * 16)
    assert state_bytes(params, experts, "bf16", 3, 1, 4) == pytest.approx(params * 16 / 4)
    tokens = 104 * 197  # 8 images × 13 tasks, 197 tokens each
    moe_only = all_to_all_bytes(model, 104, {"moe": 8, "moa": 1})
    assert moe_only == pytest.approx(2 * 24 * tokens * 7 / 8 * 2 * 2 * 1024 * 2)  # 24 layers, top-2, D out and back
    rows = {(r["zero_stage"], r["expert_parallel"]["moe"], r["expert_parallel"]["moa"]): r
            for r in layout_table(model, "bf16", 8, 104, 20 * 2**30, [{"moe": 1, "moa": 1}, {"moe": 8, "moa": 1}])}
    assert not rows[(0, 1, 1)]["fits_80gib"] and rows[(0, 1, 1)]["gpus_needed_80gib"] is None
    ep8 = rows[(0, 8, 1)]
    assert ep8["gpus"] == 8 and ep8["fits_80gib"] and ep8["gpus_needed_80gib"] == 8
    assert rows[(3, 1, 1)]["gpus_needed_80gib"] == 2  # 6.6 B × 16 bytes / 2 + 20 GiB of activations < 80 GiB
    assert rows[(0, 1, 1)]["all_to_all_bytes_per_step"] == 0
    assert rows[(0, 8, 1)]["sync_bytes_per_step"] < rows[(2, 1, 1)]["sync_bytes_per_step"]
