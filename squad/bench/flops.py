"""FLOP counts of attention kernels from their operands' shapes: the one piece the recorder (`squad.bench.traffic`)
and its CUDA-path kernels (`squad.bench.cuda_path`) share, kept below both so neither imports the other for it."""

from __future__ import annotations

import torch


def attention_flops(q: torch.Tensor, k: torch.Tensor, per_pair: float) -> float:
    """``per_pair``·B·Hq·Nq·Nk·d from q [B, Hq, Nq, d] and k [B, Hkv, Nk, d]: 4 for a forward (QKᵀ and PV), 10 for a
    flash backward (the scores recomputed, dV, dP, dQ, dK)."""
    if q.dim() < 4 or k.dim() < 4:
        return 0.0
    b, h, nq, d = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    return per_pair * b * h * nq * k.shape[-2] * d
