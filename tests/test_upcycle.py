"""Sparse upcycling (`squad.upcycle`, tools/upcycle.py, ``train.init``): the exact MoE-MLP scheme, MoA's mapping and
its measured drift, the CLI with bad input, training from an init file, and an upcycled Mod-Squad starting from a
better loss than a fresh one."""

import math

import pytest
import torch

import squad
from squad.models.transfer import upcycle_mlp
from squad.posttrain.upcycle import drift
from tests.helpers import randomize_routers, write_run_config

D, HEADS, DEPTH = 64, 4, 2
TASKS = ["depth_euclidean", "normal"]


def _timm_vit(seed: int = 0):
    """A small timm ViT (no download) with perturbed norms and biases, so that copying them matters."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(seed)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=D,
                            depth=DEPTH, num_heads=HEADS, num_classes=0).eval()
    with torch.no_grad():
        for name, p in vit.named_parameters():
            if "bias" in name or "norm" in name or "embed" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return vit


def _cfg(**model) -> squad.ModelConfig:
    data = {"img_size": 32, "patch_size": 8, "embed_dim": D, "depth": DEPTH, "num_heads": HEADS, "heads": TASKS}
    data.update(model)
    return squad.model_config(data)


EXACT_MOE = {"num_experts": 4, "top_k": 2, "hidden": 4 * D + 16, "router": {"renormalize": True, "noise": True}}
MOA = {"num_experts": 6, "top_k": 2, "head_dim": D // HEADS, "router": {"noise": False}}


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_exact_moe_mlp_scheme_from_timm_file(tmp_path, fmt):
    """Expert copies + renormalised gates: the upcycled model's features equal timm's to 1e-5 for any routing
    (random routers, in eval and with router noise in training mode); 16 extra hidden units per expert add nothing."""
    vit = _timm_vit()
    path = tmp_path / f"vit.{fmt}"
    if fmt == "pth":
        torch.save(vit.state_dict(), path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(path))
    cfg = _cfg(plan=[{"attn": "dense", "mlp": "moe"}], moe=EXACT_MOE, task_embed="every_block")
    model = squad.upcycle(path, cfg)
    randomize_routers(model, std=1.0)
    report = model.upcycle_report
    assert report["exact"] and report["task_embed"] == "zero"
    assert {r["scheme"] for r in report["layers"].values()} == {"copy"}
    assert any(".router." in k for k in report["fresh"]) and not any(".experts." in k for k in report["fresh"])
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref = vit.forward_features(images)
        for mode in (False, True):
            model.train(mode)
            for task in TASKS:
                err = (model.forward_features(images, task) - ref).abs().max().item()
                assert err < 1e-5, (mode, task, err)
        experts = model.eval()(images).stats[0].counts.sum(0)
    assert (experts > 0).sum() >= 2  # the routing really spreads tokens over several experts


def test_exact_moe_mlp_scheme_from_dense_squad_model(tmp_path):
    """From a dense squad model (file and object): task embeddings and heads are copied, outputs equal to 1e-5."""
    torch.manual_seed(0)
    dense = squad.build_model(_cfg(task_embed="every_block")).eval()
    with torch.no_grad():
        dense.task_embed.normal_(0, 0.5)
        for name, p in dense.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    squad.io.export_model(tmp_path / "dense" / "model.pt", dense, None)
    cfg = _cfg(plan=[{"attn": "dense", "mlp": "moe"}, {"attn": "dense", "mlp": "dense", "mod": "attention"}],
               moe=EXACT_MOE, task_embed="every_block", mod={"capacity": 1.0})
    images = torch.randn(3, 3, 32, 32)
    for source in (dense, tmp_path / "dense", tmp_path / "dense" / "model.pt"):
        model = squad.upcycle(source, cfg)
        randomize_routers(model, std=1.0)
        assert model.upcycle_report["heads_copied"] == TASKS
        assert model.upcycle_report["task_embed"] == "copied"
        with torch.no_grad():
            out, ref = model(images), dense(images)
        for task in TASKS:
            err = (out.preds[task] - ref.preds[task]).abs().max().item()
            assert err < 1e-5, (source, task, err)
    # the MoD block (A-MoD at capacity 1: every token, unscaled) got its dense weights under blocks.1.block.*
    assert torch.equal(model.blocks[1].block.mlp.fc1.weight, dense.blocks[1].mlp.fc1.weight)


def test_timm_position_grid_is_resampled_to_the_configs_image_size():
    """A 32 px timm ViT into a 64 px config: the position grid is resampled as timm resamples it, so the dense
    upcycled model equals timm's own 64 px model carrying the same weights."""
    from timm.layers import resample_abs_pos_embed

    vit = _timm_vit()
    state = vit.state_dict()
    big = pytest.importorskip("timm").create_model("vit_tiny_patch16_224", pretrained=False, img_size=64,
                                                   patch_size=8, embed_dim=D, depth=DEPTH, num_heads=HEADS,
                                                   num_classes=0).eval()
    big.load_state_dict({**state, "pos_embed": resample_abs_pos_embed(state["pos_embed"], (8, 8),
                                                                      num_prefix_tokens=1)})
    model = squad.upcycle(state, _cfg(img_size=64, task_embed="none"))
    assert model.upcycle_report["pos_embed_resampled"] == "4x4 -> 8x8 (bicubic)"
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        err = (model.forward_features(images, TASKS[0]) - big.forward_features(images)).abs().max().item()
    assert err < 1e-5, err


def test_partition_scheme_is_exact_when_the_k_experts_hold_distinct_slices():
    """h = H/k: expert e holds hidden slice e mod k; with equal gates over k distinct slices the layer is the dense
    MLP (with or without renormalised gates, whose compensation differs); repeated slices are not."""
    torch.manual_seed(0)
    dense = squad.build_model(_cfg()).blocks[0].mlp
    x = torch.randn(5, D)
    for renorm in (True, False):
        model = squad.build_model(_cfg(plan=[{"attn": "dense", "mlp": "moe"}],
                                       moe={"num_experts": 6, "top_k": 3, "router": {"renormalize": renorm}}))
        moe = model.blocks[0].mlp
        r = upcycle_mlp(moe, dense)
        assert r["scheme"] == "partition" and not r["exact"]
        gate = 1 / 3 if renorm else 1 / 6  # the gate of an undecided router: 1/k renormalised, 1/E otherwise
        gates = torch.full((5, 3), gate)
        with torch.no_grad():
            distinct = moe.experts(x, gates, torch.tensor([[0, 4, 2]] * 5))  # slices 0, 1, 2
            repeated = moe.experts(x, gates, torch.tensor([[0, 3, 1]] * 5))  # slices 0, 0, 1
            want = dense(x)
        assert (distinct - want).abs().max() < 1e-5
        assert (repeated - want).abs().max() > 1e-3


def test_moa_weights_come_from_the_dense_heads_and_drift_is_measured(tmp_path):
    """Expert e = dense head e mod h (its query and scaled output projection), the shared K/V = the heads' mean (or
    head 0's); the step-0 drift of MoA alone and of the full Mod-Squad is finite, non-zero and reported."""
    vit = _timm_vit()
    state = vit.state_dict()
    dense = squad.upcycle(state, _cfg(task_embed="none"))
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert (dense.forward_features(images, TASKS[0]) - vit.forward_features(images)).abs().max() < 1e-5
    h, d = HEADS, D // HEADS
    results = {}
    for kv in ("mean", "first"):
        torch.manual_seed(1)
        model = squad.upcycle(state, _cfg(plan=[{"attn": "moa", "mlp": "dense"}], moa=MOA), kv=kv)
        layer = model.blocks[0].attn
        report = model.upcycle_report["layers"]["blocks.0.attn"]
        w = state["blocks.0.attn.qkv.weight"].view(3, h, d, D)
        b = state["blocks.0.attn.qkv.bias"].view(3, h, d)
        proj = state["blocks.0.attn.proj.weight"].view(D, h, d)
        scale = h / (MOA["top_k"] / MOA["num_experts"])  # h / (k·ḡ); gates not renormalised: ḡ = 1/E
        assert report["heads"] == [e % h for e in range(MOA["num_experts"])] and report["o_scale"] == scale
        for e in range(MOA["num_experts"]):
            torch.testing.assert_close(layer.q[e], w[0, e % h].t())
            torch.testing.assert_close(layer.o[e], proj[:, e % h].t() * scale)
        pick = (lambda t: t.mean(0)) if kv == "mean" else (lambda t: t[0])
        torch.testing.assert_close(layer.kv.weight, torch.cat([pick(w[1]), pick(w[2])]))
        torch.testing.assert_close(layer.kv.bias, torch.cat([pick(b[1]), pick(b[2])]))
        torch.testing.assert_close(layer.proj_bias, state["blocks.0.attn.proj.bias"])
        assert not report["exact"] and any("key/value" in why for why in report["why"])
        results[kv] = drift(model, dense, images)
    torch.manual_seed(1)
    full = squad.upcycle(state, _cfg(plan=[{"attn": "moa", "mlp": "dense"}, {"attn": "dense", "mlp": "moe"}],
                                     moa=MOA, moe={"num_experts": 4, "top_k": 2}))
    results["modsquad"] = drift(full, dense, images)
    for name, r in results.items():
        print(f"step-0 drift ({name}): features {r['max_features']:.4f}, blocks {[round(v, 4) for v in r['blocks']]}")
        assert math.isfinite(r["max_features"]) and 1e-4 < r["max_features"] < 1.0, (name, r)
        assert all(math.isfinite(v) for v in r["blocks"])


# --------------------------------------------------------------------------------------------------- the tool
def _tool_args(source, out, *extra):
    return ["--from", str(source), "--config", "modsquad_vit_s", "--out", str(out), "--images", "2",
            "--set", "img_size=32", "--set", "patch_size=8", "--set", f"embed_dim={D}", "--set", f"depth={DEPTH}",
            "--set", f"num_heads={HEADS}", "--set", "head_dim=null", "--set", f"moa.head_dim={D // HEADS}",
            "--set", "moa.num_experts=4", "--set", "moa.top_k=2", "--set", "moe.num_experts=4", "--set", "moe.top_k=2",
            "--set", f"heads=[{','.join(TASKS)}]", *extra]


def test_upcycle_tool_end_to_end_and_bad_input(tmp_path, load_tool, capsys):
    tool = load_tool("tools/upcycle.py")
    vit = _timm_vit()
    src = tmp_path / "vit.pth"
    torch.save(vit.state_dict(), src)
    out = tmp_path / "init.pt"
    assert tool.main(_tool_args(src, out)) == 0
    printed = capsys.readouterr().out
    assert "blocks.0.attn: moa mean" in printed and "blocks.1.mlp: moe partition" in printed
    assert "step-0 drift" in printed
    model = squad.load(out)  # a squad model file
    assert model.task_names == TASKS and model.blocks[0].attn.q.shape == (4, D, D // HEADS)
    extra = model.meta["extra"]
    assert extra["upcycled_from"] == str(src) and math.isfinite(extra["drift"]["max_features"])
    assert extra["upcycle"]["layers"]["blocks.1.mlp"]["scheme"] == "partition"

    def fails(args, *needles):
        assert tool.main(args) == 2
        err = capsys.readouterr().err
        for needle in needles:
            assert needle in err, err

    assert tool.main(_tool_args(src, tmp_path / "init64.pt", "--set", "img_size=64")) == 0
    assert "position embeddings resampled: 4x4 -> 8x8" in capsys.readouterr().out
    fails(_tool_args(tmp_path / "missing.pth", out), "missing.pth", "not found")
    fails(_tool_args(src, out, "--set", "embed_dim=96"), str(src), "patch_embed.proj.weight", "[64, 3, 8, 8]",
          "model.embed_dim=96")
    fails(_tool_args(src, out, "--set", "head_dim=32"), "blocks.1.attn.qkv.weight", "[192, 64]", "[384, 64]",
          "model.head_dim")
    fails(_tool_args(src, out, "--set", "moa.head_dim=8"), "model.moa.head_dim=8", "16 wide")
    fails(_tool_args(src, out, "--set", "depth=4"), "2 blocks", "model.depth=4")
    fails(_tool_args(src, out, "--moe-scheme", "copy"), "model.moe.hidden", "256")
    (tmp_path / "junk.pth").write_bytes(b"not a model")
    fails(_tool_args(tmp_path / "junk.pth", out), "junk.pth", "not a readable model file")
    torch.save({"weight": torch.zeros(3)}, tmp_path / "other.pth")
    fails(_tool_args(tmp_path / "other.pth", out), "other.pth", "not a timm VisionTransformer state dict")
    fails(_tool_args(out, tmp_path / "again.pt"), str(out), "block 0 is not dense")  # a Mod-Squad is no source


# ----------------------------------------------------------------------------------------------- train.init
@pytest.mark.slow
def test_training_starts_from_train_init_and_resume_takes_precedence(tmp_path, tiny_data, one_thread):
    from squad.config.base import ConfigError, to_dict
    from squad.train.engine import train

    cfg_file = write_run_config(tmp_path / "run.yaml", tiny_data, TASKS, optim={"steps": 2, "lr": 1e-12,
                                                                               "min_lr": 0.0, "warmup_steps": 0})
    run_cfg = squad.load_config(cfg_file)
    dense = squad.build_model(squad.model_config({**to_dict(run_cfg.model),
                                                  "plan": [{"attn": "dense", "mlp": "dense"}]}))
    squad.io.export_model(tmp_path / "dense.pt", dense, None)
    init = tmp_path / "init.pt"
    up = squad.upcycle(tmp_path / "dense.pt", run_cfg)
    squad.io.export_model(init, up, None)

    with pytest.raises(ConfigError, match=r"train\.init: .*nowhere\.pt not found"):
        train(squad.load_config(cfg_file, [f"train.init={tmp_path / 'nowhere.pt'}"]), tmp_path / "bad",
              resume="none")
    assert not (tmp_path / "bad").exists()  # checked before the run folder is made

    for source, how in ((init, "loaded"), (tmp_path / "dense.pt", "upcycled")):
        out = tmp_path / f"run_{how}"
        model_pt = train(squad.load_config(cfg_file, [f"train.init={source}"]), out, resume="none")
        trained = squad.load(model_pt)
        assert trained.meta["extra"]["init"] == str(source)
        assert f"initialised from train.init={source} ({how}" in (out / "train.log").read_text()
        # lr 1e-12: the weights are still the init's
        torch.testing.assert_close(trained.blocks[0].attn.q, up.blocks[0].attn.q, atol=1e-6, rtol=0)
        torch.testing.assert_close(trained.patch_embed.proj.weight, dense.patch_embed.proj.weight, atol=1e-6, rtol=0)

    # a run stopped at step 1 resumes from its checkpoint even though the init file is gone
    gone = tmp_path / "gone.pt"
    gone.write_bytes(init.read_bytes())
    over = [f"train.init={gone}", "train.stop_at=1", "optim.lr=1e-3", "optim.min_lr=1e-6"]
    out = tmp_path / "run_resumed"
    train(squad.load_config(cfg_file, over), out, resume="auto")
    gone.unlink()
    train(squad.load_config(cfg_file, over[:1] + over[2:]), out, resume="auto")
    log = (out / "train.log").read_text()
    assert "not loaded: the run resumes from its checkpoint" in log and (out / "model.pt").is_file()

    # a file whose architecture differs is refused naming the tensor and both shapes
    with pytest.raises(ValueError, match=r"init\.pt: blocks\.0\.mlp\.router\.gate\.weight has shape \[2, 32, 4\] "
                                         r"but the run's model needs \[2, 32, 2\]"):
        train(squad.load_config(cfg_file, [f"train.init={init}", "model.moe.num_experts=2"]), tmp_path / "mismatch",
              resume="none")


# ------------------------------------------------------------------------------------ better start than fresh
def _batches(root, n: int, size: int = 8):
    from squad.data import build_dataset, collate

    ds = build_dataset(root, TASKS, "train", image_size=32, augment=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=size, shuffle=False, collate_fn=collate, drop_last=True)
    return [b for _, b in zip(range(n), loader, strict=False)]


def _loss(objective, batch) -> float:
    with torch.no_grad():
        _, losses, _, _, _ = objective(batch["rgb"], batch["targets"], batch["masks"])
    return sum(float(v) for v in losses.values())


@pytest.fixture
def one_thread():
    """One intra-op thread: these models are tiny, and several spinning threads on a busy machine cost 10×."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_upcycled_modsquad_starts_from_a_better_loss_than_a_fresh_one(tiny_data, one_thread):
    """A tiny dense model trained for 80 steps, upcycled into a tiny Mod-Squad (paper defaults: MoA 4 experts top-2
    with mean K/V, MoE 4 experts top-2 of width 4D/k by partition, gates not renormalised): its step-0 loss on the
    training batches is far below a freshly initialised Mod-Squad's, and close to the dense model's."""
    from squad.train.objective import MultiTaskObjective

    torch.manual_seed(0)
    base = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "heads": TASKS}
    run = squad.load_config({"model": {**base, "task_embed": "none"}, "loss": {"weighting": "equal", "w_mi": 0.0},
                             "optim": {"steps": 1}})
    dense = squad.build_model(run.model)
    objective = MultiTaskObjective(dense, TASKS, run)
    batches = _batches(tiny_data, 3)
    opt = torch.optim.AdamW(dense.parameters(), lr=3e-3, weight_decay=0.0)
    dense.train()
    for step in range(80):
        batch = batches[step % len(batches)]
        total, *_ = objective(batch["rgb"], batch["targets"], batch["masks"])
        opt.zero_grad()
        total.backward()
        opt.step()
    dense.eval()
    modsquad = squad.model_config({**base, "plan": [{"attn": "moa", "mlp": "dense"}, {"attn": "dense", "mlp": "moe"}],
                                   "moa": {"num_experts": 4, "top_k": 2, "head_dim": 16, "router": {"noise": False}},
                                   "moe": {"num_experts": 4, "top_k": 2, "router": {"noise": False}},
                                   "task_embed": "every_block"})
    losses, models = {}, {"dense": dense}
    for name in ("upcycled", "fresh"):
        torch.manual_seed(1)  # the same fresh routers in both
        models[name] = squad.upcycle(dense, modsquad) if name == "upcycled" else squad.build_model(modsquad).eval()
    for name, model in models.items():
        losses[name] = sum(_loss(MultiTaskObjective(model, TASKS, run), b) for b in batches) / len(batches)
    moved = drift(models["upcycled"], dense, batches[0]["rgb"])["max_features"]
    print("step-0 loss (sum of the task losses, mean over 3 training batches):",
          {k: round(v, 4) for k, v in losses.items()}, f"upcycled feature drift {moved:.4f}")
    assert losses["upcycled"] < losses["fresh"] - 0.5 * (losses["fresh"] - losses["dense"]), losses
