"""Preemption, interruption and resuming anywhere, as a cluster operator meets them: real `tools/train.py` runs on 2
gloo ranks under the deepspeed launcher (and on 1), at the smallest sizes.

One ZeRO-1 run is taken through every fault in turn — SIGTERM in the middle of a step (2 ranks), SIGUSR1 in the
middle of a save (2 ranks), a move to 1 rank (2 → 1) and back (1 → 2) — and compared with a run that never stopped:
bitwise where the world size stays, to fp32 tolerance where it changes (the same global batch, split differently;
the MI loss is off: it sums over each micro-step's images). A ZeRO-2 run makes the same two moves. Ctrl-C on 2 ranks,
a second signal during a save and a config typo (refused before torch is imported) complete the set.

The signals are sent from inside the run (`INJECT`), at a chosen point: rank 0 signals every rank of its launch (the
processes ``deepspeed.launcher.launch`` started), as ``scancel`` or SLURM's ``--signal`` would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from squad.distributed import free_port
from squad.io.checkpoints import SAVING, complete_tags, find_resume_tag, tag_for
from squad.train.stops import EXIT_PREEMPTED
from tests.helpers import PY, ROOT, launcher, logged_losses, run_command, tool_env, write_run_config

pytestmark = pytest.mark.slow  # every test here runs tools/train.py

TIMEOUT = 400  # a 2-rank tiny run takes about a minute on 2 busy cores; a rank left in a collective would wait 600 s
STEPS = 6

# Runs tools/train.py after arranging for a signal: SQUAD_TEST_SIGNAL = "SIG:step:N" (during step N's forward pass) or
# "SIG:save:N" (while rank 0 writes the checkpoint of step N), with ":again" to send a second one 2.5 s later.
INJECT = '''
import os, signal, sys, time
import psutil
import torch
name, where, at, *again = os.environ["SQUAD_TEST_SIGNAL"].split(":")
sig, at = getattr(signal, "SIG" + name), int(at)

def fire():
    me = psutil.Process()
    ranks = [me]
    if "--local_rank" in " ".join(me.cmdline()):  # every rank the launcher started
        ranks = [p for p in me.parent().children() if "--local_rank" in " ".join(p.cmdline())]
    for p in ranks:
        os.kill(p.pid, sig)
    if again:
        time.sleep(2.5)  # the first signal's handler runs here; the second exits at once
        for p in ranks:
            os.kill(p.pid, sig)

first = os.environ.get("RANK", "0") == "0"
if where == "load":  # the resume fails while DeepSpeed loads
    import deepspeed
    def broken(self, *args, **kwargs):
        raise RuntimeError("injected: loading failed")
    deepspeed.DeepSpeedEngine.load_checkpoint = broken
elif where == "step":
    from squad.train.objective import MultiTaskObjective
    forward, calls = MultiTaskObjective.forward, [0]
    def counted(self, *args, **kwargs):
        calls[0] += 1
        if first and calls[0] == at:  # micro-batch `at` of this run: step `at` with one micro-batch per step
            fire()
        return forward(self, *args, **kwargs)
    MultiTaskObjective.forward = counted
else:
    real = torch.save
    def save(obj, f, *args, **kwargs):
        if first and f"step{at:08d}" in str(f) and "model_states" in str(f):
            fire()
        return real(obj, f, *args, **kwargs)
    torch.save = save
from squad.cli.train import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """ZeRO-1, 6 steps of 8 images (2 ranks × 4, or 1 rank × 2 micro-batches of 4), a checkpoint every 2 steps."""
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.mktemp("synth")
    render_dataset(root, n=16, image_size=32, seed=0, buildings=4, workers=1)  # 8 training images
    return write_run_config(tmp_path_factory.mktemp("cfg") / "tiny.yaml", root, ["depth_euclidean", "class_scene"],
                            loss={"w_mi": 0.0, "weighting": "uncertainty"},
                            optim={"warmup_steps": 1, "steps": STEPS, "batch_per_rank": 4},
                            train={"log_every": 1, "ckpt_every": 2, "keep_checkpoints": 5, "zero_stage": 1})


def _train(config: Path, out: Path, *extra: str, ranks: int = 2, signal_at: str | None = None,
           popen: bool = False):
    """tools/train.py on ``ranks`` ranks (2: a launcher), 1 rank with 2 micro-batches per step."""
    accum = ["--set", "optim.grad_accum=2"] if ranks == 1 else []
    script = "tools/train.py"
    env = tool_env()
    if signal_at:
        script = str(out.parent / "inject.py")
        Path(script).write_text(INJECT)
        env["SQUAD_TEST_SIGNAL"] = signal_at
    # the real deepspeed launcher where a signal goes through it; otherwise the ranks forked from one preloaded
    # interpreter (tests.rank_launcher), one rank forked from the worker's (tests.helpers.run_command)
    cmd = [*launcher(ranks, deepspeed=bool(signal_at or popen)), script, "--config", str(config), "--out", str(out),
           *accum, *extra]
    if not (signal_at or popen):
        return run_command(cmd, ROOT, env, TIMEOUT)
    if popen:  # a process group of its own, with Ctrl-C's default action, as a terminal's foreground job has
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


def _out(res) -> str:
    return res.stdout + res.stderr


def _ok(res) -> None:
    assert res.returncode == 0, _out(res)[-4000:]


def _weights(tag: Path) -> dict[str, torch.Tensor]:
    return torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def _no_partial_save(run: Path) -> None:
    ckpt = run / "checkpoints"
    assert not (ckpt / SAVING).exists()
    for tag in ckpt.iterdir():
        if tag.is_dir():
            assert (tag / "COMPLETE").is_file(), f"{tag} is not complete"


def _stopped(res, run: Path, sig: str, step: int) -> None:
    """The run stopped on ``sig`` at ``step`` with a complete checkpoint there, exit 75, said once, lock released."""
    out = _out(res)
    assert res.returncode == EXIT_PREEMPTED, out[-4000:]
    assert out.count("stopped: stopped by") == 1 and f"stopped by SIG{sig} at step {step}" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert find_resume_tag(run / "checkpoints") == tag_for(step)
    _no_partial_save(run)
    assert (run / "run.lock").read_text() == ""  # released, not left to a dead process


@pytest.fixture(scope="module")
def reference(tmp_path_factory, config) -> Path:
    """The run that never stops: 2 ranks, 6 steps."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    _ok(_train(config, out))
    return out


def _close(a: dict[int, float], b: dict[int, float], steps) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= 1e-5 * max(1.0, abs(b[s])), (s, a[s], b[s])


# ------------------------------------------------------------------------------- signals, then resume anywhere
def test_zero1_through_every_fault_ends_where_an_uninterrupted_run_does(config, reference, tmp_path):
    """SIGTERM mid-step, SIGUSR1 mid-save (2 ranks), resumed bitwise; then 2 → 1 and 1 → 2 ranks (ZeRO-1's
    partitioned optimizer state converted), losses equal to the run that never stopped."""
    run = tmp_path / "run"
    ref = logged_losses(reference)
    assert sorted(ref) == list(range(1, STEPS + 1))

    res = _train(config, run, signal_at="TERM:step:3")  # during step 3's forward pass
    _stopped(res, run, "TERM", 3)
    assert set(logged_losses(run)) == {1, 2, 3}

    res = _train(config, run, signal_at="USR1:save:4")  # while rank 0 writes step 4's checkpoint: it is finished
    _stopped(res, run, "USR1", 4)
    assert "resumed from" in (run / "train.log").read_text()
    losses = logged_losses(run)
    assert {s: losses[s] for s in range(1, 5)} == {s: ref[s] for s in range(1, 5)}  # bitwise
    for step in (2, 4):  # the signal-time checkpoints hold the weights the uninterrupted run had then
        a, b = _weights(run / "checkpoints" / tag_for(step)), _weights(reference / "checkpoints" / tag_for(step))
        assert all(torch.equal(a[k], b[k]) for k in a), step

    moved = tmp_path / "moved"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("run.lock"))
    _ok(_train(config, run))  # the same 2 ranks to the end: the uninterrupted run's model, bit for bit
    a = torch.load(run / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(reference / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)

    res = _train(config, moved, "--set", f"train.stop_at={STEPS - 1}", ranks=1)  # 2 → 1 rank, 2 micro-batches
    _ok(res)
    log = (moved / "train.log").read_text()
    assert "converting" in log and "universal checkpoint" in log and "world size changed on resume" in log
    _ok(_train(config, moved))  # 1 → 2 ranks
    _close(logged_losses(moved), ref, range(1, STEPS + 1))
    history = [json.loads(line) for line in (moved / "run_history.jsonl").read_text().splitlines()]
    assert [h["world_size"] for h in history] == [2, 2, 1, 2]
    assert not (moved / "checkpoints" / ".convert").exists()


# torch's zip writer on a full disk, met by the universal conversion's writes (issue 37, item 4)
FULL_DISK = '''
import sys, torch
real = torch.save
def save(obj, f, *args, **kwargs):
    if "/.convert/" in str(f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4048")
    return real(obj, f, *args, **kwargs)
torch.save = save
from squad.cli.train import main
sys.exit(main(sys.argv[1:]))
'''


def test_zero2_moves_to_one_rank_and_back(config, reference, tmp_path):
    """2 → 1 → 2 ranks at ZeRO-2; the move to 1 rank first meets a full disk during the conversion: exit 3 naming
    the folder and the free space, nothing of the run changed."""
    run = tmp_path / "run"
    zero2 = ["--set", "train.zero_stage=2"]
    _ok(_train(config, run, *zero2, "--set", "train.stop_at=2"))
    before = _contents(run)
    (tmp_path / "full.py").write_text(FULL_DISK)
    res = subprocess.run([PY, str(tmp_path / "full.py"), "--config", str(config), "--out", str(run),
                          "--set", "optim.grad_accum=2", *zero2, "--set", "train.stop_at=4"], env=tool_env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    out = _out(res)
    assert res.returncode == 3, out[-3000:]
    convert = run / "checkpoints" / ".convert"
    assert f"error: could not write the universal checkpoint of {tag_for(2)} to {convert}" in out, out[-3000:]
    assert "MiB free on that filesystem" in out and f"{run / 'checkpoints' / tag_for(2)} is intact" in out
    assert "Traceback" not in out and "it/s" not in out, out[-3000:]
    assert _contents(run) == before and not convert.exists()
    _ok(_train(config, run, *zero2, "--set", "train.stop_at=4", ranks=1))
    _ok(_train(config, run, *zero2))
    _close(logged_losses(run), logged_losses(reference), range(1, STEPS + 1))
    history = [json.loads(line) for line in (run / "run_history.jsonl").read_text().splitlines()]
    assert [(h["world_size"], h["start_step"]) for h in history] == [(2, 0), (1, 2), (2, 4)]


def _contents(run: Path) -> dict:
    """Every file of a run folder but the attempt's log and lock, and what each holds."""
    return {p.relative_to(run): p.read_bytes() for p in run.rglob("*")
            if p.is_file() and p.name not in ("train.log", "run.lock")}


def test_a_failed_resume_changes_nothing_in_the_run_folder(config, reference, tmp_path):
    """A resume on another world size with another global batch is refused before torch is imported; one that fails
    while DeepSpeed loads (2 → 1 ranks, after the conversion, with a config change that would be recorded) leaves
    config.yaml, the history, the DeepSpeed config, the logs and the checkpoints as they were."""
    run = tmp_path / "run"
    shutil.copytree(reference, run, ignore=shutil.ignore_patterns("run.lock", "model.pt"))
    shutil.rmtree(run / "checkpoints" / tag_for(STEPS))  # resume from step 4
    before = _contents(run)
    res = subprocess.run([PY, "-X", "importtime", "tools/train.py", "--config", str(config), "--out", str(run)],
                         env=tool_env(), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 2 and "written by 2 ranks, this run has 1" in res.stderr, res.stderr[-3000:]
    assert not re.search(r"\|\s+torch$", res.stderr, re.M)  # refused before torch was imported (-X importtime)
    res = _train(config, run, "--set", "train.log_every=2", ranks=1, signal_at="TERM:load:0")
    # every tag fails to load (the injection hits each): exit 2, naming the failure, after falling back once
    assert res.returncode == 2 and "injected: loading failed" in _out(res), _out(res)[-3000:]
    assert _contents(run) == before and not (run / "config.prev.yaml").exists()


# ---------------------------------------------------------------------- docs/operating.md's SLURM batch script
def _batch_script(config: Path, out: Path) -> str:
    """The batch script of docs/operating.md, on 2 CPU ranks with the test's config and run folder."""
    text = (ROOT / "docs" / "operating.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)
    return (script.replace("--num_gpus 8", "--num_gpus 2 --master_port " + str(free_port()))
            .replace("configs/taskonomy/modsquad_vit_b.yaml", f"{config} --set optim.steps=400")
            .replace("runs/msq", str(out)))


def test_the_readme_batch_script_hands_usr1_to_the_ranks_and_requeues(config, tmp_path):
    """SLURM's ``--signal=B:USR1@120`` reaches the batch shell only: the script passes it to the ranks, which
    checkpoint and exit 75 through both deepspeed launchers, and the script requeues the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    (bin_dir / "deepspeed").symlink_to(Path(PY).parent / "deepspeed")
    run = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(_batch_script(config, run))
    env = tool_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="4242")
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _wait_for(run, "step 2/", proc)
    proc.send_signal(signal.SIGUSR1)  # the batch shell only, as --signal=B:USR1 does
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    assert out.count("stopped: stopped by SIGUSR1 at step") == 1 and "Traceback" not in out, out[-3000:]
    step = int(re.search(r"stopped by SIGUSR1 at step (\d+)", out).group(1))
    assert find_resume_tag(run / "checkpoints") == tag_for(step) and (run / "run.lock").read_text() == ""
    assert "No CUDA runtime is found" not in out and "built successfully" not in out  # quiet CPU start


def _wait_for(run: Path, text: str, proc: subprocess.Popen) -> None:
    log = run / "train.log"
    deadline = time.monotonic() + TIMEOUT
    while not (log.is_file() and text in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.2)


# --------------------------------------------------------------------------------------- interrupts, twice
def test_ctrl_c_on_two_ranks_exits_130_quietly(config, tmp_path):
    run = tmp_path / "run"
    proc = _train(config, run, "--set", "optim.steps=400", popen=True)
    _wait_for(run, "step 2/", proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the foreground job
    out, _ = proc.communicate(timeout=120)
    # the deepspeed runner prints its own KeyboardInterrupt traceback (DeepSpeed's code, outside the ranks): the
    # ranks print none, and no collective torn down by the interrupt is reported. A rank may first see the runner
    # gone (its watchdog, while its main thread is inside a step) and say so in a "[squad] ..." line before its own
    # SIGINT is handled: that line is no traceback.
    assert out.count("Traceback") <= 1, out[-4000:]
    frames = [line for line in out.partition("Traceback")[2].splitlines() if line.strip().startswith("File ")]
    assert not any("/squad/" in f or "tools/train.py" in f for f in frames), out[-4000:]
    assert "Connection reset" not in out and "gloo" not in out.lower(), out[-4000:]
    assert sum(line.strip() == "interrupted" for line in out.splitlines()) == 1, out[-3000:]
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), out[-3000:]
    assert (run / "run.lock").read_text() == ""
    assert not (run / "checkpoints" / SAVING).exists()


def test_a_second_signal_during_a_save_exits_at_once_and_discards_it(config, tmp_path):
    """One rank: SIGTERM while step 4's checkpoint is written, again 2.5 s later: exit 143 at once, step 4's save
    discarded whole, step 2 the latest, the lock released."""
    run = tmp_path / "run"
    res = _train(config, run, ranks=1, signal_at="TERM:save:4:again")
    out = _out(res)
    assert res.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM again: exiting at once" in out
    assert complete_tags(run / "checkpoints") == [tag_for(2)] and find_resume_tag(run / "checkpoints") == tag_for(2)
    assert not (run / "checkpoints" / tag_for(4)).exists()
    _no_partial_save(run)
    assert (run / "run.lock").read_text() == ""


# ------------------------------------------------------------------------------------------------ fail fast
def test_a_config_typo_is_refused_before_torch_is_imported(config, tmp_path):
    code = ("import sys\nfrom squad.cli.train import main\ncode = main(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules)\nsys.exit(code)\n")
    res = subprocess.run([PY, "-c", code, "--config", str(config), "--out", str(tmp_path / "run"),
                          "--set", "optim.lrr=1"], env=tool_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert "unknown config key optim.lrr" in res.stderr and "torch imported: False" in res.stdout
    assert not (tmp_path / "run").exists()


def test_import_squad_is_light():
    res = subprocess.run([PY, "-c", "import sys, squad; print(sorted(m for m in ('torch', 'deepspeed', 'timm', "
                          "'numpy') if m in sys.modules), squad.__version__)"], capture_output=True, text=True,
                         timeout=120, env=tool_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "[]" and res.stdout.split()[1] != "0+unknown"
