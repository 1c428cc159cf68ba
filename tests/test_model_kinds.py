"""Model kinds end to end (issue 10): MoNE trains (plain and 2 DeepSpeed ranks) and loads α saved 0-dim, task
sampling that leaves a task without images, bf16 on the CPU, average-pooled timm ViTs, and MoNE's token order as
seen by the blocks after it (MoD's keep_cls, A-MoD scores, routing records).

Training runs are real `tools/train.py` subprocesses at test widths (32 px, depth 4, 2 steps) on the session's tiny
synthetic dataset.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch

import squad
from squad.config.base import ConfigError, to_dict
from squad.config.run import TrainConfig, precision
from squad.io import export_model
from squad.layers.mod import MoDBlock
from squad.layers.mone import MoNEBlock
from squad.models.timm import load_timm_weights
from squad.train.objective import MultiTaskObjective
from tests.helpers import ROOT, TINY, launcher, randomize_routers, run_command, tool_env

MONE = "configs/model/mone_vit_s.yaml"



def _train(config: str, out: Path, data: Path, *sets: str, ranks: int = 1) -> subprocess.CompletedProcess:
    """tools/train.py at test widths for 2 steps (under the deepspeed launcher when ranks > 1)."""
    args = [*TINY, "model.head_dim=null", f"data.root={data}", "data.workers=0", "data.val_batches=1",
            "optim.steps=2", "optim.warmup_steps=1", "optim.batch_per_rank=4", "train.eval_every=0",
            "train.ckpt_every=0", "train.progress=false", *sets]
    cmd = ["tools/train.py", "--config", config, "--out", str(out)]
    for a in args:
        cmd += ["--set", a]
    prefix = launcher(ranks)
    return run_command(prefix + cmd, ROOT, tool_env(), 600)


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _mone_model(plan=None, **model) -> squad.SquadViT:
    data = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "task_embed": "none",
            "plan": plan or [{"mone": True}], "mone": {"num_experts": 2, "capacity": 0.6},
            "heads": [{"name": "a", "kind": "dense", "channels": 1}, {"name": "b", "kind": "class", "channels": 3}]}
    data.update(model)
    torch.manual_seed(0)
    m = squad.build_model(squad.model_config(data))
    randomize_routers(m, 0, std=2.0)
    return m.eval()


# ------------------------------------------------------------------------------------- item 2: MoNE trains
def test_mone_alpha_is_one_dim_and_zero_dim_files_still_load(tmp_path):
    model = _mone_model()
    alphas = [b.alpha for b in model.blocks if isinstance(b, MoNEBlock)]
    assert alphas and all(a.shape == (1,) for a in alphas)  # DeepSpeed broadcasts byte views: no 0-dim parameters
    with torch.no_grad():
        for i, a in enumerate(alphas):
            a.fill_(0.1 * (i + 1))
    old = {k: (v.reshape(()) if k.endswith(".alpha") else v) for k, v in model.state_dict().items()}
    fresh = _mone_model()
    fresh.load_state_dict(old)  # plain load_state_dict (user code, DeepSpeed's module load)
    path = export_model(tmp_path / "old.pt", model, None)
    payload = torch.load(path, weights_only=True)
    payload["state_dict"] = old
    torch.save(payload, path)  # a model.pt written while α was 0-dim
    loaded = squad.load(path)  # the shape-checked, meta-built load
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x).preds
        for m in (fresh, loaded):
            got = m(x).preds
            assert all(torch.equal(got[t], want[t]) for t in want)


@pytest.mark.slow
def test_mone_trains_with_plain_python(tiny_data, tmp_path):
    out = tmp_path / "mone"
    _ok(_train(MONE, out, tiny_data))
    model = squad.load(out)
    assert any(isinstance(b, MoNEBlock) for b in model.blocks)
    assert any(float(b.alpha.detach().abs()) > 0 for b in model.blocks if isinstance(b, MoNEBlock))  # α was trained
    squad.load(out / "checkpoints")  # the DeepSpeed checkpoint loads too


@pytest.mark.slow
def test_mone_trains_under_deepspeed_two_ranks(tiny_data, tmp_path):
    out = tmp_path / "mone2"
    _ok(_train(MONE, out, tiny_data, ranks=2))
    assert (out / "model.pt").is_file()
    model = squad.load(out)
    with torch.no_grad():
        assert set(model(torch.randn(1, 3, 32, 32)).preds) == set(model.task_names)


# ------------------------------------------------------------------ item 3: tasks without images in a batch
def test_objective_with_a_task_that_drew_no_image():
    model = _mone_model(plan=[{"attn": "moa", "mlp": "moe"}, {"mone": True}], heads=["class_scene", "depth"],
                        moa={"num_experts": 4, "top_k": 2, "head_dim": 8}, moe={"num_experts": 4, "top_k": 2})
    objective = MultiTaskObjective(model.train(), ["class_scene", "depth_euclidean"], squad.RunConfig(model=model.cfg))
    b = 3
    images = torch.randn(b, 3, 32, 32)
    targets = {"class_scene": torch.softmax(torch.randn(b, 365), 1), "depth_euclidean": torch.rand(b, 1, 32, 32)}
    masks = {"class_scene": torch.ones(b, 1, dtype=torch.bool), "depth_euclidean": torch.ones(b, 1, 32, 32).bool()}
    for empty in (0, 1):
        assignment = torch.zeros(b, 2, dtype=torch.bool)
        assignment[:, 1 - empty] = True
        total, losses, *_ = objective(images, targets, masks, assignment)
        assert float(losses[objective.tasks[empty]].detach()) == 0.0
        assert torch.isfinite(total)
        total.backward()


@pytest.mark.slow
def test_tasks_per_image_trains_when_a_class_task_draws_no_image(tiny_data, tmp_path):
    """13 tasks, 12 images, one task per image: some task gets no image in each step — here a class task."""
    from squad.train.engine import Trainer

    config, sets = "configs/model/modsquad_vit_s.yaml", ["train.tasks_per_image=1", "optim.batch_per_rank=12"]
    cfg = squad.load_config(config, [*TINY, f"data.root={tiny_data}", "optim.steps=2", *sets])
    tasks = cfg.train_tasks()
    trainer = SimpleNamespace(cfg=cfg, rank=0, tasks=tasks)  # the engine's own draw (slot 0), for the precondition
    drawn = [Trainer._assignment(trainer, 12, step, 0) for step in range(2)]
    assert any(not a[:, tasks.index(t)].any() for a in drawn for t in ("class_object", "class_scene"))
    _ok(_train(config, tmp_path / "k1", tiny_data, *sets))


# -------------------------------------------------------------------------------------- item 17: bf16 on CPU
@pytest.mark.slow
def test_bf16_trains_on_the_cpu_and_its_model_loads_as_fp32(tiny_data, tmp_path):
    out = tmp_path / "bf16"
    res = _train("configs/model/mod_vit_s.yaml", out, tiny_data, "train.precision=bf16")
    _ok(res)
    assert "(bf16)" in (out / "train.log").read_text()
    model = squad.load(out)  # the exported weights are bf16; loading gives an fp32 model for fp32 images
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        preds = model(torch.randn(1, 3, 32, 32)).preds
    assert all(torch.isfinite(p).all() for p in preds.values())


def test_fp16_on_the_cpu_is_refused_clearly():
    assert precision(TrainConfig(precision="bf16"), cuda=False) == "bf16"
    assert precision(TrainConfig(precision="auto"), cuda=False) == "fp32"
    with pytest.raises(ConfigError, match=r"train.precision=fp16 needs a GPU.*bf16"):
        precision(TrainConfig(precision="fp16"), cuda=False)


# ------------------------------------------------------------------------- item 16: average-pooled timm ViTs
def _timm_vit(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=7, **kw)
    with torch.no_grad():  # fresh norms are identities: perturb them so a missing or misplaced norm shows
        for name, p in vit.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    return vit.eval()


@pytest.mark.parametrize("kw", [{"global_pool": "avg"}, {"global_pool": "avg", "class_token": False},
                                {"global_pool": "avg", "fc_norm": False}, {"global_pool": "token"}])
def test_from_timm_average_pooling_gives_timm_features_and_logits(kw):
    vit = _timm_vit(**kw)
    model = squad.from_timm(vit).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (model.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5
        if "timm" in model.task_names:
            assert (model(x).preds["timm"] - vit(x)).abs().max() < 1e-5
    avg_fc_norm = kw.get("global_pool") == "avg" and kw.get("fc_norm", True)
    assert model.cfg.final_norm is not avg_fc_norm
    assert model.task_names == (["features"] if kw.get("fc_norm") is False else ["timm"])
    loaded_cfg = squad.model_config(to_dict(model.cfg))
    assert loaded_cfg.final_norm == model.cfg.final_norm  # the field round-trips through model.pt configs


@pytest.mark.parametrize("kw, match", [({"global_pool": "max"}, "global_pool='max'"),
                                       ({"global_pool": "map"}, "attention pooling")])
def test_from_timm_refuses_poolings_it_does_not_model(kw, match):
    with pytest.raises(ValueError, match=match):
        squad.from_timm(_timm_vit(**kw))


def test_avg_pool_weights_into_a_model_with_a_final_norm_are_refused():
    vit = _timm_vit(global_pool="avg")
    plain = squad.build_model(squad.model_config({**to_dict(squad.from_timm(vit).cfg), "final_norm": True}))
    with pytest.raises(ValueError, match="final_norm=false"):
        load_timm_weights(plain, vit.state_dict())


@pytest.mark.slow
def test_adapt_pretrained_on_an_avg_pool_timm_file(tmp_path, capsys):
    from squad.cli.adapt_pretrained import load_dense, main

    vit = _timm_vit(global_pool="avg")
    path = tmp_path / "vit_avg.pth"
    torch.save(vit.state_dict(), path)
    dense = load_dense(str(path), num_heads=3)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (dense.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5
        assert (dense(x).preds["timm"] - vit(x)).abs().max() < 1e-5
    out = tmp_path / "amod.pt"
    assert main(["--checkpoint", str(path), "--num-heads", "3", "--capacity", "1.0", "--out", str(out)]) == 0
    adapted = squad.load(out)
    with torch.no_grad():  # every token through every block: A-MoD at capacity 1 is the timm model
        assert (adapted.forward_features(x) - vit.forward_features(x)).abs().max() < 1e-5


# ------------------------------------------------------------------------ item 19: MoNE's order and other blocks
def _capture(model: squad.SquadViT, x: torch.Tensor, task: str = "a"):
    """The MoNE router block's output and routing order, and every later block's input (forward hooks)."""
    seen = {}

    def after_mone(module, args, out):
        seen["mone_out"], seen["order"] = out.detach(), args[1].mone.order.clone()

    def before(i):
        def hook(module, args):
            seen[i] = args[0].detach()
        return hook

    handles = [model.blocks[0].register_forward_hook(after_mone)]
    handles += [b.register_forward_pre_hook(before(i)) for i, b in enumerate(model.blocks) if i > 0]
    with torch.no_grad():
        model(x, task)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("second", [{"attn": "dense", "mlp": "moe"},
                                    {"attn": "dense", "mlp": "dense", "mod": "learned"},
                                    {"attn": "dense", "mlp": "dense", "mod": "attention"}])
def test_blocks_after_mone_see_tokens_in_their_original_order(second):
    model = _mone_model(plan=[{"mone": True}, second], moe={"num_experts": 4, "top_k": 2})
    seen = _capture(model, torch.randn(3, 3, 32, 32))
    order = seen["order"]
    assert not torch.equal(order, torch.arange(order.shape[1]).expand_as(order))  # MoNE did reorder
    original = torch.empty_like(seen["mone_out"]).scatter(
        1, order[..., None].expand_as(seen["mone_out"]), seen["mone_out"])
    torch.testing.assert_close(seen[1], original)  # the next block gets the tokens back in place


def test_mod_keep_cls_after_mone_keeps_the_class_token():
    model = _mone_model(plan=[{"mone": True}, {"attn": "dense", "mlp": "dense", "mod": "learned"}],
                        mod={"capacity": 0.01, "keep_cls": True})  # k = 1: only the class token goes through
    mod = model.blocks[1]
    assert isinstance(mod, MoDBlock) and mod.keep_cls
    inner = {}
    handle = mod.block.register_forward_pre_hook(lambda m, args: inner.update(x=args[0].detach()))
    seen = _capture(model, torch.randn(3, 3, 32, 32))
    handle.remove()
    order = seen["order"]
    assert (order[:, 0] != 0).any()  # the class token is not first in MoNE's routed order
    cls = seen["mone_out"].gather(1, order.argmin(1).view(-1, 1, 1).expand(-1, 1, seen["mone_out"].shape[2]))
    assert inner["x"].shape[1] == 1
    torch.testing.assert_close(inner["x"], cls)


def test_mixed_mone_plan_trains_and_evaluates():
    model = _mone_model(plan=[{"mone": True}, {"attn": "dense", "mlp": "dense", "mod": "attention"}, {"mone": True}],
                        depth=3)
    x = torch.randn(2, 3, 32, 32)
    out = model.train()(x)
    sum(p.float().square().mean() for p in out.preds.values()).backward()
    with torch.no_grad():
        a = model.eval()(x).preds
        b = model(x.flip(0)).preds  # rows are independent: the batch order does not matter
    assert all(torch.allclose(a[t], b[t].flip(0), atol=1e-5) for t in a)
