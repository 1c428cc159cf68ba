"""How squad is installed (issue 22, item 8): pyproject.toml declares the torch range squad supports, so that
``pip install`` on a machine with its own torch build keeps it; ``make`` and CI install the exact versions of
constraints.txt.

The lowest torch this machine can install, 2.13.0 (its CPU wheel), was run outside the suite, in a second venv:

    python3 -m venv /tmp/venv213 && /tmp/venv213/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl
    /tmp/venv213/bin/pip install -e '.[test]' 'torch==2.13.0+cpu' && /tmp/venv213/bin/python tools/prepare_deepspeed.py
    /tmp/venv213/bin/python -m pytest -m "not slow" tests/test_install.py tests/test_layers.py tests/test_losses.py \
        tests/test_export.py tests/test_io.py tests/test_write_failures.py tests/test_run_folder.py   # 105 passed

(files that import timm cannot run there: PyPI's torchvision 0.28 fails to import beside the CPU wheel).
"""

from __future__ import annotations

import re
import tomllib

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.helpers import ROOT


def _requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {Requirement(d).name: Requirement(d) for d in deps}


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, op, version = re.match(r"^([A-Za-z0-9_.-]+)\s*(==)\s*(\S+)$", line).groups()
            pins[name.lower()] = version
    return pins


def test_pyproject_declares_a_torch_range_not_a_pin():
    reqs = _requirements()
    torch_req = reqs["torch"]
    assert torch_req.specifier and all(s.operator not in ("==", "===") for s in torch_req.specifier), torch_req
    assert torch_req.specifier.contains("2.11.0") and torch_req.specifier.contains("2.14.1")
    assert "torchvision" not in reqs  # squad never imports it; timm requires it and pip matches it to the torch there
    assert not any(p.suffix == ".py" and "import torchvision" in p.read_text()
                   for d in ("squad", "tasks", "kernels", "tools") for p in (ROOT / d).rglob("*.py"))


def test_make_and_ci_install_the_exact_versions_of_constraints_txt():
    pins = _constraints()
    assert set(pins) >= {"torch", "torchvision"}
    assert _requirements()["torch"].specifier.contains(pins["torch"])  # the pinned torch is in the declared range
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -qq -e '.[test]' -c constraints.txt" in makefile
    assert re.search(r"^\$\(STAMP\): pyproject\.toml constraints\.txt$", makefile, re.M)  # a new pin reinstalls
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_running_torch_is_in_the_supported_range():
    running = Version(torch.__version__).base_version  # "2.14.1+cu130" → "2.14.1"
    assert _requirements()["torch"].specifier.contains(running), (running, _requirements()["torch"])


def test_every_package_folder_installs():
    """pyproject.toml lists every folder that installs (a package left out is missing from a wheel, as
    squad.layers.parallel was; a config folder left out makes setuptools warn at every install)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name: ROOT / path for name, path in setup["package-dir"].items()}
    found = set()
    for name, folder in roots.items():
        for d in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
            if d.name == "__pycache__" or not any(f.suffix in (".py", ".yaml") for f in d.iterdir()):
                continue
            found.add(".".join((name, *d.relative_to(folder).parts)))
    assert found == set(setup["packages"]), (sorted(found - set(setup["packages"])),
                                             sorted(set(setup["packages"]) - found))
    assert all(f"squad.configs{sub}" in setup["package-data"] for sub in ("", ".model", ".taskonomy"))
