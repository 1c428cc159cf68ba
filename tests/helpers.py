"""Shared test helpers: tiny model configs (every paper config shrunk to test widths)."""

from __future__ import annotations

from pathlib import Path

import squad
from squad.config.model import SquadConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = sorted(p for p in (ROOT / "configs" / "model").glob("*.yaml") if not p.name.startswith("_"))

# Shrinks any paper config to a size that runs in milliseconds on the CPU, keeping its layer plan and kinds.
TINY = [
    "model.img_size=32",
    "model.patch_size=8",
    "model.embed_dim=64",
    "model.num_heads=4",
    "model.depth=4",
    "model.moa.head_dim=16",
    "model.moa.num_experts=6",
    "model.moa.top_k=3",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.mod.capacity=0.5",
]


def tiny_config(path: Path | str, extra: list[str] | None = None) -> SquadConfig:
    """A paper config at test widths (dense attention head width reset to D / heads)."""
    cfg = squad.load_config(path, TINY + ["model.head_dim=null"] + (extra or []))
    return cfg


def tiny_model_cfg(**model) -> squad.ModelConfig:
    """A tiny ModelConfig from keyword fields (two heads by default)."""
    data = {
        "img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4,
        "heads": [{"name": "a", "kind": "dense", "channels": 2}, {"name": "b", "kind": "class", "channels": 5}],
    }
    data.update(model)
    return squad.model_config(data)
