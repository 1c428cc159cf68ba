"""Every shipped model config under ZeRO-3 against ZeRO-0, on every rank of a launched job.

Run by tests/test_zero3.py under ``deepspeed --num_gpus N`` (CPU, gloo). For each config (shrunk to test widths), the
same model is trained 2 steps from the same weights on the same random images at ZeRO stage 0 and at stage 3 (the
parameters partitioned over the ranks, gathered per module), with AdamW and gradient clipping; the loss is every
head's mean squared prediction plus the config's auxiliary losses (MI, balance, MoD's router loss) from the routers'
statistics, so every parameter of every layer kind takes part. One config also runs with activation checkpointing.
Rank 0 writes, per config, both runs' losses and the largest difference of the final float32 weights to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class SyntheticObjective(nn.Module):
    """The model and a loss every parameter takes part in (no data needed)."""

    def __init__(self, model, loss_cfg):
        super().__init__()
        self.model = model
        self.loss_cfg = loss_cfg

    def forward(self, images):
        from squad.train.losses import auxiliary_loss

        out = self.model(images)
        task = sum(p.float().pow(2).mean() for p in out.preds.values())
        aux, _ = auxiliary_loss(out.stats, self.loss_cfg)
        return task + aux.to(task.device)


def train_two_steps(cfg, stage: int, checkpointing: str, rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from squad.models.vit import build_model
    from squad.train.optim import param_groups

    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.set_activation_checkpointing(checkpointing, 2)
    objective = SyntheticObjective(model, cfg.loss)
    optimizer = torch.optim.AdamW(param_groups(objective, 0.05), lr=1e-3)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5, "zero_optimization": {"stage": stage},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=objective, optimizer=optimizer, config=ds)
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(1000 * step + rank)
        images = torch.randn(2, cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size, generator=g)
        torch.manual_seed(step * 7 + rank)  # router noise
        loss = engine(images)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    weights = {n: safe_get_full_fp32_param(p).detach().clone() if stage == 3 else p.detach().clone()
               for n, p in engine.module.named_parameters()}
    return losses, weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("configs", nargs="+")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from squad.distributed import init_distributed, shutdown
    from tests.helpers import tiny_config

    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    results = {}
    for i, path in enumerate(args.configs):
        cfg = tiny_config(path)
        checkpointing = "blocks" if i == 0 else "none"
        try:
            ref, w_ref = train_two_steps(cfg, 0, checkpointing, rank)
            z3, w_z3 = train_two_steps(cfg, 3, checkpointing, rank)
            diff = max(float((w_ref[n] - w_z3[n]).abs().max()) for n in w_ref)
            results[Path(path).stem] = {"zero0": ref, "zero3": z3, "weights": diff, "checkpointing": checkpointing}
        except Exception as e:  # noqa: BLE001 - reported per config
            results[Path(path).stem] = {"error": f"{type(e).__name__}: {e}"}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world": world, "ranks": gathered}, indent=1))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
