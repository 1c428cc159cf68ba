"""Activation checkpointing (issue 20): `train.activation_checkpointing: none|blocks|every_n` recomputes block
activations in the backward pass. Same loss and gradients as without (router noise included: the RNG state is
restored), routing statistics recorded once, and the peak memory of a training step lower — measured on the CPU by
following every tensor storage (`squad.bench.memory.LiveTensorBytes`).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import squad
from squad.bench.memory import LiveTensorBytes, peak_bytes, tensor_bytes
from squad.config.base import ConfigError
from tests.helpers import ROOT
from tests.test_shared_rows import _loss, _model

TASKS = ["a", "b", "c"]


def _step(name: str, mode: str, every: int = 2):
    model = _model(name).train()
    model.set_activation_checkpointing(mode, every)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)  # router noise, MoNE capacity draws
    with LiveTensorBytes() as mem:
        out = model(images, TASKS)
        loss = _loss(out)
        kept = mem.current  # what the forward leaves for the backward
        layers = [s.name for s in out.stats]
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, layers, [s.name for s in out.stats], kept, mem.peak


# plans with noisy routers (the gradients differ unless the recomputation restores the RNG state), learned and
# attention MoD, MoNE's routed order, the task embedding before every block
@pytest.mark.parametrize("name", ["every_block_embedding", "moe_noisy_router", "mod_learned", "amod_around_moa",
                                  "mone_router_late"])
def test_checkpointing_keeps_loss_and_gradients_and_lowers_memory(name):
    loss, grads, _, layers, kept, peak = _step(name, "none")
    for mode in ("blocks", "every_n"):
        c_loss, c_grads, before, after, c_kept, c_peak = _step(name, mode)
        assert torch.equal(c_loss, loss)
        assert c_grads.keys() == grads.keys()
        for n in grads:
            assert torch.equal(c_grads[n], grads[n]), (mode, n)
        assert before == after == layers  # the recomputation recorded nothing
        assert c_kept < kept and c_peak < peak, (mode, c_kept, kept, c_peak, peak)
        if mode == "blocks":
            assert c_kept < 0.35 * kept  # only block inputs stay (4 blocks)
            blocks_kept = c_kept
        else:
            assert c_kept > blocks_kept  # half of the blocks keep their activations


def test_which_blocks_and_bad_settings():
    model = _model("dense_mtl")
    assert model.checkpointed_blocks() == []
    model.set_activation_checkpointing("blocks")
    assert model.checkpointed_blocks() == [0, 1, 2, 3]
    model.set_activation_checkpointing("every_n", 3)
    assert model.checkpointed_blocks() == [0, 3]
    with pytest.raises(ValueError, match="none', 'blocks' or 'every_n'"):
        model.set_activation_checkpointing("layers")
    with pytest.raises(ValueError, match="n >= 1"):
        model.set_activation_checkpointing("every_n", 0)
    # evaluation and no-grad passes never checkpoint: same outputs, nothing recomputed
    model.set_activation_checkpointing("blocks")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        a = model.eval()(images, TASKS).preds
        model.set_activation_checkpointing("none")
        b = model(images, TASKS).preds
    assert all(torch.equal(a[t], b[t]) for t in TASKS)


def test_config_keys():
    cfg = squad.load_config(ROOT / "configs" / "demo.yaml",
                            ["train.activation_checkpointing=every_n", "train.checkpoint_every=3"])
    assert (cfg.train.activation_checkpointing, cfg.train.checkpoint_every) == ("every_n", 3)
    with pytest.raises(ConfigError, match="train.checkpoint_every"):
        squad.load_config(ROOT / "configs" / "demo.yaml", ["train.checkpoint_every=0"])
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        squad.load_config(ROOT / "configs" / "demo.yaml", ["train.activation_checkpointing=layers"])


def test_memory_measures():
    x = torch.randn(256, 256)
    assert tensor_bytes([x, x[:10], torch.zeros(3)]) == 256 * 256 * 4 + 12
    kept = []

    def work():
        y = x @ x  # 256 KiB alive while z is made
        z = y + 1
        kept.append(z)
        del y

    assert peak_bytes(work, "cpu") == 2 * 256 * 256 * 4
    with LiveTensorBytes() as mem:
        a = torch.ones(1000)
        del a
        b = torch.ones(10)
    assert (mem.peak, mem.current) == (4000, 40) and b.numel() == 10


@pytest.mark.slow
def test_training_run_with_checkpointing_and_zero(tmp_path, tiny_data):
    """A real run (DeepSpeed ZeRO-1, one process): losses of every step are those of the run without it."""
    from squad.train.engine import train

    tiny = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
            "model.head_dim=null", "model.moa.head_dim=8", "model.moa.num_experts=4", "model.moa.top_k=2",
            "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.router.noise=true", f"data.root={tiny_data}",
            "data.workers=0", "optim.steps=3", "optim.batch_per_rank=4", "train.zero_stage=1", "train.log_every=1",
            "train.eval_every=0", "train.progress=false", "data.tasks=[depth_euclidean, normal, class_scene]"]
    losses = {}
    for mode in ("none", "blocks"):
        out = tmp_path / mode
        train(squad.load_config(ROOT / "configs" / "demo.yaml", [*tiny, f"train.activation_checkpointing={mode}"]),
              out, resume="none")
        log = (out / "train.log").read_text()
        losses[mode] = [line.split(" loss ")[1].split()[0] for line in log.splitlines() if " loss " in line]
        assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 1
    assert len(losses["none"]) == 3 and losses["blocks"] == losses["none"]
    a = squad.load(tmp_path / "none")
    b = squad.load(tmp_path / "blocks")
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_a_training_micro_batch_reads_the_device_once(tmp_path, tiny_data, monkeypatch):
    """squad's own code reads a tensor on the host once per training micro-batch (the finite-loss and stop flags):
    the logged losses, task weights, auxiliary terms and expert usage are summed where they were computed and read
    once per logging window — on a GPU each read waits for the queue to drain, and one after the optimizer step
    would keep the next forward from being queued early. Counted on the CPU by the calls that read a tensor
    (``float``, ``item``, ``tolist``, ``cpu``) made from squad's files during the steps (DeepSpeed's own are not
    squad's to remove). The steps take the routed layers' CUDA algorithm (`force_cuda_path`)."""
    from squad.kernels.device import force_cuda_path
    from squad.train import engine as engine_module

    squad_dir, data_dir = str(ROOT / "squad"), str(ROOT / "squad" / "data")  # the loaders' tensors are host ones
    reads = {"steps": 0, "micro": 0}
    counting = [False]

    def spy(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if counting[0] and caller.startswith(squad_dir) and not caller.startswith(data_dir):
                reads[name] = reads.get(name, 0) + 1
            return real(self, *args, **kwargs)

        return read

    for name in ("__float__", "item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    real_step = engine_module.Trainer._step

    def step(self, batches):
        counting[0] = True
        try:
            with force_cuda_path():  # the routed layers' CUDA algorithm (no host sizes), as on a GPU
                return real_step(self, batches)
        finally:
            counting[0] = False
            reads["steps"] += 1
            reads["micro"] += self.cfg.optim.grad_accum

    monkeypatch.setattr(engine_module.Trainer, "_step", step)
    tiny = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
            "model.head_dim=null", "model.moa.head_dim=8", "model.moa.num_experts=4", "model.moa.top_k=2",
            "model.moe.num_experts=4", "model.moe.top_k=2", f"data.root={tiny_data}", "data.workers=0",
            "optim.steps=4", "optim.grad_accum=2", "optim.batch_per_rank=2", "train.log_every=2",
            "train.eval_every=0", "train.progress=false", "data.tasks=[depth_euclidean, normal, class_scene]",
            "loss.weighting=uncertainty"]
    engine_module.train(squad.load_config(ROOT / "configs" / "demo.yaml", tiny), tmp_path / "run", resume="none")
    counted = {k: v for k, v in reads.items() if k not in ("steps", "micro")}
    assert reads["steps"] == 4 and counted == {"__float__": reads["micro"]}, counted
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 2/4 loss" in log and "step 4/4 loss" in log  # the window's sums still reach the log
