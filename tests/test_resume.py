"""Resuming and saving when things go wrong: a finished run started again (2 DeepSpeed ranks), a planted pickle
payload, a checkpoint damaged after it was marked complete, a disk that fills up during a save.

Each run is a real `tools/train.py` subprocess at the smallest sizes (depth 2, 32 px, 4 steps) with a timeout that
fails fast: a rank left waiting in a collective call would otherwise sit out gloo's 600 s timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from squad.io.checkpoints import (
    COMPLETE,
    MODEL_STATES,
    SAVING,
    DamagedCheckpointError,
    UnsafeCheckpointError,
    complete_tags,
    find_resume_tag,
    resume_candidates,
    tag_for,
)
from squad.train import checkpointer as ckpt
from squad.train import tags as ckpt_tags
from tests.helpers import ROOT, launcher, logged_losses, run_command, tool_env, write_run_config

TIMEOUT = 240  # a 2-rank tiny run takes well under a minute, even on 2 busy cores
STEP2, STEP4 = "step00000002", "step00000004"



@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.mktemp("synth")
    render_dataset(root, n=16, image_size=32, seed=0, buildings=4)  # 8 training images
    return write_run_config(tmp_path_factory.mktemp("cfg") / "tiny.yaml", root, ["depth_euclidean", "class_scene"],
                            optim={"warmup_steps": 1, "steps": 4}, train={"log_every": 1, "ckpt_every": 2})


def _train(config: Path, out: Path, *extra: str, ranks: int = 1, script: str = "tools/train.py",
           env: dict | None = None) -> subprocess.CompletedProcess:
    prefix = launcher(ranks)
    cmd = [*prefix, script, "--config", str(config), "--out", str(out), *extra]
    return run_command(cmd, ROOT, tool_env(**(env or {})), TIMEOUT)


def _ok(res: subprocess.CompletedProcess) -> None:
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return list(logged_losses(run_dir).items())


def _model(run_dir: Path) -> dict:
    return torch.load(run_dir / "model.pt", weights_only=True)


def _same_model(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert a["extra"]["metrics"] == b["extra"]["metrics"] and a["extra"]["step"] == b["extra"]["step"]
    for table in ("counts", "tokens"):
        assert all(torch.equal(a["usage"][table][k], b["usage"][table][k]) for k in a["usage"][table]), table


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, config) -> Path:
    out = tmp_path_factory.mktemp("runs") / "two_rank"
    _ok(_train(config, out, ranks=2))
    return out


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, config) -> Path:
    out = tmp_path_factory.mktemp("runs") / "one_rank"
    _ok(_train(config, out))
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("*.lock", ".shm-*"))
    return dest


# ------------------------------------------------------------------------------ item 1: a finished run, again
@pytest.mark.slow
def test_finished_two_rank_run_started_again(config, two_rank_run, tmp_path):
    """Killed after the final checkpoint but before model.pt (or simply run again): every rank takes the same path,
    model.pt is written once more, bit for bit, with the statistics of both ranks, and nothing is logged twice."""
    run = _copy(two_rank_run, tmp_path / "run")
    original = _model(run)
    rows = (run / "metrics.jsonl").read_text()
    losses = _losses(run)
    assert [s for s, _ in losses] == [1, 2, 3, 4]
    (run / "model.pt").unlink()
    _ok(_train(config, run, ranks=2))
    _same_model(original, _model(run))
    tokens = next(iter(original["usage"]["tokens"].values())).sum()
    assert tokens == 4 * 2 * 4 * 2 * 17  # steps × ranks × images × tasks × tokens: both ranks' statistics, once
    assert "has no model.pt: writing it" in (run / "train.log").read_text()
    res = _train(config, run, ranks=2)  # finished, model.pt there: nothing to do
    _ok(res)
    assert "nothing to do" in (run / "train.log").read_text()
    _same_model(original, _model(run))
    assert (run / "metrics.jsonl").read_text() == rows
    assert _losses(run) == losses


# ------------------------------------------------------------------- item 4: a planted pickle payload is refused
class _WritesAFile:
    """Unpickling this calls ``open(target, "w")``: a stand-in for any code a pickle can run."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return open, (self.target, "w")


def _plant(tag: Path, target: Path) -> Path:
    file = tag / MODEL_STATES
    states = torch.load(file, weights_only=True)
    states["client"] = _WritesAFile(target)
    torch.save(states, file)
    return file


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_resume_refuses_a_planted_payload_without_running_it(config, one_rank_run, two_rank_run, tmp_path, ranks):
    run = _copy(one_rank_run if ranks == 1 else two_rank_run, tmp_path / "run")
    (run / "model.pt").unlink()
    target = tmp_path / "pwned"
    bad = _plant(run / "checkpoints" / STEP4, target)
    res = _train(config, run, ranks=ranks)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert not target.exists()
    output = res.stdout + res.stderr  # the launcher passes the ranks' stderr on through its stdout
    assert "refusing to resume" in output and str(bad) in output
    assert "open, which weights_only loading does not allow" in output
    assert not (run / "model.pt").exists()


@pytest.mark.slow
def test_deepspeed_reads_checkpoints_weights_only(one_rank_run, tmp_path):
    """The guard also covers DeepSpeed's own reads, should a file change after it was verified."""
    class Engine:
        class checkpoint_engine:  # noqa: N801 - DeepSpeed's attribute name
            @staticmethod
            def save(state_dict, path):
                torch.save(state_dict, path)

            @staticmethod
            def load(path, map_location=None):
                return torch.load(path, map_location=map_location, weights_only=False)

    engine = Engine()
    ckpt.EngineGuard(engine)
    target = tmp_path / "pwned"
    bad = _plant(_copy(one_rank_run, tmp_path / "run") / "checkpoints" / STEP4, target)
    with pytest.raises(UnsafeCheckpointError, match="open, which weights_only loading does not allow"):
        engine.checkpoint_engine.load(str(bad), map_location="cpu")
    assert not target.exists()


# ------------------------------------------------------------ item 7: damaged after it was marked complete
@pytest.mark.slow
def test_damaged_checkpoint_falls_back_to_the_previous_one(config, one_rank_run, tmp_path):
    run = _copy(one_rank_run, tmp_path / "run")
    original = _model(run)
    rows = (run / "metrics.jsonl").read_text()
    bad = run / "checkpoints" / STEP4 / MODEL_STATES
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated: "failed finding central directory"
    res = _train(config, run)
    _ok(res)
    log = (run / "train.log").read_text()
    assert f"checkpoint {run / 'checkpoints' / STEP4} is damaged" in log and str(bad) in log
    assert f"falling back to {run / 'checkpoints' / STEP2}" in log and str(bad) in res.stderr
    assert f"resumed from {run / 'checkpoints' / STEP2} at step 2" in log
    start = json.loads((run / "run_history.jsonl").read_text().splitlines()[-1])  # what was loaded (issue 22, item 5)
    assert start["resumed_from"] == str(run / "checkpoints" / STEP2) and start["start_step"] == 2
    assert start["skipped_damaged"] == [str(run / "checkpoints" / STEP4)]
    _same_model(original, _model(run))  # steps 3 and 4 again, exactly
    assert ckpt_tags.verify_tag(run / "checkpoints" / STEP4) is None  # saved again, whole
    assert (run / "metrics.jsonl").read_text() == rows  # the final validation once, not twice
    assert [s for s, _ in _losses(run)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_every_checkpoint_damaged_names_each_file(config, one_rank_run, tmp_path):
    run = _copy(one_rank_run, tmp_path / "run")
    (run / "model.pt").unlink()
    files = [run / "checkpoints" / tag / MODEL_STATES for tag in (STEP2, STEP4)]
    for f in files:
        f.write_bytes(f.read_bytes()[:1000])
    res = _train(config, run)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "no loadable checkpoint" in res.stderr and all(str(f) in res.stderr for f in files)


def test_unit_verify_tag_and_markers(tmp_path):
    d = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (d / SAVING / tag_for(step)).mkdir(parents=True)
        torch.save({"module": {"w": torch.ones(2)}, "ds_config": {}}, d / SAVING / tag_for(step) / MODEL_STATES)
        ckpt_tags.commit_tag(d, tag_for(step), {"step": step}, keep=5)
    (d / tag_for(6) / COMPLETE).write_text("")  # a marker cut short: the tag is not complete
    assert complete_tags(d) == [tag_for(2), tag_for(4)]
    assert resume_candidates(d) == [tag_for(4), tag_for(2)]
    assert ckpt_tags.verify_tag(d / tag_for(4)) is None
    (d / tag_for(4) / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"PK\x03\x04 cut")
    problem = ckpt_tags.verify_tag(d / tag_for(4))
    assert isinstance(problem, DamagedCheckpointError) and problem.file.endswith("optim_states.pt")
    warnings = []
    assert ckpt_tags.select_tag(d, resume_candidates(d), warn=warnings.append) == tag_for(2)
    assert len(warnings) == 1 and "optim_states.pt" in warnings[0]


def test_pruning_keeps_the_tag_just_written_and_the_line_it_is_on(tmp_path):
    """After a resume fell back from a damaged step-6 tag to step 4 and wrote step 5, keeping 1 (or 2) tags removes
    the older tags of that line only: never the tag just written, and the tag ahead (damaged) is neither counted nor
    the one kept (it was: `complete_tags(...)[:-keep]` kept the damaged step 6 and removed steps 4 and 5)."""
    d = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (d / SAVING / tag_for(step)).mkdir(parents=True)
        torch.save({"module": {"w": torch.ones(2)}, "ds_config": {}}, d / SAVING / tag_for(step) / MODEL_STATES)
        ckpt_tags.commit_tag(d, tag_for(step), {"step": step}, keep=5)
    (d / tag_for(6) / MODEL_STATES).unlink()  # damaged: a resume falls back to step 4
    (d / SAVING / tag_for(5)).mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "ds_config": {}}, d / SAVING / tag_for(5) / MODEL_STATES)
    ckpt_tags.commit_tag(d, tag_for(5), {"step": 5}, keep=2)
    assert complete_tags(d) == [tag_for(4), tag_for(5), tag_for(6)] and find_resume_tag(d) == tag_for(5)
    (d / SAVING / tag_for(5)).mkdir(parents=True)  # the same step written again, keeping one
    torch.save({"module": {"w": torch.ones(2)}, "ds_config": {}}, d / SAVING / tag_for(5) / MODEL_STATES)
    ckpt_tags.commit_tag(d, tag_for(5), {"step": 5}, keep=1)
    assert complete_tags(d) == [tag_for(5), tag_for(6)] and find_resume_tag(d) == tag_for(5)
    assert ckpt_tags.select_tag(d, resume_candidates(d)) == tag_for(5)
    assert ckpt_tags.prune_tags(d, tag_for(5), 5, keep=0) == []  # 0: keep every tag


# --------------------------------------------------------------------------- item 8: the disk fills up mid-save
INJECT = '''
import errno, os, sys, torch
where, rank, kind = os.environ["SQUAD_TEST_FAIL"].split(":")
real = torch.save
def save(obj, f, *args, **kwargs):
    if where in str(f) and os.environ.get("RANK", "0") == rank:
        if kind == "torch":  # what torch's zip writer raises on a full disk
            raise RuntimeError("basic_ios::clear: iostream error")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return real(obj, f, *args, **kwargs)
torch.save = save
import squad.io.files as files  # squad's own files: serialised in memory, their bytes written here
real_write = files.write_all
def write_all(f, data):
    if where in str(getattr(f, "name", "")) and os.environ.get("RANK", "0") == rank:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f.name))
    return real_write(f, data)
files.write_all = write_all
from squad.cli.train import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.slow
def test_disk_full_during_a_two_rank_save_keeps_the_previous_checkpoint(config, tmp_path):
    """Rank 1 cannot write its ZeRO shard of the step-4 checkpoint: both ranks stop at once with the same message, in
    train.log and on stderr; step 2 stays the latest checkpoint, and the run resumes from it."""
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    run = tmp_path / "run"
    res = _train(config, run, "--set", "train.zero_stage=1", ranks=2, script=str(script),
                 env={"SQUAD_TEST_FAIL": f"{STEP4}/zero_pp_rank_1:1:torch"})
    output = res.stdout + res.stderr
    assert res.returncode == 3, output[-3000:]
    message = f"could not write checkpoint {STEP4} to {run / 'checkpoints' / SAVING / STEP4 / 'zero_pp_rank_1'}"
    assert message in output and "basic_ios::clear: iostream error" in output and "MiB free" in output
    log = (run / "train.log").read_text()
    assert message in log and f"previous checkpoint {run / 'checkpoints' / STEP2} is intact" in log
    assert find_resume_tag(run / "checkpoints") == STEP2 and not (run / "checkpoints" / STEP4).exists()
    assert not (run / "checkpoints" / SAVING).exists()
    assert not (run / "model.pt").exists()
    _ok(_train(config, run, "--set", "train.zero_stage=1", ranks=2))  # room again: it resumes and finishes
    assert f"resumed from {run / 'checkpoints' / STEP2}" in (run / "train.log").read_text()
    assert (run / "model.pt").is_file()


@pytest.mark.slow
def test_disk_full_writing_model_pt(config, one_rank_run, tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    run = tmp_path / "run"
    res = _train(config, run, script=str(script), env={"SQUAD_TEST_FAIL": ".model.tmp:0:oserror"})
    assert res.returncode == 3, res.stderr[-3000:]
    message = f"could not write the exported model to {run / 'model.pt'}: No space left on device"
    assert message in res.stderr and message in (run / "train.log").read_text()
    assert "rerun the same command" in res.stderr
    assert not (run / "model.pt").exists() and not list(run.glob(".model.tmp*"))
    assert find_resume_tag(run / "checkpoints") == STEP4
    _ok(_train(config, run))  # the rerun writes it, without training or logging again
    _same_model(_model(one_rank_run), _model(run))
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 4]


# ------------------------------------------------- issue 37: the disk fills up after the tag is renamed into place
@pytest.mark.slow
def test_disk_full_writing_latest_keeps_the_complete_tag_resumable(config, one_rank_run, tmp_path):
    """``latest`` cannot be written once step 4's tag is in place (``latest`` names step 2): the message says what
    is on disk — step 4 complete, the one a resume picks — and no tag holds the space unused."""
    script = tmp_path / "inject.py"
    script.write_text(INJECT)
    run = _copy(one_rank_run, tmp_path / "run")
    (run / "model.pt").unlink()
    shutil.rmtree(run / "checkpoints" / STEP4)
    (run / "checkpoints" / "latest").write_text(STEP2)
    res = _train(config, run, script=str(script), env={"SQUAD_TEST_FAIL": "latest.tmp:0:oserror"})
    assert res.returncode == 3, res.stderr[-3000:]
    ckpt_dir = run / "checkpoints"
    assert f"could not write checkpoint {STEP4} to {ckpt_dir / 'latest'}: No space left on device" in res.stderr
    assert f"{STEP4} is complete in {ckpt_dir / STEP4} nonetheless" in res.stderr, res.stderr[-3000:]
    assert "was not saved" not in res.stderr and "Traceback" not in res.stderr
    assert not (ckpt_dir / "latest").exists() and find_resume_tag(ckpt_dir) == STEP4
    assert ckpt_tags.verify_tag(ckpt_dir / STEP4) is None and not (ckpt_dir / SAVING).exists()


def test_unit_a_latest_that_cannot_be_pointed_at_the_new_tag_removes_it(tmp_path, monkeypatch):
    """When ``latest`` can be neither written nor removed, the new tag would never be resumed from: it is removed,
    and the message says so (the previous tag stays the latest)."""
    import errno
    import os

    d = tmp_path / "checkpoints"
    for step in (2, 4):
        (d / SAVING / tag_for(step)).mkdir(parents=True)
        torch.save({"module": {"w": torch.ones(2)}, "ds_config": {}}, d / SAVING / tag_for(step) / MODEL_STATES)
    ckpt_tags.commit_tag(d, STEP2, {"step": 2}, keep=5)
    real_write, real_unlink = ckpt_tags.atomic_write_text, Path.unlink

    def write(path, text, *args, **kwargs):
        if Path(path).name == "latest":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, text, *args, **kwargs)

    def unlink(self, *args, **kwargs):
        if self.name == "latest":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(ckpt_tags, "atomic_write_text", write)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(OSError):
        ckpt_tags.commit_tag(d, STEP4, {"step": 4}, keep=5)
    c = ckpt.Checkpointer.__new__(ckpt.Checkpointer)
    c.ckpt_dir = d
    message = c._after_failed_save(d / SAVING / STEP4, 4, renamed=True)
    assert f"{d / STEP4} is removed" in message and f"previous checkpoint {d / STEP2} is intact" in message
    assert not (d / STEP4).exists() and find_resume_tag(d) == STEP2 and complete_tags(d) == [STEP2]


# ------------------------------------- issue 37: resume compares the tag's own config and the data it was trained on
@pytest.mark.slow
def test_resume_compares_the_config_and_data_the_tag_was_trained_with(config, one_rank_run, tmp_path):
    """config.yaml deleted: a refused change is still refused (the config is in the tag), an allowed one recorded;
    data.root pointing at another dataset is refused naming the key; the same data moved elsewhere resumes."""
    import yaml

    from squad.data.synthetic.taskonomy import render_dataset

    run = _copy(one_rank_run, tmp_path / "run")
    (run / "model.pt").unlink()
    shutil.rmtree(run / "checkpoints" / STEP4)
    (run / "checkpoints" / "latest").write_text(STEP2)
    (run / "config.yaml").unlink()
    trained = yaml.safe_load((run / "checkpoints" / STEP2 / "config.yaml").read_text())
    assert trained["optim"]["lr"] == 5e-3 and trained["optim"]["steps"] == 4
    before = (run / "run_history.jsonl").read_text()

    res = _train(config, run, "--set", "optim.lr=5e-2")  # refused before torch is imported
    assert res.returncode == 2, res.stderr[-3000:]
    assert "optim.lr: 0.005 → 0.05" in res.stderr and f"cannot resume {run / 'checkpoints' / STEP2}" in res.stderr

    other = tmp_path / "other"
    render_dataset(other, n=24, image_size=32, seed=1, buildings=4, workers=1)
    res = _train(config, run, "--set", f"data.root={other}")
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"error: data.root: {run / 'checkpoints' / STEP2} was trained on" in res.stderr
    assert "(8 training samples" in res.stderr and "(12 samples" in res.stderr and "Traceback" not in res.stderr
    assert (run / "run_history.jsonl").read_text() == before and not (run / "config.yaml").exists()

    moved = tmp_path / "moved"
    shutil.copytree(yaml.safe_load(config.read_text())["data"]["root"], moved)
    _ok(_train(config, run, "--set", f"data.root={moved}", "--set", "optim.steps=5"))
    start = json.loads((run / "run_history.jsonl").read_text().splitlines()[-1])
    assert start["config_changes"]["optim.steps"] == [4, 5] and start["start_step"] == 2
    assert start["config_changes"]["data.root"][1] == str(moved)
    assert yaml.safe_load((run / "checkpoints" / tag_for(5) / "config.yaml").read_text())["optim"]["steps"] == 5


# -------------------------------------------- issue 37: a missing or wrong expert shard file (expert parallelism)
EP = ["--set", "model.moe.expert_parallel=2", "--set", "model.moa.expert_parallel=2", "--set", "train.ckpt_every=1",
      "--set", "train.keep_checkpoints=5"]
ONE_RANK = ["--set", "model.moe.expert_parallel=1", "--set", "model.moa.expert_parallel=1",
            "--set", "optim.grad_accum=2"]  # the same global batch on 1 rank

# rank 1 alone fails to load its experts from the tag named by SQUAD_TEST_FAIL (what a verified tag can still do)
EP_INJECT = '''
import os, sys
from squad.io.checkpoints import DamagedCheckpointError
from squad.train.expert_shards import ExpertShards
real = ExpertShards.load
def load(self, tag_dir, saved=None, optimizer=True):
    if os.environ.get("RANK") == "1" and os.environ["SQUAD_TEST_FAIL"] in str(saved or tag_dir):
        raise DamagedCheckpointError(f"{tag_dir}: injected: this rank's experts do not fit", tag_dir)
    return real(self, tag_dir, saved, optimizer)
ExpertShards.load = load
from squad.cli.train import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, config) -> Path:
    """2 ranks, experts sharded over both (expert_parallel 2), a checkpoint at every one of the 4 steps."""
    out = tmp_path_factory.mktemp("runs") / "ep"
    _ok(_train(config, out, *EP, ranks=2))
    return out


def _ep_copy(ep_run: Path, dest: Path) -> tuple[Path, dict[int, Path]]:
    run = _copy(ep_run, dest)
    (run / "model.pt").unlink()
    return run, {s: run / "checkpoints" / tag_for(s) for s in range(1, 5)}


@pytest.mark.slow
def test_a_tag_is_complete_only_with_every_shard_file(ep_run, tmp_path):
    run, tags = _ep_copy(ep_run, tmp_path / "run")
    assert all(ckpt_tags.verify_tag(t) is None for t in tags.values())
    (tags[4] / "expert_shards_rank00001.pt").unlink()  # removed
    shutil.copyfile(tags[3] / "expert_shards_rank00000.pt", tags[3] / "expert_shards_rank00001.pt")  # rank 0's
    for tag in (tags[4], tags[3]):
        problem = ckpt_tags.verify_tag(tag)
        assert isinstance(problem, DamagedCheckpointError), tag
        assert "experts [2, 3] of blocks.0." in str(problem) and "in none of its expert_shards_rank*.pt" in str(problem)


@pytest.mark.slow
def test_a_missing_or_unloadable_shard_file_falls_back_on_every_rank(config, ep_run, tmp_path):
    """Step 4's rank-1 shard file is gone (the tag check passes it over); step 3 verifies but rank 1 cannot load its
    experts (rank 1 says so): both ranks fall back to step 2 together, and only step 2 is said to be resumed."""
    run, tags = _ep_copy(ep_run, tmp_path / "run")
    (tags[4] / "expert_shards_rank00001.pt").unlink()
    script = tmp_path / "inject.py"
    script.write_text(EP_INJECT)
    res = _train(config, run, *EP, ranks=2, script=str(script), env={"SQUAD_TEST_FAIL": tag_for(3)})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    log = (run / "train.log").read_text()
    assert f"checkpoint {tags[4]} is damaged" in log and "in none of its expert_shards_rank*.pt files" in log
    assert f"[squad] rank 1: checkpoint {tags[3]} could not be loaded: DamagedCheckpointError" in out, out[-4000:]
    assert "could not be loaded (rank 1: DamagedCheckpointError" in log and f"falling back to {tags[2]}" in log
    assert [line.split("resumed from ")[1] for line in log.splitlines() if "resumed from" in line] == \
        [f"{tags[2]} at step 2"]
    history = [json.loads(line) for line in (run / "run_history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and history[-1]["resumed_from"] == str(tags[2]) and history[-1]["start_step"] == 2
    assert history[-1]["skipped_damaged"] == [str(tags[4]), str(tags[3])]
    assert (run / "model.pt").is_file() and ckpt_tags.verify_tag(tags[4]) is None  # step 4 saved again, whole


@pytest.mark.slow
def test_a_wrong_shard_file_on_one_rank_falls_back(config, ep_run, tmp_path):
    """Rank 0's shard file copied over rank 1's, resumed on 1 rank (the experts put back together): step 3 is
    resumed from, no traceback."""
    run, tags = _ep_copy(ep_run, tmp_path / "run")
    shutil.copyfile(tags[4] / "expert_shards_rank00000.pt", tags[4] / "expert_shards_rank00001.pt")
    res = _train(config, run, *ONE_RANK)
    assert res.returncode == 0, res.stderr[-4000:]
    log = (run / "train.log").read_text()
    assert f"checkpoint {tags[4]} is damaged" in log and f"resumed from {tags[3]} at step 3" in log
    assert "Traceback" not in res.stderr


def test_resume_names_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--resume .*nowhere: no such file or folder"):
        ckpt_tags.resolve_resume(tmp_path / "run", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint there"):
        ckpt_tags.resolve_resume(tmp_path / "run", str(tmp_path / "empty"))
    assert ckpt_tags.resolve_resume(tmp_path / "run", "auto") is None
