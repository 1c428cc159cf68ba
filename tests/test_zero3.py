"""ZeRO-3 (``train.zero_stage: 3``): every shipped model config trains as at ZeRO stage 0 (2 gloo ranks, one launch
of tests/zero3_worker.py); a ZeRO-3 tag opens as one model from its partitions (squad.io.zero3). Resuming a ZeRO-3
run, with expert parallelism, is in tests/test_expert_parallel_training.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import MODEL_CONFIGS, ROOT, launcher, run_command, tool_env


@pytest.fixture(scope="module")
def every_config(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero3") / "results.json"
    cmd = launcher(2) + ["tests/zero3_worker.py", "--out", str(out), *map(str, MODEL_CONFIGS)]
    res = run_command(cmd, ROOT, tool_env(), 900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_shipped_config_trains_at_zero3_as_at_zero0(every_config):
    """Same losses and weights after 2 AdamW steps with clipping, on every rank (one config with activation
    checkpointing)."""
    assert every_config["world"] == 2
    for rank, results in enumerate(every_config["ranks"]):
        assert set(results) == {p.stem for p in MODEL_CONFIGS}
        for name, r in results.items():
            assert "error" not in r, (rank, name, r.get("error"))
            assert r["zero0"] == pytest.approx(r["zero3"], rel=1e-5, abs=1e-6), (rank, name)
            assert r["weights"] < 1e-5, (rank, name, r["weights"])
            assert r["zero0"][1] != r["zero0"][0]  # the step changed the model
        assert any(r["checkpointing"] == "blocks" for r in results.values())


def test_zero3_partitions_put_back_together(tmp_path):
    """`squad.io.zero3.fp32_state_dict` on a hand-made 2-rank tag: parameters split into ceil(n / 2) partitions laid
    end to end per rank (the last padded), buffers from rank 0, frozen parameters from their fragments."""
    from squad.io.zero3 import fp32_state_dict, is_zero3_tag

    a, b, frozen = torch.arange(5.0), torch.arange(6.0).view(2, 3) + 10, torch.arange(3.0) + 100
    shapes = [{"a": torch.Size([5]), "b": torch.Size([2, 3])}]
    parts = [torch.cat([a[:3], b.flatten()[:3]]), torch.cat([a[3:], torch.zeros(1), b.flatten()[3:]])]
    for r in range(2):
        states = {"module": {"buf": torch.ones(2)} if r == 0 else {}, "buffer_names": ["buf"], "param_shapes": shapes,
                  "dp_world_size": 2, "frozen_param_shapes": {"f": torch.Size([3])},
                  "frozen_param_fragments": {"f": frozen[:2] if r == 0 else torch.cat([frozen[2:], torch.zeros(1)])},
                  "shared_params": {"a_alias": "a"}}
        torch.save(states, tmp_path / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {"fp32_flat_groups": [parts[r]]}},
                   tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    assert is_zero3_tag(tmp_path)
    state = fp32_state_dict(tmp_path)
    assert torch.equal(state["a"], a) and torch.equal(state["b"], b) and torch.equal(state["f"], frozen)
    assert torch.equal(state["buf"], torch.ones(2)) and state["a_alias"] is state["a"]
