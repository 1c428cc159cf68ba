"""Writes on a full or unwritable disk, in every tool that writes (issue 22, item 3).

Each write is atomic (`squad.io.files`: a temporary file, fsync, rename): on a full disk the tool exits 3 naming the
file and the free space, and leaves no partial file (nor, for a job of many files, a half-done output); a folder it
cannot write is refused with exit 2 before any work. ENOSPC is injected where the bytes reach the disk
(`squad.io.files.write_all`; HDF5's own writes for the shards), and also met for real on a 256 KiB tmpfs and on
``/dev/full``.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image

from squad.io import export_model, files
from squad.io.files import WriteError, atomic_save, atomic_torch_save, atomic_write_text
from tests.helpers import PY, ROOT, run_command, tiny_model, tool_env

HEADS = ["depth_euclidean", "normal"]


def _leftovers(folder: Path) -> list[str]:
    """Temporary or partial files under ``folder``."""
    return sorted(str(p) for p in folder.rglob("*") if ".tmp" in p.name or "partial" in p.name)


def inject_enospc(monkeypatch, match: str = "", after: int = 0) -> dict:
    """Makes writes to files whose name contains ``match`` fail as a full disk does: the first half of the bytes
    land, then ENOSPC (after ``after`` such writes succeeded). Returns the call counter."""
    real = files.write_all
    calls = {"n": 0}

    def write_all(f, data):
        if match in getattr(f, "name", ""):
            calls["n"] += 1
            if calls["n"] > after:
                real(f, bytes(data)[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(f, data)

    monkeypatch.setattr(files, "write_all", write_all)
    return calls


@pytest.fixture
def readonly_dir(tmp_path):
    """A folder nothing can be written into: mode 555, or (for root, whom modes do not stop) a read-only tmpfs."""
    d = tmp_path / "readonly"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot make a read-only folder here (root, and no tmpfs mount)")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB filesystem (tmpfs) that the outputs below do not fit; skipped where none can be mounted."""
    d = tmp_path / "full"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("write_model") / "model.pt"
    export_model(path, tiny_model(HEADS), usage=None)
    return path


def _images(folder: Path, n: int = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
    return folder


# ------------------------------------------------------------------------------------------------ the helpers
def test_atomic_writes_keep_the_old_file_and_leave_no_partial(tmp_path, monkeypatch):
    target = tmp_path / "out" / "a.json"
    atomic_write_text(target, "old")
    inject_enospc(monkeypatch)
    for write in (lambda: atomic_write_text(target, "new" * 1000, "the results"),
                  lambda: atomic_torch_save({"w": torch.ones(1000)}, target, "the results"),
                  lambda: atomic_save(target, lambda f: np.save(f, np.ones(1000)), "the results")):
        with pytest.raises(WriteError) as caught:
            write()
        e = caught.value
        assert e.errno == errno.ENOSPC and isinstance(e, OSError)
        assert str(e).startswith(f"could not write the results to {target}: No space left on device; ")
        assert "MiB free on that filesystem" in str(e) and "the disk is full" in str(e)
        assert target.read_text() == "old" and _leftovers(tmp_path) == []


def test_write_error_crosses_processes():
    """Raised in a render worker, re-raised in the tool's process (ProcessPoolExecutor pickles it)."""
    import pickle

    e = pickle.loads(pickle.dumps(WriteError("could not write x", "/a/b", errno.ENOSPC)))
    assert isinstance(e, WriteError) and str(e) == "could not write x" and e.path == Path("/a/b")
    assert e.errno == errno.ENOSPC


# ----------------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("fmt", [pytest.param("pt2", marks=pytest.mark.slow), "model.pt"])
def test_export_on_a_full_disk_exits_3_and_leaves_nothing(fmt, model_file, tmp_path, monkeypatch, load_tool,
                                                          capsys):
    inject_enospc(monkeypatch)
    out = tmp_path / "exports" / ("m.pt2" if fmt == "pt2" else "m.pt")
    code = load_tool("tools/export.py").main(["--checkpoint", str(model_file), "--format", fmt, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 3, err
    assert f"to {out}: No space left on device" in err and "MiB free on that filesystem" in err
    assert "Traceback" not in err and not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_export_to_dev_full_exits_3(model_file, load_tool, capsys):
    """/dev/full is written in place (never renamed over), and fails as a full disk."""
    code = load_tool("tools/export.py").main(["--checkpoint", str(model_file), "--out", "/dev/full"])
    out = capsys.readouterr()
    assert code == 3, out.err
    assert "could not write the exported program to /dev/full: No space left on device" in out.err
    assert "check" not in out.out  # nothing was checked: nothing was written
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_export_into_an_unwritable_folder_is_refused_first(model_file, readonly_dir, load_tool, capsys, monkeypatch):
    import squad

    monkeypatch.setattr(squad, "load", lambda *a, **k: pytest.fail("the model was loaded before --out was checked"))
    out = readonly_dir / "sub" / "m.pt2"
    assert load_tool("tools/export.py").main(["--checkpoint", str(model_file), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out}: cannot write into" in err


# ---------------------------------------------------------------------------------------------------- predict
def test_predict_on_a_full_disk_exits_3_with_whole_files_only(model_file, tmp_path, monkeypatch, load_tool, capsys):
    images = _images(tmp_path / "images")
    out = tmp_path / "pred"
    inject_enospc(monkeypatch, after=7)  # a few files land, then the disk is full
    code = load_tool("tools/predict.py").main(["--checkpoint", str(model_file), "--images", str(images),
                                               "--out", str(out), "--batch-size", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "could not write" in err and f"{out}/" in err and "No space left on device" in err
    assert "MiB free" in err and "Traceback" not in err
    assert not (out / "predictions.json").exists() and _leftovers(tmp_path) == []
    written = [p for p in out.rglob("*") if p.is_file()]
    assert len(written) == 7
    for p in written:  # each whole
        np.load(p) if p.suffix == ".npy" else Image.open(p).load()


def test_predict_into_an_unwritable_folder_is_exit_2(model_file, readonly_dir, tmp_path, load_tool, capsys):
    images = _images(tmp_path / "images", 1)
    out = readonly_dir / "pred"
    code = load_tool("tools/predict.py").main(["--checkpoint", str(model_file), "--images", str(images),
                                               "--out", str(out), "--quiet"])
    assert code == 2
    assert f"error: --out {out}: cannot write into {readonly_dir}" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- make_data
@pytest.mark.parametrize("dataset", ["taskonomy", "nyud"])
def test_synthetic_render_on_a_full_disk_removes_the_partial_render(dataset, tmp_path, monkeypatch):
    from squad.data.synthetic.nyud import render_nyud
    from squad.data.synthetic.taskonomy import render_dataset

    inject_enospc(monkeypatch, after=20)
    out = tmp_path / "data"
    with pytest.raises(WriteError, match="No space left on device") as caught:
        if dataset == "taskonomy":
            render_dataset(out, n=4, image_size=16, seed=0, buildings=3, workers=1)
        else:
            render_nyud(out, n=4, image_size=16, seed=0, workers=1)
    assert f"the render in {out} was incomplete and is removed" in str(caught.value)
    assert [p for p in out.rglob("*")] == []  # nothing half-done keeps the disk full


def test_synthetic_into_an_unwritable_folder_is_exit_2(readonly_dir, load_tool, capsys):
    out = readonly_dir / "syn"
    code = load_tool("tools/make_data.py").main(["synthetic", "--out", str(out), "--n", "3", "--image-size", "16"])
    assert code == 2
    assert str(out) in capsys.readouterr().err


def test_pack_on_a_full_disk_exits_3_and_leaves_no_shard_set(tiny_data, tmp_path, monkeypatch, load_tool, capsys):
    out = tmp_path / "shards"
    calls = {"n": 0}
    real = h5py.Dataset.__setitem__

    def setitem(self, key, value):  # HDF5 reports a full disk at the write that fails
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: errno = 28)")
        return real(self, key, value)

    monkeypatch.setattr(h5py.Dataset, "__setitem__", setitem)
    code = load_tool("tools/make_data.py").main(["pack", "--src", str(tiny_data), "--out", str(out),
                                                 "--image-size", "16", "--shard-size", "4", "--workers", "0"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "could not write shard" in err and "No space left on device" in err and "MiB free" in err
    assert f"the pack into {out} was incomplete and is removed" in err
    assert list(out.iterdir()) == []


def test_pack_into_an_unwritable_folder_is_exit_2(tiny_data, readonly_dir, load_tool, capsys):
    out = readonly_dir / "shards"
    code = load_tool("tools/make_data.py").main(["pack", "--src", str(tiny_data), "--out", str(out),
                                                 "--image-size", "16", "--workers", "0"])
    assert code == 2
    assert f"--out {out}: cannot write into" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ a real full filesystem
@pytest.mark.slow
def test_every_writing_tool_on_a_real_full_disk(full_disk, model_file, tiny_data, tmp_path):
    """The tools as processes on a 256 KiB tmpfs: exit 3 (never a C++ abort or a crash in HDF5's close), the
    file and the free space named, and the filesystem left empty but for empty folders."""
    images = _images(tmp_path / "images", 8)
    runs = {
        "export": ["tools/export.py", "--checkpoint", str(model_file), "--out", str(full_disk / "m.pt2")],
        "predict": ["tools/predict.py", "--checkpoint", str(model_file), "--images", str(images), "--out",
                    str(full_disk / "pred"), "--quiet"],
        "synthetic": ["tools/make_data.py", "synthetic", "--out", str(full_disk / "syn"), "--n", "24",
                      "--image-size", "64", "--buildings", "3"],
        "pack": ["tools/make_data.py", "pack", "--src", str(tiny_data), "--out", str(full_disk / "shards"),
                 "--image-size", "32", "--workers", "0"],
    }
    for name, args in runs.items():
        res = run_command([PY, *args], ROOT, tool_env(), 300)
        assert res.returncode == 3, (name, res.returncode, res.stderr[-2000:])
        assert f"to {full_disk}/" in res.stderr and "No space left on device" in res.stderr, (name, res.stderr)
        assert "MiB free on that filesystem" in res.stderr and "Traceback" not in res.stderr, (name, res.stderr)
        assert _leftovers(full_disk) == [], name
        if name == "predict":  # it keeps the images it finished, each whole (as documented), but no summary
            assert not (full_disk / "pred" / "predictions.json").exists()
            shutil.rmtree(full_disk / "pred")
        assert [p for p in full_disk.rglob("*") if p.is_file()] == [], name


# ------------------------------------------------------------------------- a read-only output (issue 37, item 13)
def test_evaluate_onto_a_read_only_filesystem_is_refused_before_the_work(model_file, tiny_data, readonly_dir,
                                                                          load_tool, capsys, monkeypatch):
    """``--out`` on a read-only filesystem: refused before any model runs, saying what is true (read-only; not a
    full disk); a failed write's own message never blames the space for a read-only place either."""
    import importlib

    ev = importlib.import_module("squad.eval.evaluate")  # the module (squad.eval.evaluate is also a function's name)
    monkeypatch.setattr(ev, "evaluate_run", lambda *a, **k: pytest.fail("evaluated before --out was checked"))
    out = readonly_dir / "eval.json"
    code = load_tool("tools/evaluate.py").main(["--checkpoint", str(model_file), "--data", str(tiny_data),
                                                "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: --out {out}: cannot write into {readonly_dir}" in err and "Traceback" not in err
    reason = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert reason in err and "full" not in err
    for code_ in (errno.EROFS, errno.EACCES):
        message = files.write_failure("the results", out, OSError(code_, os.strerror(code_)))
        assert message == f"could not write the results to {out}: {os.strerror(code_)}"


@pytest.mark.parametrize("tool, argv", [
    ("extract", ["--task", "depth_euclidean"]),
    ("visualize", []),
    ("finetune_router", ["--task", "normal"]),
])
def test_other_tools_refuse_a_read_only_out_first(tool, argv, model_file, tiny_data, readonly_dir, load_tool,
                                                  capsys, monkeypatch):
    import squad.io

    monkeypatch.setattr(squad.io, "load_model", lambda *a, **k: pytest.fail("the model was loaded before --out"))
    out = readonly_dir / ("figs" if tool == "visualize" else "o.pt")
    code = load_tool(f"tools/{tool}.py").main(["--checkpoint", str(model_file), "--data", str(tiny_data),
                                               "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--out {out}: cannot write into {readonly_dir}" in err and "Traceback" not in err
