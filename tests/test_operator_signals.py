"""Signals, processes and peers as a cluster operator meets them (issue 37): a stop during start-up and during the
step-0 validation, the ``deepspeed`` runner killed alone, two runs started into one folder on one port, a peer rank
stopped with SIGSTOP (and a SIGTERM while waiting for it), a peer killed with SIGKILL, and the batch script's requeue
decision. Real `tools/train.py` runs on 2 gloo ranks under the deepspeed launcher where the fault needs 2.

Faults are injected from inside the run (`INJECT`), at a chosen point, as in tests/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from squad.distributed import free_port
from squad.io.checkpoints import find_resume_tag, tag_for
from squad.train.stops import EXIT_PREEMPTED, STOP_RECORD
from tests.helpers import DEEPSPEED, PY, ROOT, launcher, tool_env, write_run_config

TIMEOUT = 400

# SQUAD_TEST_FAULT = "WHAT:WHERE:N": WHAT is a signal name sent to this process (TERM), STOP or KILL (sent by rank 0
# to rank 1 at its micro-batch N), PEERTERM (SIGTERM sent by rank 0 to rank 1 alone), or STOP+TERM (rank 1 stopped,
# then SIGTERM to rank 0 a second later); WHERE is
# "step" (micro-batch N's forward), "init" (before the process group starts) or "validate" (the step-0 validation).
INJECT = '''
import os, signal, subprocess, sys, threading, time
import psutil
what, where, at = os.environ["SQUAD_TEST_FAULT"].split(":")
at = int(at)
rank = int(os.environ.get("RANK", "0"))

def peer():
    me = psutil.Process()
    return next(p for p in me.parent().children() if p.pid != me.pid and "--local_rank" in " ".join(p.cmdline()))

def fire():
    if what == "PEERTERM":
        os.kill(peer().pid, signal.SIGTERM)
        time.sleep(1)  # rank 1's handler runs meanwhile
    elif what in ("STOP", "KILL", "STOP+TERM"):
        other = peer()
        os.kill(other.pid, signal.SIGKILL if what == "KILL" else signal.SIGSTOP)
        if what != "KILL":  # the operator kills the stopped rank once this one has gone (not the test's subject)
            subprocess.Popen(["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 0.2; done; "
                              f"kill -9 {other.pid}"], start_new_session=True)
        if what == "STOP+TERM":
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    else:
        os.kill(os.getpid(), getattr(signal, "SIG" + what))
        time.sleep(1)  # the handler runs here

if where == "init":
    import squad.distributed as d
    start = d.init_distributed
    def init_distributed(*args, **kwargs):
        fire()
        return start(*args, **kwargs)
    d.init_distributed = init_distributed
elif where == "validate":
    import importlib
    e = importlib.import_module("squad.eval.evaluate")  # the module (squad.eval's `evaluate` is the function)
    run = e.evaluate
    def evaluate(*args, **kwargs):
        fire()
        return run(*args, **kwargs)
    e.evaluate = evaluate
elif rank == 0:
    from squad.train.objective import MultiTaskObjective
    forward, calls = MultiTaskObjective.forward, [0]
    def counted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            fire()
        return forward(self, *args, **kwargs)
    MultiTaskObjective.forward = counted
from squad.cli.train import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """6 steps of 8 images (2 ranks × 4), a checkpoint every 2 steps, ZeRO-1."""
    from squad.data.synthetic.taskonomy import render_dataset

    root = tmp_path_factory.mktemp("synth")
    render_dataset(root, n=16, image_size=32, seed=0, buildings=4, workers=1)
    return write_run_config(tmp_path_factory.mktemp("cfg") / "tiny.yaml", root, ["depth_euclidean", "class_scene"],
                            loss={"w_mi": 0.0}, optim={"warmup_steps": 1, "steps": 6, "batch_per_rank": 4},
                            train={"log_every": 1, "ckpt_every": 2, "zero_stage": 1})


def _command(config: Path, out: Path, *extra: str, ranks: int = 2, fault: str | None = None,
             port: int | None = None) -> tuple[list[str], dict]:
    env = tool_env()
    script = "tools/train.py"
    if fault:
        script = str(out.parent / "inject.py")
        Path(script).write_text(INJECT)
        env["SQUAD_TEST_FAULT"] = fault
    first = launcher(ranks, deepspeed=True) if port is None else [DEEPSPEED, "--num_gpus", str(ranks),
                                                                  "--master_port", str(port)]
    return [*first, script, "--config", str(config), "--out", str(out), *extra], env


def _run(config: Path, out: Path, *extra: str, **kw) -> tuple[int, str]:
    cmd, env = _command(config, out, *extra, **kw)
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    return res.returncode, res.stdout + res.stderr


def _popen(config: Path, out: Path, *extra: str, **kw) -> subprocess.Popen:
    cmd, env = _command(config, out, *extra, **kw)
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _record(run: Path) -> dict | None:
    path = run / STOP_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def _released(run: Path) -> bool:
    return (run / "run.lock").read_text() == ""


# ------------------------------------------------------------------------------------------------- start-up
@pytest.mark.slow
def test_a_stop_during_start_up_exits_75_at_once(config, tmp_path):
    """SIGTERM before the process group exists (the handler is there from the tool's first line), and SIGHUP (a
    closed terminal) during the step-0 validation, which is not finished first: exit 75 at once, one line, the stop
    record, no checkpoint."""
    run = tmp_path / "early"
    code, out = _run(config, run, ranks=1, fault="TERM:init:0")
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert out.count("stopped: SIGTERM before the first training step") == 1 and "Traceback" not in out, out[-3000:]
    assert _record(run)["resumable"] and _released(run)

    run = tmp_path / "validating"
    code, out = _run(config, run, ranks=1, fault="HUP:validate:0")
    assert code == EXIT_PREEMPTED, out[-3000:]
    assert "stopped: SIGHUP before the first training step" in out and "validation at step 0" not in out, out[-3000:]
    assert not (run / "checkpoints").exists() or find_resume_tag(run / "checkpoints") is None
    assert _record(run)["resumable"] and _released(run)


# --------------------------------------------------------------------------- the runner killed; one port twice
@pytest.mark.slow
def test_two_runs_into_one_folder_and_the_runner_killed_alone(config, tmp_path):
    """Two fresh runs into one --out at once on one port: one trains, the other leaves with an ``error:`` line (no
    traceback). Then SIGTERM to the ``deepspeed`` runner only: its ranks do not train on as orphans holding the lock:
    they checkpoint, say why, leave the stop record and exit 75."""
    import psutil

    run = tmp_path / "run"
    port = free_port()
    first = _popen(config, run, "--set", "optim.steps=400", port=port)
    second = _popen(config, run, "--set", "optim.steps=400", port=port)
    deadline = time.monotonic() + TIMEOUT
    while first.poll() is None and second.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    refused, trains = (first, second) if first.poll() is not None else (second, first)
    out = refused.communicate(timeout=TIMEOUT)[0]
    assert refused.returncode == 2, out[-3000:]
    assert re.search(r"^error: .*(in use by another training run|rendezvous port .* is in use)", out, re.M), out
    assert "Traceback" not in out and "EADDRINUSE" not in out, out[-3000:]

    log = run / "train.log"
    while not (log.is_file() and "step 2/" in log.read_text()):
        assert trains.poll() is None and time.monotonic() < deadline, trains.stdout.read()[-3000:]
        time.sleep(0.2)
    family = psutil.Process(trains.pid).children(recursive=True)
    trains.send_signal(signal.SIGTERM)  # the runner alone
    out = trains.communicate(timeout=TIMEOUT)[0]  # ends when the launcher and the ranks have closed the pipe
    psutil.wait_procs(family, timeout=60)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family), out[-3000:]
    # rank 0 says what stopped the run, seen by itself or by the other rank first (the watchdogs race)
    stopped = re.search(r"stopped: stopped by the exit of the deepspeed runner \(pid \d+\)(?: on rank 1)? at step "
                        r"(\d+)", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert find_resume_tag(run / "checkpoints") == tag_for(step) and _released(run)
    assert _record(run)["resumable"] and f"at step {step}" in _record(run)["message"]


@pytest.mark.slow
def test_a_signal_to_one_rank_is_named_by_rank_0(config, tmp_path):
    """SIGTERM to rank 1 alone: every rank checkpoints at the next step boundary and exits 75, and rank 0's line says
    what stopped the run and where (it said "a signal on another rank")."""
    run = tmp_path / "run"
    code, out = _run(config, run, fault="PEERTERM:step:3")
    assert code == EXIT_PREEMPTED, out[-3000:]
    stopped = re.search(r"stopped: stopped by SIGTERM on rank 1 at step (\d+)", out)
    assert stopped and "a signal on another rank" not in out and "Traceback" not in out, out[-3000:]
    assert find_resume_tag(run / "checkpoints") == tag_for(int(stopped.group(1))) and _released(run)


# ------------------------------------------------------------------------------------- a hung peer, a dead peer
@pytest.mark.slow
def test_a_stopped_peer_and_a_killed_peer_are_named(config, tmp_path):
    """Rank 1 stopped (SIGSTOP) at step 3, then SIGTERM to rank 0 waiting for it: rank 0 exits 75 at once, naming
    rank 1 (no checkpoint can be written without it), and leaves the stop record. The rerun resumes from step 2;
    rank 1 killed (SIGKILL) there: rank 0 names the dead rank and says a rerun resumes, no gloo traceback."""
    run = tmp_path / "run"
    code, out = _run(config, run, fault="STOP+TERM:step:3")
    assert re.search(r"stopped: SIGTERM while rank 0 waits for rank 1 \(pid \d+\), which is stopped \(SIGSTOP\)",
                     out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert find_resume_tag(run / "checkpoints") == tag_for(2) and not (run / "checkpoints" / tag_for(3)).exists()
    assert _record(run)["resumable"] and _released(run)

    code, out = _run(config, run, fault="KILL:step:2")  # step 3 of the resumed run
    assert code != 0 and _record(run) is None, out[-3000:]
    assert re.search(r"rank 1 \(pid \d+\), which died .*checkpoints/step00000002, is intact: run the same command "
                     r"again to resume from it", out), out[-3000:]
    assert "Traceback" not in out and "Connection closed by peer" not in out, out[-3000:]
    assert _released(run)


@pytest.mark.slow
def test_a_peer_silent_past_peer_timeout_ends_the_run(tmp_path):
    """The watchdog on a 2-rank gloo group (no DeepSpeed): rank 1 stops itself (SIGSTOP) before an all-reduce; rank
    0, waiting in it, ends the run after ``peer_timeout`` with one line naming rank 1, exit 3."""
    code = '''
import os, signal, sys, time
import torch, torch.distributed as dist
from squad.train.signals import SignalWatch
from squad.train.watchdog import PeerWatch
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
watch = SignalWatch(["TERM"], announce=rank == 0)
watch.install()
watch.start_training()
PeerWatch(rank, 2, sys.argv[1], watch, timeout=3).start()
time.sleep(1.5)  # both heartbeats seen
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.all_reduce(torch.ones(1))
print("all-reduce returned")
'''
    env = {**tool_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([PY, "-c", code, str(tmp_path)], env={**env, "RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        out = procs[0].communicate(timeout=120)[0]
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 3, out
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and re.search(r"rank 1 \(pid \d+\), which is stopped \(SIGSTOP\) and has not answered "
                                         r"for \d+ s.*train.peer_timeout=3 s", lines[0]), out
    assert "no checkpoint yet" in lines[0] or "starts it over" in lines[0], out


# ---------------------------------------------------------------------------------- the batch script's decision
def _batch_script() -> str:
    text = (ROOT / "docs" / "operating.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", text, re.S).group(1)


@pytest.mark.parametrize("runner_code, record, requeued", [
    (1, "now", True),  # the deepspeed runner returns 1 (or 143) while its ranks stopped with a checkpoint
    (143, "late", True),  # the runner is gone at once; its ranks checkpoint, write the record and let go later
    (75, None, False),  # no record: this attempt did not stop resumably (e.g. a record of an earlier one)
    (3, None, False),
    (0, None, False),
])
def test_the_batch_script_requeues_on_the_runs_own_record(tmp_path, runner_code, record, requeued):
    """The batch script of docs/operating.md with stand-ins for ``deepspeed`` and ``scontrol``: it requeues when the
    run left its stop record, whatever the runner returned, and never on a record an earlier attempt left."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "runs" / "msq"
    out.mkdir(parents=True)
    (out / STOP_RECORD).write_text("{}")  # an earlier attempt's: the script removes it before starting
    write = f'echo \'{{"resumable": true}}\' > {out / STOP_RECORD}'
    if record == "late":  # the ranks outlive the runner: a lock holder that writes the record, then lets go
        lock = out / "run.lock"
        write = f'(sleep 2; {write}; : > {lock}) & echo "{{\\"host\\": \\"h\\", \\"pid\\": $!}}" > {lock}'
    (bin_dir / "deepspeed").write_text(f"#!/bin/sh\n{write if record else ''}\nexit {runner_code}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(_batch_script().replace("runs/msq", str(out)))
    res = subprocess.run(["bash", str(script)], env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
                                                         SLURM_JOB_ID="4242"),
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (tmp_path / "scontrol.args").exists() == requeued, res.stdout + res.stderr
    if requeued:
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
        assert res.returncode == EXIT_PREEMPTED
    else:
        assert res.returncode == runner_code, res.stdout + res.stderr


def test_every_operator_signal_is_documented():
    """TERM, USR1, HUP and INT each have a line in the operator's page (docs/operating.md) saying what they do."""
    text = (ROOT / "docs" / "operating.md").read_text()
    section = text[text.index("## Preemption, interrupts and resuming anywhere"):]
    section = section[:section.index("\n## ", 10)]
    for name in ("SIGTERM", "SIGUSR1", "SIGHUP", "SIGINT", "SIGKILL", "SIGSTOP"):
        assert re.search(rf"^\| `{name}`", section, re.M), name
    assert sys.platform != "win32"


def test_a_signal_ignored_at_start_stays_ignored():
    """``nohup`` starts a run with SIGHUP ignored: the run keeps ignoring it (a closed terminal does not stop it)."""
    from squad.train.signals import SignalWatch

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        watch = SignalWatch(["HUP", "USR2"])
        watch.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR2) == watch._handle
        watch.restore()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_taken_rendezvous_port_is_an_error_line(monkeypatch):
    """A rank 0 of several whose port another run holds: a `ValueError` naming the port and what to pass (exit 2 with
    an ``error:`` line), not DeepSpeed's EADDRINUSE traceback."""
    import deepspeed
    import torch.distributed as dist

    from squad.distributed import init_distributed

    def taken(**kwargs):
        raise dist.DistNetworkError("The server socket has failed to listen on any local network address. port: "
                                    "29500, code: -98, name: EADDRINUSE, message: address already in use")

    monkeypatch.setattr(deepspeed, "init_distributed", taken)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"rendezvous port 127.0.0.1:29500 .* in use .* --master_port"):
        init_distributed()
