"""The tools on every model kind (issue 10, items 14 and 15): extract, visualize and evaluate each do their
documented thing on dense MTL, MoD, A-MoD and MoNE models or refuse saying why; MoNE's e_c and MoD's threshold
inference are settable from every tool, and the share of tokens MoD blocks actually processed gives the MACs."""

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import squad
from squad.config.base import ConfigError
from squad.data import eval_loader
from squad.eval.evaluate import compute_summary, evaluate
from squad.io import export_model
from squad.layers.mod import MoDBlock
from squad.models.inference import set_inference
from tests.helpers import ROOT, randomize_routers, tiny_config
from tests.test_profile import _counted_macs  # noqa: F401  (registers the FLOP formulas of the CPU ops)

HEADS = ["depth_euclidean", "normal", "class_scene"]
CONFIGS = {"mtl": "mtl_vit_b", "mod": "mod_vit_s", "amod": "amod_vit_s", "mone": "mone_vit_s"}


def _model(kind: str, extra: list[str] | None = None, seed: int = 0) -> squad.SquadViT:
    """A tiny model of a shipped config (3 heads), routers random so that tasks route differently."""
    path = ROOT / "configs" / "model" / f"{CONFIGS[kind]}.yaml"
    cfg = tiny_config(path, [f"model.heads=[{','.join(HEADS)}]", *(extra or [])])
    torch.manual_seed(seed)
    model = squad.build_model(cfg.model)
    randomize_routers(model, seed)
    return model.eval()


def _export(tmp_path, kind: str, extra: list[str] | None = None, trained=HEADS, name: str = "run"):
    """A run folder holding the model's model.pt, with the usage statistics of a short pass (as training saves)."""
    model = _model(kind, extra)
    usage = squad.models.usage.ExpertUsage(model.task_names)
    with torch.no_grad():
        usage.update(model(torch.randn(2, 3, 32, 32)).stats)
    run = tmp_path / name
    export_model(run / "model.pt", model, usage, {"step": 3, "trained_tasks": list(trained)})
    return run, model


def _strict_json(path):
    """JSON without NaN / Infinity (which json.dumps writes, but JSON does not allow)."""
    def refuse(name):
        raise ValueError(f"{path}: {name} in JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


# ------------------------------------------------------------------------------------------------------ extract
@pytest.mark.parametrize("kind", ["mtl", "mod", "amod", "mone"])
def test_extract_on_a_model_without_experts_keeps_one_task(kind, tmp_path, tiny_data, load_tool, capsys):
    run, model = _export(tmp_path, kind)
    tool = load_tool("tools/extract.py")
    out = tmp_path / "depth.pt"
    args = ["--checkpoint", str(run), "--task", "depth", "--out", str(out), "--data", str(tiny_data),
            "--eval-batches", "1"]
    assert tool.main(args) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "no experts could be pruned" in printed and "nan" not in printed
    report = _strict_json(out.with_suffix(".json"))
    assert report["pruned"] is False and report["layers"] == {} and report["experts"]["ratio"] is None
    assert report["usage"]["kind"].startswith("none")  # no calibration pass: nothing to calibrate
    assert report["params"]["extracted"] < report["params"]["full"]  # the other heads and router rows are gone
    assert report["metrics"]["extracted"] == pytest.approx(report["metrics"]["full"], rel=1e-5)
    ext = squad.load_extracted(out)
    assert ext.model.task_names == ["depth_euclidean"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ext(x), model(x, ["depth_euclidean"]).preds["depth_euclidean"])


def test_extract_refuses_tasks_the_run_never_trained_or_the_model_lacks(tmp_path, load_tool, capsys):
    run, _ = _export(tmp_path, "mod", trained=["depth_euclidean", "normal"])
    tool = load_tool("tools/extract.py")
    assert tool.main(["--checkpoint", str(run), "--task", "scene", "--out", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert "never trained class_scene" in err and "trained depth_euclidean, normal" in err
    assert tool.main(["--checkpoint", str(run), "--task", "keypoints2d", "--out", str(tmp_path / "x.pt")]) == 2
    assert "unknown task 'keypoints2d': this model has depth_euclidean, normal, class_scene" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_extracted_model_keeps_the_inference_settings(tmp_path, load_tool, capsys):
    tool = load_tool("tools/extract.py")
    run, model = _export(tmp_path, "mone", name="mone")
    out = tmp_path / "mone_depth.pt"
    assert tool.main(["--checkpoint", str(run), "--task", "depth", "--mone-capacity", "0.5", "--out", str(out)]) == 0
    assert _strict_json(out.with_suffix(".json"))["inference"] == {"mone_capacity": 0.5}
    ext = squad.load_extracted(out)
    assert ext.model.mone_capacity == 0.5
    model.set_mone_capacity(0.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ext(x), model(x, ["depth_euclidean"]).preds["depth_euclidean"])
    run, model = _export(tmp_path, "mod", ["model.mod.aux_loss=true"], name="mod")
    out = tmp_path / "mod_depth.pt"
    assert tool.main(["--checkpoint", str(run), "--task", "depth", "--mod-inference", "threshold", "--out",
                      str(out)]) == 0
    ext = squad.load_extracted(out)
    assert ext.model.cfg.mod.inference == "threshold"
    assert all(b.cfg.inference == "threshold" for b in ext.model.modules() if isinstance(b, MoDBlock))
    set_inference(model, mod_inference="threshold")
    with torch.no_grad():
        torch.testing.assert_close(ext(x), model(x, ["depth_euclidean"]).preds["depth_euclidean"])


# ----------------------------------------------------------------------------------------------------- visualize
def test_visualize_mod_draws_the_tokens_each_block_processed(tmp_path, tiny_data, load_tool, capsys):
    run, _ = _export(tmp_path, "mod", ["model.mod.aux_loss=true"])
    tool = load_tool("tools/visualize.py")
    out = tmp_path / "figs"
    base = ["--checkpoint", str(run), "--data", str(tiny_data), "--batches", "1", "--tb", "none"]
    assert tool.main([*base, "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.glob("*.png")) == [f"tokens_{t}.png" for t in sorted(HEADS)]
    numbers = _strict_json(out / "figures.json")
    assert numbers["token_maps"] == {"images": 4, "layers": ["blocks.1", "blocks.3"],
                                     "kinds": {"blocks.1": "mod", "blocks.3": "mod"}}
    assert numbers["mod"]["blocks"] == ["blocks.1", "blocks.3"] and numbers["mod"]["mode"] == "topk"
    k = math.ceil(0.5 * 17) / 17  # top-k: every task processes k = ceil(C · N) of N = 17 tokens
    assert sum(numbers["mod"]["share"], []) == pytest.approx([k] * 6)
    thr = tmp_path / "thr"
    assert tool.main([*base, "--out", str(thr), "--mod-inference", "threshold"]) == 0
    numbers = _strict_json(thr / "figures.json")
    assert numbers["mod"]["mode"] == "threshold" and numbers["inference"]["mod_inference"] == "threshold"
    share = torch.tensor(numbers["mod"]["share"])
    assert share.shape == (3, 2) and not torch.allclose(share, torch.full_like(share, k))


def test_visualize_mone_draws_tokens_per_nested_expert(tmp_path, tiny_data, load_tool, capsys):
    run, _ = _export(tmp_path, "mone")
    tool = load_tool("tools/visualize.py")
    base = ["--checkpoint", str(run), "--data", str(tiny_data), "--batches", "1", "--tb", "none"]
    shares = {}
    for cap in ("0.3", "1.0"):
        out = tmp_path / cap
        assert tool.main([*base, "--out", str(out), "--mone-capacity", cap]) == 0, capsys.readouterr().err
        assert sorted(p.name for p in out.glob("*.png")) == ["mone_router_blocks.0.router.png",
                                                             "mone_tokens_blocks.0.router.png",
                                                             *(f"tokens_{t}.png" for t in sorted(HEADS))]
        numbers = _strict_json(out / "figures.json")
        assert numbers["mone"]["widths"] == ["D/8", "D/4", "D/2", "D"]
        tokens = torch.tensor(numbers["mone"]["routers"]["blocks.0.router"]["tokens"])
        torch.testing.assert_close(tokens.sum(1), torch.ones(3, dtype=tokens.dtype))
        shares[cap] = tokens
    assert shares["1.0"][:, -1].tolist() == [1.0, 1.0, 1.0]  # e_c = 1: every token at full width
    assert shares["0.3"][:, -1].max() < 1.0


def test_visualize_refuses_before_creating_anything(tmp_path, tiny_data, load_tool, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tool = load_tool("tools/visualize.py")
    assert tool.main(["--checkpoint", "runs/missing"]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no ./runs/figures for a checkpoint that is not there
    run, _ = _export(tmp_path, "mtl", name="mtl")
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--tb", "none"]) == 2
    assert "has no routed layers" in capsys.readouterr().err
    assert not (run / "figures").exists()
    run, _ = _export(tmp_path, "amod", name="amod")
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mod-inference", "threshold"]) == 2
    assert "attention" in capsys.readouterr().err and not (run / "figures").exists()
    assert tool.main(["--checkpoint", str(run), "--mod-inference", "topk"]) == 2  # settings need a calibration pass
    assert "pass data=" in capsys.readouterr().err and not (run / "figures").exists()


# ---------------------------------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("value", [0.05, 0.1, 0.125, 0.3, 1.0, 1.5, 0.0, float("nan")])
def test_mone_capacity_setter_and_config_agree(value):
    model = _model("mone")
    try:
        model.cfg.mone.__class__(**{**vars(model.cfg.mone), "capacity": value}).check("model.mone")
        config_ok = True
    except ConfigError:
        config_ok = False
    try:
        model.set_mone_capacity(value)
        setter_ok = True
    except ValueError as e:
        assert "[1/8, 1]" in str(e)
        setter_ok = False
    assert setter_ok == config_ok, value
    assert setter_ok == (value in (0.125, 0.3, 1.0))


def test_evaluate_sets_mone_capacity_and_reports_its_compute(tmp_path, tiny_data, load_tool, capsys):
    run, _ = _export(tmp_path, "mone")
    tool = load_tool("tools/evaluate.py")
    macs = {}
    for cap in ("0.25", "1.0"):
        out = tmp_path / f"{cap}.json"
        assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mone-capacity", cap, "--out",
                          str(out)]) == 0, capsys.readouterr().err
        compute = _strict_json(out)["compute"]
        assert compute["inference"] == {"mone_capacity": float(cap)}
        assert set(compute["mone_tokens"]["blocks.0.router"]) == set(HEADS)
        macs[cap] = compute["macs"]["depth_euclidean"]
    assert macs["0.25"] < macs["1.0"]
    assert "mone_capacity 0.25" in capsys.readouterr().out
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mone-capacity", "0.05"]) == 2
    assert "must be in [1/8, 1]" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mod-inference", "topk"]) == 2
    assert "has no MoD blocks" in capsys.readouterr().err


def test_evaluate_threshold_reports_the_share_processed_and_macs_from_it(tmp_path, tiny_data, load_tool, capsys):
    run, model = _export(tmp_path, "mod", ["model.mod.aux_loss=true"])
    tool = load_tool("tools/evaluate.py")
    out = tmp_path / "thr.json"
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mod-inference", "threshold", "--out",
                      str(out)]) == 0, capsys.readouterr().err
    assert "processed" in capsys.readouterr().out
    compute = _strict_json(out)["compute"]
    assert compute["inference"] == {"mod_inference": "threshold", "mod_capacity": 0.5}
    # the same pass by hand: share = tokens whose router logit is > 0 (the class token always), per task and block
    set_inference(model, mod_inference="threshold")
    ds = squad.data.build_dataset(tiny_data, HEADS, "val", image_size=32, augment=False)
    kept = {b.layer_name: torch.zeros(3, dtype=torch.float64) for b in model.blocks if isinstance(b, MoDBlock)}

    def count(block, args, output):
        x, ctx = args[0], args[1]
        keep = block._scores(x, ctx)[1] > 0
        keep[:, 0] = True  # keep_cls
        kept[block.layer_name] += ctx.per_task_sum(keep.sum(1).double())

    hooks = [b.register_forward_hook(count) for b in model.blocks if isinstance(b, MoDBlock)]
    try:
        usage = squad.models.usage.ExpertUsage(model.task_names)
        evaluate(model, eval_loader(ds, 8), HEADS, usage=usage)
    finally:
        for h in hooks:
            h.remove()
    for layer, per_task in compute["mod_tokens"].items():
        expect = kept[layer] / (len(ds) * 17)
        assert [per_task[t] for t in HEADS] == pytest.approx(expect.tolist()), layer
    assert compute == compute_summary(model, HEADS, usage)
    assert compute["macs_measured"] != compute["macs"]
    # refusals: A-MoD has no router to threshold; a router trained without the aux BCE has no threshold
    for kind, extra, message in [("amod", [], "route on attention"), ("mod", [], "aux_loss")]:
        run, _ = _export(tmp_path, kind, extra, name=f"{kind}_plain")
        assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mod-inference", "threshold"]) == 2
        assert message in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(run), "--data", str(tiny_data), "--mone-capacity", "0.5"]) == 2
    assert "has no MoNE blocks" in capsys.readouterr().err


def test_profile_with_measured_mod_shares_matches_the_flop_counter():
    model = _model("mod", ["model.mod.aux_loss=true", "model.mod.inference=threshold"])
    blocks = [b.layer_name for b in model.blocks if isinstance(b, MoDBlock)]
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        stats = model(x, ["normal"]).stats
    share = {s.name: {"normal": float(s.counts[1, 0] / s.tokens[1])} for s in stats if s.kind == "mod"}
    assert set(share) == set(blocks)
    assert any(v["normal"] != math.ceil(0.5 * 17) / 17 for v in share.values())  # not the top-k count
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x, ["normal"])  # the same image: one image, so its processed count is a whole number of tokens
    counted = counter.get_total_flops() // 2
    assert squad.profile(model, ["normal"], mod_share=share)["tasks"]["normal"]["macs"] == counted
    # the share of top-k routing gives the capacity count; every token gives a capacity-1 model's count
    topk = {b: {"normal": math.ceil(0.5 * 17) / 17} for b in blocks}
    assert squad.profile(model, mod_share=topk)["tasks"]["normal"]["macs"] == squad.profile(model)["tasks"]["normal"][
        "macs"]
    full = _model("mod", ["model.mod.capacity=1.0"])
    every = {b: {"normal": 1.0} for b in blocks}
    assert squad.profile(model, ["normal"], mod_share=every)["tasks"]["normal"]["macs"] == squad.profile(
        full, ["normal"])["tasks"]["normal"]["macs"]
    with pytest.raises(ValueError, match="not a MoD block"):
        squad.profile(model, mod_share={"blocks.0": {"normal": 0.5}})
    with pytest.raises(ValueError, match="must be in"):
        squad.profile(model, mod_share={blocks[0]: {"normal": 1.5}})
