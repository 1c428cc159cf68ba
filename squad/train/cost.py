"""The bare cost of a training step: seconds (wall and CPU) per forward, backward and AdamW step of a run's model on
one batch of its data, and its peak training memory — what a step costs without the training engine around it
(data loading, DeepSpeed, logging, validation). tools/reproduce.py reports it as the cost side of Mod-Squad's
Table 2; tools/bench.py's ``engine`` case sets the engine's own steps against it.

Peak memory is measured above the memory in use before the model was built: on a GPU from
``torch.cuda.max_memory_allocated``, on Linux from the process's peak resident set, which it resets first through
``/proc/self/clear_refs``.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from pathlib import Path

import torch

from squad.config.run import RunConfig
from squad.data import build_dataset, collate
from squad.models.vit import build_model
from squad.train.objective import MultiTaskObjective
from squad.train.optim import param_groups


def _rss_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Frees what the C allocator holds and resets the peak resident set (Linux ≥ 4.0); False where it cannot."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _rss_kib("VmHWM") is not None


def measure_cost(cfg: RunConfig, steps: int, device: str | torch.device = "cpu") -> dict:
    """Seconds per training step and peak training memory of ``cfg``'s model on one batch of its data.

    Args:
        cfg: a run config (its model, tasks, batch, optimiser and data root are used).
        steps: timed steps (after one untimed warm-up step).
        device: where to run.

    Returns:
        ``{"step_s": seconds per step (the fastest of ``steps``: the least disturbed by other processes), "cpu_s":
        CPU seconds per step of this process (median), "peak_mib": peak memory in MiB or None where it cannot be
        measured, "memory": how it was measured}``.
    """

    device = torch.device(device)
    tasks = cfg.train_tasks()
    ds = build_dataset(cfg.data.root, tasks, cfg.data.split, image_size=cfg.model.img_size, augment=False,
                       split_csv=cfg.data.split_csv)
    batch = collate([ds[i % len(ds)] for i in range(cfg.optim.batch_per_rank)])
    images = batch["rgb"].to(device)
    targets = {t: v.to(device) for t, v in batch["targets"].items()}
    masks = {t: v.to(device) for t, v in batch["masks"].items()}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        how = "torch.cuda.max_memory_allocated above the memory in use before the model was built"
    else:
        rss = _reset_peak_rss()
        before = _rss_kib("VmRSS") if rss else None
        how = ("peak resident set (VmHWM, reset through /proc/self/clear_refs) above the resident set before the "
               "model was built" if rss else "not measurable here (no /proc/self/clear_refs)")
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    objective = MultiTaskObjective(model, tasks, cfg).to(device).train()
    opt = torch.optim.AdamW(param_groups(objective, cfg.optim.weight_decay), lr=cfg.optim.lr)
    times, cpu = [], []
    for i in range(steps + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        total, *_ = objective(images, targets, masks)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if cuda:
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    else:
        hwm = _rss_kib("VmHWM") if before is not None else None
        peak = (hwm - before) / 1024 if hwm is not None else None
    del objective, opt, model
    gc.collect()
    return {"step_s": min(times) if times else float("nan"), "cpu_s": statistics.median(cpu) if cpu else float("nan"),
            "peak_mib": peak, "memory": how}
