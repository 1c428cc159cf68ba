"""Task relations from recorded routing, the figures (PNG, JSON, TensorBoard), and tools/evaluate.py."""

import json

import pytest
import torch

import squad
from squad.analysis.figures import draw_figures
from squad.analysis.relations import task_relations
from squad.config.tools import VisualizeConfig
from squad.io import export_model
from squad.layers.routing import TaskLinear
from squad.posttrain.extract import collect_usage
from tests.helpers import tiny_model

HEADS = ["depth_euclidean", "normal", "edge_texture"]
MOD_VARIANTS = {
    "learned": {},
    "attention": dict(plan=[{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "attention"}]),
    "threshold": dict(mod={"capacity": 0.5, "aux_loss": True, "inference": "threshold"}),
}


def _images(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 3, 32, 32, generator=g) for _ in range(n)]


@torch.no_grad()
def _copy_task(model, src: int, dst: int) -> None:
    """Task ``dst`` routes exactly like task ``src`` (router rows and embedding copied)."""
    for m in model.modules():
        if isinstance(m, TaskLinear):
            m.weight[dst] = m.weight[src]  # the stored parameter itself (no added tasks here)
    model.task_embed[dst] = model.task_embed[src]


@pytest.mark.parametrize("variant", sorted(MOD_VARIANTS))
def test_relations_are_one_for_identical_routers_and_symmetric(variant):
    model = tiny_model(HEADS, **MOD_VARIANTS[variant])
    _copy_task(model, 0, 1)
    rel = task_relations(model, _images())
    assert rel.layers == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.block.mlp"]
    for layer in rel.layers:
        m = rel.matrix(layer)
        assert torch.allclose(m, m.T) and torch.allclose(m.diagonal(), torch.ones(3, dtype=m.dtype))
        assert m[0, 1] == pytest.approx(1.0)  # same routing for every token
        assert 0.0 <= m[0, 2] < 1.0 and 0.0 <= m[1, 2] < 1.0
    summary = rel.summary()
    assert set(summary) == {"all", "first", "middle", "last"}
    assert "blocks.1.block.mlp" in summary["last"][0]
    assert model.record_routing is False  # switched back off


def test_relation_is_the_mean_share_of_common_experts():
    model = tiny_model(HEADS)
    x = _images(1)[0]
    rel = task_relations(model, [x])
    model.record_routing = True
    with torch.no_grad():
        out = model(x)
    model.record_routing = False
    stats = next(s for s in out.stats if s.name == "blocks.0.mlp")
    sel = stats.experts.view(3, -1, 2)  # [T, B·N, k], task-major rows
    share = torch.tensor([[len(set(a.tolist()) & set(b.tolist())) / 2 for a, b in zip(sel[i], sel[j], strict=True)]
                          for i in range(3) for j in range(3)]).mean(1).view(3, 3)
    torch.testing.assert_close(rel.matrix("blocks.0.mlp"), share.double())


def test_routing_is_not_recorded_by_default():
    model = tiny_model(HEADS)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32))
    assert all(s.experts is None for s in out.stats)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    (run / "tensorboard").mkdir()
    model = tiny_model(HEADS)
    usage = collect_usage(model, "depth", _images())
    export_model(run / "model.pt", model, usage, {"step": 7, "trained_tasks": HEADS})
    return run


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_figures_are_written_with_data(run_dir, tiny_data, tmp_path):
    out = tmp_path / "figs"
    cfg = VisualizeConfig(data=str(tiny_data), split="val", batches=1, batch_size=4, images=2)
    result = draw_figures(squad.load_model(run_dir), out, cfg, tb_dir=run_dir / "tensorboard")
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == ["relations_all.png", "relations_first.png", "relations_last.png", "relations_middle.png",
                     "tokens_depth_euclidean.png", "tokens_edge_texture.png", "tokens_normal.png",
                     "usage_blocks.0.attn.png", "usage_blocks.0.mlp.png", "usage_blocks.1.block.mlp.png"]
    assert sorted(result["token_maps"]) == [str(out / f"tokens_{t}.png") for t in sorted(HEADS)]
    for p in out.glob("*.png"):
        assert _is_png(p) and p.stat().st_size > 5000, p
    numbers = json.loads((out / "figures.json").read_text())
    assert numbers["relations"]["tasks"] == HEADS
    assert len(numbers["usage"]["blocks.0.mlp"]["share"]) == 3
    assert numbers["mod"] == {"mode": "topk", "blocks": ["blocks.1"], "share": [[9 / 17], [9 / 17], [9 / 17]]}
    assert numbers["token_maps"] == {"images": 2, "layers": ["blocks.1"], "kinds": {"blocks.1": "mod"}}
    assert result["tensorboard"] == str(run_dir / "tensorboard")
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_visualize_tool_without_data_uses_saved_usage(run_dir, tmp_path, load_tool, capsys):
    tool = load_tool("tools/visualize.py")
    out = tmp_path / "figs"
    assert tool.main(["--checkpoint", str(run_dir / "model.pt"), "--out", str(out), "--tb", "none"]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["usage_blocks.0.attn.png", "usage_blocks.0.mlp.png",
                                                         "usage_blocks.1.block.mlp.png"]  # token maps need images
    assert "saved in model.pt" in capsys.readouterr().out
    bare = tmp_path / "bare.pt"
    export_model(bare, tiny_model(HEADS), None)
    assert tool.main(["--checkpoint", str(bare), "--out", str(out), "--tb", "none"]) == 2
    assert "pass data=" in capsys.readouterr().err


def test_evaluate_tool_metrics_side_by_side_and_delta_t(run_dir, tiny_data, tmp_path, load_tool, capsys):
    ev = load_tool("tools/evaluate.py")
    base = tmp_path / "base.json"
    assert ev.main(["--checkpoint", str(run_dir), "--data", str(tiny_data), "--split", "val", "--out", str(base)]) == 0
    results = json.loads(base.read_text())
    assert set(results["metrics"]) == set(HEADS) and "rmse" in results["metrics"]["depth_euclidean"]
    ext = tmp_path / "depth.pt"
    extract = load_tool("tools/extract.py")
    assert extract.main(["--checkpoint", str(run_dir), "--task", "depth", "--saved-usage", "--out", str(ext)]) == 0
    out = tmp_path / "both.json"
    capsys.readouterr()
    assert ev.main(["--checkpoint", str(run_dir), "--checkpoint", str(ext), "--data", str(tiny_data), "--baseline",
                    str(base), "--out", str(out)]) == 0
    both = json.loads(out.read_text())
    full, single = both["models"][run_dir.name], both["models"]["depth"]
    assert set(single["metrics"]) == {"depth_euclidean"}
    assert full["delta_t"]["mean"] == pytest.approx(0.0) and full["delta_t"]["per_task"]["normal"] == 0.0
    assert f"Δt {run_dir.name}: mean +0.00%" in capsys.readouterr().out
    assert ev.main(["--checkpoint", str(run_dir), "--data", str(tiny_data), "--tasks", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert ev.main(["--checkpoint", str(run_dir), "--data", str(tiny_data), "--baseline", str(tmp_path / "x")]) == 2
    assert "baseline results file not found" in capsys.readouterr().err
