"""Helpers for the tests of the post-training tools (extraction, router fine-tuning, evaluation, figures): a tiny
synthetic dataset rendered once per test session, tiny models with non-trivial routing, and the tools' entry points
imported in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import squad
from squad.layers.routing import TaskLinear
from tests.helpers import ROOT

TINY_PLAN = [{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "learned"}]


def tiny_data(tmp_path_factory) -> Path:
    """32 synthetic images at 32 px (24 train, 4 val, 4 test), rendered once per session."""
    from squad.data.synthetic import render_dataset

    root = tmp_path_factory.getbasetemp() / "tools_synth"
    if not (root / "synthetic.json").is_file():
        render_dataset(root, n=32, image_size=32, seed=0, buildings=8, workers=1)
    return root


def tiny_model(heads, plan=None, seed: int = 0, **model) -> squad.SquadViT:
    """A tiny SquadViT whose routers have random (not zero) weights, so tokens spread over the experts."""
    data = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
            "plan": plan or TINY_PLAN,
            "moa": {"num_experts": 6, "top_k": 2, "head_dim": 8, "router": {"noise": False}},
            "moe": {"num_experts": 6, "top_k": 2, "router": {"noise": True}},
            "mod": {"capacity": 0.5}, "heads": list(heads)}
    data.update(model)
    torch.manual_seed(seed)
    m = squad.build_model(squad.model_config(data))
    randomize_routers(m, seed)
    return m.eval()


@torch.no_grad()
def randomize_routers(model: torch.nn.Module, seed: int = 0, std: float = 0.5) -> None:
    """Random gate weights for every per-task bank (noise banks stay at zero)."""
    g = torch.Generator().manual_seed(seed)
    for name, m in model.named_modules():
        if isinstance(m, TaskLinear) and not name.endswith(".noise"):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)


def load_tool(name: str):
    """tools/<name>.py as a module (its ``main(argv)`` runs the tool in this process)."""
    spec = importlib.util.spec_from_file_location(f"squad_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
