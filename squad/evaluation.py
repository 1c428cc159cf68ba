"""Metrics of a model on a dataset, per task (additive statistics summed over batches and ranks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

from squad.data import collate
from squad.tasks import get_task
from squad.usage import ExpertUsage


class ShardSampler(Sampler[int]):
    """This rank's share of a dataset in order (rank, rank + world, ...): no padding, no duplicates."""

    def __init__(self, length: int, rank: int = 0, world: int = 1):
        self.indices = list(range(rank, length, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def eval_loader(dataset, batch_size: int, workers: int = 0) -> DataLoader:
    """An in-order loader over this rank's shard of ``dataset``."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), rank, world),
                      num_workers=workers, collate_fn=collate)


@torch.no_grad()
def evaluate(model, loader, tasks: Sequence[str], device: torch.device | str = "cpu", max_batches: int = 0,
             dtype: torch.dtype | None = None, usage: ExpertUsage | None = None) -> dict[str, dict[str, float]]:
    """Every task's metrics over ``loader`` (all ranks' shares combined).

    Args:
        model: a `SquadViT` (or anything with the same call signature).
        loader: batches from `squad.data.collate`.
        tasks: the tasks to score (all run in one fused pass per batch).
        device: where to run.
        max_batches: stop after this many batches per rank (0 = all).
        dtype: input dtype (e.g. bfloat16 for a bf16 model).
        usage: when given, the routing statistics of the pass are added to it (calibration).

    Returns:
        task → metric → value (in the units the task's `decode` gives).
    """
    was_training = model.training
    model.eval()
    specs = {t: get_task(t) for t in tasks}
    sums: dict[str, dict[str, torch.Tensor]] = {t: {} for t in tasks}
    try:
        for i, batch in enumerate(loader):
            if max_batches and i >= max_batches:
                break
            images = batch["rgb"].to(device)
            if dtype is not None:
                images = images.to(dtype)
            out = model(images, list(tasks))
            if usage is not None:
                usage.update(out.stats)
            for t, pred in out.preds.items():
                task = specs[t]
                target = task.target(batch["targets"][t].to(device))
                part = task.metric_sums(pred.float(), target, batch["masks"][t].to(device))
                for k, v in part.items():
                    sums[t][k] = sums[t].get(k, 0) + v.detach().double().cpu()
    finally:
        model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        keys = [(t, k) for t in tasks for k in sorted(sums[t])]
        flat = torch.stack([torch.as_tensor(sums[t][k], dtype=torch.float64) for t, k in keys]) if keys else None
        if flat is not None:
            dist.all_reduce(flat)
            for (t, k), v in zip(keys, flat, strict=True):
                sums[t][k] = v
    return {t: specs[t].metrics(sums[t]) if sums[t] else {} for t in tasks}


def primary(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each task's primary metric (the one Δt uses)."""
    return {t: m[get_task(t).primary_metric] for t, m in results.items() if m}
