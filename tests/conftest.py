"""Shared fixtures: the tiny synthetic dataset (rendered once per test session) and the tools loaded in-process."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """32 synthetic images at 32 px (24 train, 4 val, 4 test), rendered once per session."""
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.getbasetemp() / "tools_synth"
    if not (root / "synthetic.json").is_file():
        render_dataset(root, n=32, image_size=32, seed=0, buildings=8, workers=1)
    return root


def _load_tool(path: str) -> ModuleType:
    file = ROOT / path
    assert file.parent.name == "tools" and file.is_file(), f"{path}: not a script in tools/"
    spec = importlib.util.spec_from_file_location(f"squad_tool_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_tool() -> Callable[[str], ModuleType]:
    """``load_tool("tools/extract.py")``: the script as a module; its ``main(argv)`` runs the tool in this process."""
    return _load_tool
