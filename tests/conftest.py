"""Shared fixtures: the tiny synthetic dataset (rendered once per test session) and the tools loaded in-process; and
which tests are `slow` (left out by ``make test-fast``).

A test is slow when it is marked ``@pytest.mark.slow`` (an end-to-end run: a training subprocess, a launcher, a
whole README walkthrough), or when it uses one of `SLOW_FIXTURES`, the module fixtures that train runs or export
programs for the tests that read them.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import ROOT

# module fixtures that train or export (each test using one is slow: it needs the run, even when it reads it quickly)
SLOW_FIXTURES = frozenset({
    "trained",  # test_every_config: every shipped config trained and resumed (2 ranks per family)
    "two_rank_run", "one_rank_run",  # test_resume, test_train: DeepSpeed runs
    "stopped_run",  # test_run_folder: a run stopped at train.stop_at
    "run",  # test_pascal_nyud_training, test_io: a trained run
    "tiny_report",  # test_reproduce: every claim at --scale tiny
    "exported",  # test_export: torch.export programs of every layer kind
    "zero_runs",  # test_export: ZeRO runs converted with zero_to_fp32.py
    "walkthrough",  # test_readme: every README command at tiny sizes
})


# The files that take longest (minutes each on 2 cores), longest first. They are collected first, so that `make test`'s
# workers (pytest-xdist, ``--dist loadfile``: a file's tests run in one worker, its module fixtures once) start them
# early and the suite does not end on one of them running alone.
LONGEST_FIRST = ("test_readme.py", "test_every_config.py", "test_expert_parallel_training.py", "test_preemption.py",
                 "test_compile.py", "test_resume.py", "test_export.py", "test_reproduce.py", "test_train.py",
                 "test_run_folder.py")


def _file_rank(item) -> int:
    name = Path(str(item.fspath)).name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items) -> None:
    """Marks the tests that use a `SLOW_FIXTURES` fixture as slow, and puts the `LONGEST_FIRST` files first (the
    order within a file is kept)."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_file_rank)


def pytest_configure(config) -> None:
    """One torch thread per pytest-xdist worker: the workers share the machine's cores already."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


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
