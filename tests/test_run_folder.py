"""The run folder (`squad.train.run_folder`): its lock, config changes on resume, the world size, fresh starts over
an existing run, and DeepSpeed's /dev/shm segments — unit tests, then real `tools/train.py` runs on tiny data."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from squad.distributed import free_port
from squad.io.checkpoints import complete_tags, find_resume_tag
from squad.train import checkpointer as ckpt
from squad.train import run_folder as rf
from squad.train import shm as sh
from squad.train import tags as ckpt_tags
from squad.train.objective import nonfinite_stop
from tests.helpers import DEEPSPEED, PY, RANK_LAUNCHER, ROOT, run_command, tool_env

HOLD = ("import sys, time; from squad.train.run_folder import RunLock; RunLock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(600)")



def _dead_pid() -> int:
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    return p.pid


def _shm_files(port: int) -> list[str]:
    return sorted(p.name for p in sh.SHM_DIR.glob(f"{sh.SHM_PREFIX}_*_{port}_*"))


@pytest.fixture
def holder(tmp_path):
    """A live process holding the lock of ``tmp_path / "run"``."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([PY, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    yield run, proc
    proc.kill()
    proc.wait()


# ---------------------------------------------------------------------------------------------------- lock
def test_lock_names_its_live_holder_and_a_dead_ones_lock_is_taken_over(holder):
    run, proc = holder
    with pytest.raises(rf.RunFolderLocked, match=f"pid {proc.pid} on host {socket.gethostname()}"):
        rf.RunLock.acquire(run)
    proc.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the lock, the record stays
    proc.wait()
    lock = rf.RunLock.acquire(run)
    try:
        assert lock.previous["pid"] == proc.pid
        with pytest.raises(rf.RunFolderLocked, match="this process"):
            rf.RunLock.acquire(run)  # POSIX locks are per process: refused by the registry
    finally:
        lock.release()
    assert (run / rf.LOCK_FILE).read_text() == ""
    rf.RunLock.acquire(run).release()


def test_lock_without_fcntl_decides_by_the_holder_record(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rf.fcntl, "lockf", no_locks)
    here = socket.gethostname()
    (tmp_path / rf.LOCK_FILE).write_text(json.dumps({"host": here, "pid": os.getppid(), "started": 0}))
    with pytest.raises(rf.RunFolderLocked, match=f"pid {os.getppid()}"):
        rf.RunLock.acquire(tmp_path)
    (tmp_path / rf.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(rf.RunFolderLocked, match="host elsewhere"):
        rf.RunLock.acquire(tmp_path)
    dead = _dead_pid()
    (tmp_path / rf.LOCK_FILE).write_text(json.dumps({"host": here, "pid": dead}))
    lock = rf.RunLock.acquire(tmp_path)
    assert lock.previous["pid"] == dead
    lock.release()


# ------------------------------------------------------------------------------------------ config, messages
def test_config_changes_split_resumable_keys_from_the_rest():
    old = {"model": {"depth": 2, "moe": {"num_experts": 4}, "heads": ["normal"]},
           "optim": {"lr": 1e-3, "steps": 10, "batch_per_rank": 4, "betas": [0.9, 0.999]},
           "data": {"tasks": "all", "workers": 2}, "train": {"seed": 0, "eval_every": 0}}
    new = {"model": {"depth": 2, "moe": {"num_experts": 8}, "heads": ["normal", "depth_euclidean"]},
           "optim": {"lr": 5e-4, "steps": 20, "batch_per_rank": 8, "betas": [0.9, 0.95]},
           "data": {"tasks": ["normal"], "workers": 0}, "train": {"seed": 1, "eval_every": 5}}
    refused, allowed = rf.config_changes(old, new)
    assert set(refused) == {"model.moe.num_experts", "model.heads", "optim.lr", "optim.batch_per_rank",
                            "optim.betas", "data.tasks", "train.seed"}
    assert allowed == {"optim.steps": (10, 20), "data.workers": (2, 0), "train.eval_every": (0, 5)}


def test_train_help_documents_the_flags_and_the_resumable_keys():
    from squad.cli.train import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--overwrite" in text and "--allow-world-size-change" in text
    for key in rf.RESUMABLE_KEYS:
        section, name = key.split(".", 1)  # model.moe.expert_parallel: section model, name moe.expert_parallel
        assert f"{section}." in text and name in text, key


def test_nonfinite_stop_says_what_works(tmp_path):
    msg = str(nonfinite_stop(3, 7, tmp_path))
    assert "3 non-finite losses in a row at step 7" in msg
    assert "new run with a lower optim.lr" in msg and "cannot change on resume" in msg and "no checkpoint" in msg
    (tmp_path / "checkpoints" / ckpt.SAVING / "step00000005").mkdir(parents=True)
    ckpt_tags.commit_tag(tmp_path / "checkpoints", "step00000005", {"step": 5}, keep=2)
    assert "resume this run from its last checkpoint (step00000005" in str(nonfinite_stop(3, 7, tmp_path))


# ---------------------------------------------------------------------------------------------- /dev/shm
def test_stale_shm_segments_of_a_crashed_run_are_removed(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    shm = sh.ShmSegments.from_env()
    assert shm.names == [sh.shm_name("127.0.0.1", port, r) for r in (0, 1)]
    shm.record(tmp_path)  # the crashed run's record ...
    record = next(tmp_path.glob(".shm-*.json"))
    data = json.loads(record.read_text())
    data["pid"] = _dead_pid()  # ... whose process is gone
    record.write_text(json.dumps(data))
    live = tmp_path / f".shm-{socket.gethostname()}-{os.getppid()}.json"  # a live run's record stays
    live.write_text(json.dumps({**data, "pid": os.getppid(), "names": [sh.shm_name("127.0.0.1", port, 7)]}))
    try:
        for name in [*shm.names, sh.shm_name("127.0.0.1", port, 7)]:
            (sh.SHM_DIR / name).write_bytes(b"x" * 100)
        notes = sh.remove_stale_shm(tmp_path)
        assert _shm_files(port) == [sh.shm_name("127.0.0.1", port, 7)]
        assert not record.exists() and live.exists()
        assert len(notes) == 1 and "removed 2 shared-memory files" in notes[0]
    finally:
        for name in _shm_files(port):
            (sh.SHM_DIR / name).unlink()


# ---------------------------------------------------------------------------------------- real training runs
@pytest.fixture(scope="module")
def run_config(tmp_path_factory, tiny_data):
    cfg = {
        "model": {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
                  "plan": [{"attn": "dense", "mlp": "moe"}], "moe": {"num_experts": 4, "top_k": 2},
                  "heads": ["depth_euclidean", "class_scene"]},
        "data": {"root": str(tiny_data), "workers": 0, "augment": False, "val_batches": 1},
        "optim": {"lr": 5e-3, "steps": 4, "batch_per_rank": 4},
        "train": {"seed": 0, "log_every": 5, "progress": False},
    }
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, out: Path, *args: str, ranks: int = 0, port: int | None = None, env: dict | None = None,
           timeout: int = 600, deepspeed: bool = False):
    """tools/train.py on one process, or on ``ranks`` (`tests.rank_launcher`; the real launcher with ``deepspeed``)."""
    program = [DEEPSPEED] if deepspeed else [PY, RANK_LAUNCHER]
    launch = [*program, "--num_gpus", str(ranks), "--master_port", str(port or free_port())] if ranks else [PY]
    cmd = [*launch, "tools/train.py", "--config", str(config), "--out", str(out), *args]
    return run_command(cmd, ROOT, tool_env(**(env or {})), timeout)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, run_config):
    """One rank, checkpointed at step 2 of 4 (train.stop_at)."""
    out = tmp_path_factory.mktemp("runs") / "stopped"
    res = _train(run_config, out, "--set", "train.stop_at=2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert find_resume_tag(out / "checkpoints") == "step00000002"
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.slow
def test_second_run_into_a_locked_folder_exits_2_naming_the_holder(holder, run_config):
    run, proc = holder
    res = _train(run_config, run)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"in use by another training run: pid {proc.pid} on host {socket.gethostname()}" in res.stderr
    assert not (run / "config.yaml").exists() and not (run / "train.log").exists()


@pytest.mark.parametrize("ranks", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_locked_folder_is_refused_before_the_heavy_start_up(holder, run_config, tmp_path, ranks):
    """Rank 0 takes the lock before the process group and DeepSpeed start (issue 22, item 7): with an empty extension
    folder, a refused one-process run never loads (or builds) DeepSpeed's communication op; a 2-rank launch ends with
    rank 0's refusal."""
    run, proc = holder
    env = {}
    if not ranks:
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
        (tmp_path / "ext").mkdir()
    res = _train(run_config, run, ranks=ranks, env=env, timeout=120, deepspeed=True)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"in use by another training run: pid {proc.pid}" in res.stdout + res.stderr
    if not ranks:
        assert list((tmp_path / "ext").iterdir()) == []  # DeepSpeed never started
        assert "built successfully" not in res.stdout + res.stderr
    assert not (run / "config.yaml").exists() and not (run / "train.log").exists()


def test_extension_builds_belong_to_their_installation(monkeypatch, tmp_path):
    """torch keys ~/.cache/torch_extensions by the Python and CUDA versions only, while the op's build command holds
    the installation's include paths: two checkouts sharing it rebuilt each other's op at every start. Each
    installation gets its own folder; a user's TORCH_EXTENSIONS_DIR is kept."""
    from squad.distributed import extensions_dir, prepare_environment

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    own = extensions_dir()  # the tests run in make's .venv: a folder inside it, named by its paths
    assert own.parent == Path(sys.prefix) / "torch_extensions" and own.name.startswith("squad-")
    clones = set()  # a venv copied with hard links to another checkout gets a folder of its own inside it
    for prefix in ("/work/a/.venv", "/work/b/.venv"):
        monkeypatch.setattr(sys, "prefix", prefix)
        monkeypatch.setattr(os, "access", lambda path, mode: True)
        clones.add(extensions_dir())
        assert extensions_dir().parent == Path(prefix) / "torch_extensions"
    assert len(clones) == 2
    monkeypatch.undo()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    seen = set()
    for prefix in ("/work/a/.venv", "/work/b/.venv"):
        monkeypatch.setattr(sys, "prefix", prefix)
        monkeypatch.setattr(os, "access", lambda path, mode: False)  # not writable: a folder of the shared cache
        seen.add(extensions_dir())
    assert len(seen) == 2 and all(p.parent.name == "torch_extensions" and p.name.startswith("squad-") for p in seen)
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_dir() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    prepare_environment()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(own)


@pytest.mark.slow
def test_runs_load_the_op_that_set_up_built(run_config, tmp_path):
    """`make` runs tools/prepare_deepspeed.py; a run then loads that build (the ninja log and the library are
    untouched), also when started from another folder."""
    from squad.distributed import extensions_dir

    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    res = subprocess.run([PY, str(ROOT / "tools" / "prepare_deepspeed.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"ready in {extensions_dir()}" in res.stdout
    op = extensions_dir() / "deepspeed_shm_comm"
    log, lib = (op / ".ninja_log").read_text(), (op / "deepspeed_shm_comm.so").stat().st_mtime_ns
    res = subprocess.run([PY, str(ROOT / "tools" / "train.py"), "--config", str(run_config), "--out",
                          str(tmp_path / "run"), "--set", "optim.steps=1"], env=tool_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (op / ".ninja_log").read_text() == log and (op / "deepspeed_shm_comm.so").stat().st_mtime_ns == lib


def test_resume_with_a_changed_config_is_refused_before_anything_is_written(stopped_run, run_config, tmp_path):
    out = _copy(stopped_run, tmp_path)
    before = (out / "config.yaml").read_bytes()
    res = _train(run_config, out, "--set", "optim.lr=1e-2", "--set", "model.moe.num_experts=8")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "optim.lr: 0.005 → 0.01" in res.stderr and "model.moe.num_experts: 4 → 8" in res.stderr
    assert "--out" in res.stderr and "size mismatch" not in res.stderr
    assert (out / "config.yaml").read_bytes() == before
    assert len((out / rf.HISTORY_FILE).read_text().splitlines()) == 1


def test_resume_none_into_a_run_is_refused_unless_overwrite(stopped_run, run_config, tmp_path):
    out = _copy(stopped_run, tmp_path)
    (out / "notes.txt").write_text("mine")
    res = _train(run_config, out, "--resume", "none")
    assert res.returncode == 2 and "--overwrite" in res.stderr and "already holds a run" in res.stderr
    res = _train(run_config, out, "--resume", "none", "--overwrite", "--set", "optim.steps=1",
                 "--set", "optim.lr=1e-3")
    assert res.returncode == 0, res.stderr[-3000:]
    assert complete_tags(out / "checkpoints") == ["step00000001"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert len((out / rf.HISTORY_FILE).read_text().splitlines()) == 1
    assert (out / "notes.txt").read_text() == "mine" and "--overwrite: deleted" in (out / "train.log").read_text()


def test_world_size_change_is_refused_then_allowed_and_shm_is_cleaned(stopped_run, run_config, tmp_path):
    out = _copy(stopped_run, tmp_path)
    port = free_port()
    res = _train(run_config, out, ranks=2, port=port)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "written by 1 ranks, this run has 2" in res.stdout + res.stderr
    assert "--allow-world-size-change" in res.stdout + res.stderr
    assert _shm_files(port) == []  # a refused run frees its segments too
    port = free_port()
    res = _train(run_config, out, "--allow-world-size-change", "--set", "train.log_every=1", ranks=2, port=port)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _shm_files(port) == []  # DeepSpeed's ~66 MB per rank, unlinked
    assert not list(out.glob(".shm-*.json"))
    log = (out / "train.log").read_text()
    assert "train.log_every: 5 → 1" in log and "world size changed on resume" in log
    assert yaml.safe_load((out / "config.prev.yaml").read_text())["train"]["log_every"] == 5
    history = [json.loads(line) for line in (out / rf.HISTORY_FILE).read_text().splitlines()]
    assert [h["world_size"] for h in history] == [1, 2] and history[1]["start_step"] == 2
    assert history[1]["config_changes"] == {"train.log_every": [5, 1], "train.stop_at": [2, 0]}
    assert (out / "model.pt").is_file() and (out / rf.LOCK_FILE).read_text() == ""
