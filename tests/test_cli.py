"""The command-line layer: every tool's error policy (`squad.cli.run`), the tools/*.py scripts, the console scripts."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from squad.cli import run
from squad.config.base import ConfigError
from squad.io.files import WriteError
from squad.train.objective import TrainingError
from tests.helpers import ROOT, tool_env

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
SCRIPTS_IN_TOOLS = ["tools/train.py", "tools/extract.py", "tools/finetune_router.py", "tools/evaluate.py",
                    "tools/visualize.py", "tools/adapt_pretrained.py", "tools/make_data.py", "tools/bench.py",
                    "tools/demo.py", "tools/upcycle.py", "tools/predict.py", "tools/export.py",
                    "tools/reproduce.py", "tools/gpu_check.py"]
TOOLS = [Path(p).stem for p in SCRIPTS_IN_TOOLS]


def _bad_input(tool: str, missing: Path, blocker: Path) -> list[str]:
    """Arguments that name a missing file (or a folder inside a plain file) for each tool."""
    return {
        "train": ["--config", str(missing)],
        "extract": ["--checkpoint", str(missing), "--task", "depth"],
        "finetune_router": ["--checkpoint", str(missing), "--task", "depth", "--data", str(missing)],
        "evaluate": ["--checkpoint", str(missing), "--data", str(missing)],
        "visualize": ["--checkpoint", str(missing)],
        "adapt_pretrained": ["--checkpoint", str(missing), "--out", str(blocker.parent / "out.pt")],
        "make_data": ["pack", "--src", str(missing), "--out", str(blocker.parent / "shards")],
        "bench": ["--profile", "--json", str(blocker / "bench.json")],
        "demo": ["--data", str(blocker), "--out", str(blocker.parent / "demo")],
        "upcycle": ["--from", str(missing), "--config", "modsquad_vit_s", "--out", str(blocker.parent / "init.pt")],
        "predict": ["--checkpoint", str(missing), "--images", str(missing), "--out", str(blocker.parent / "pred")],
        "export": ["--checkpoint", str(missing), "--out", str(blocker.parent / "x.pt2")],
        "reproduce": ["pruning", "--scale", "tiny", "--data", str(missing), "--out", str(blocker / "repro")],
        "gpu_check": ["--out", str(blocker / "check")],
    }[tool]


@pytest.mark.parametrize("script", SCRIPTS_IN_TOOLS)
def test_every_tool_reports_bad_input_with_exit_2(script, tmp_path, load_tool, monkeypatch, capsys):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(k, v)  # what train's prepare_environment would set, restored after the test
    missing, blocker = tmp_path / "missing", tmp_path / "file"
    blocker.write_text("a file, not a folder")
    assert load_tool(script).main(_bad_input(Path(script).stem, missing, blocker)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and str(tmp_path) in err[-1], err  # names the bad path


def test_run_maps_errors_to_exit_codes(capsys):
    def raises(e: BaseException):
        def body(argv):
            raise e
        return body

    assert run(lambda argv: 0) == 0 and run(lambda argv: 1) == 1
    assert run(raises(ConfigError("optim.lr: expected a number"))) == 2
    assert run(raises(FileNotFoundError("data/x not found"))) == 2
    assert run(raises(PermissionError("runs/x is not writable"))) == 2
    assert run(raises(TrainingError("3 non-finite losses in a row"))) == 3
    assert run(raises(WriteError("could not write x to y: No space left on device", "y", 28))) == 3
    assert run(raises(KeyboardInterrupt())) == 130
    assert run(raises(KeyError("no baseline for depth")), bad_input=(KeyError,)) == 2
    err = capsys.readouterr().err
    assert "error: optim.lr: expected a number" in err and "error: 3 non-finite losses" in err
    assert "error: no baseline for depth\n" in err and "interrupted" in err  # a KeyError's text, unquoted
    with pytest.raises(KeyError):  # not bad input unless the tool says so
        run(raises(KeyError("x")))
    with pytest.raises(RuntimeError):  # a bug keeps its traceback
        run(raises(RuntimeError("shape mismatch")))


def test_console_scripts_point_at_the_tools():
    assert sorted(SCRIPTS) == sorted(f"squad-{t.replace('_', '-')}" for t in TOOLS)
    for name, target in SCRIPTS.items():
        module, func = target.split(":")
        assert module == f"squad.cli.{name.removeprefix('squad-').replace('-', '_')}", name
        assert callable(getattr(importlib.import_module(module), func)), target


@pytest.mark.slow
def test_console_script_exit_codes(tmp_path):
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "squad-extract").is_file(), "console scripts missing: run `pip install -e .` (or `make test`)"
    ok = subprocess.run([bin_dir / "squad-extract", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("usage: squad-extract"), ok.stderr
    bad = subprocess.run([bin_dir / "squad-make-data", "pack", "--src", str(tmp_path / "nowhere"), "--out",
                          str(tmp_path / "shards")], capture_output=True, text=True, timeout=120, env=tool_env())
    assert bad.returncode == 2 and "error: " in bad.stderr and str(tmp_path / "nowhere") in bad.stderr, bad.stderr
    # squad-train runs itself again with OMP_WAIT_POLICY=PASSIVE in effect, then parses its arguments
    usage = subprocess.run([bin_dir / "squad-train"], capture_output=True, text=True, timeout=120, env=tool_env())
    assert usage.returncode == 2 and "--config" in usage.stderr, usage.stderr


@pytest.mark.parametrize("script", SCRIPTS_IN_TOOLS)
def test_scripts_are_thin_and_point_at_their_module(script):
    tree = ast.parse((ROOT / script).read_text())
    module = importlib.import_module(f"squad.cli.{Path(script).stem}")
    doc = ast.get_docstring(tree)
    assert doc.splitlines()[0].rstrip(".") == module.__doc__.splitlines()[0].rstrip(".")  # the same one-line summary
    assert f"squad.cli.{Path(script).stem}" in doc
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]  # the work is in squad.cli


def test_script_without_squad_says_how_to_install(tmp_path):
    env = tool_env()
    env.pop("PYTHONPATH", None)
    # -S: no site-packages, so neither squad nor torch can be imported
    res = subprocess.run([sys.executable, "-S", str(ROOT / "tools/extract.py"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error: cannot import squad") and "pip install -e ." in res.stderr


def test_a_second_run_in_one_process_gets_fresh_deepspeed_groups(monkeypatch):
    """A tool ends with `squad.distributed.shutdown`; a later run in the same process (a tool called twice, the
    tests) must not meet DeepSpeed's cached clone of the destroyed group ("Group ... is not registered")."""
    from deepspeed.utils import groups

    from squad.distributed import free_port, init_distributed, shutdown

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    for _ in range(2):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        init_distributed()
        assert groups._get_broadcast_src_rank() == 0  # builds (or reuses) DeepSpeed's clone of the world group
        shutdown()
