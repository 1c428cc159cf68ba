"""Runs ``python tools/<name>.py ...`` for the tests without starting a new interpreter each time.

Most of a tiny tool run is importing torch, DeepSpeed and squad (3-4 s of a 4-9 s run on a loaded 2-core machine).
`ToolServer` starts one Python process per test worker that imports them once and does nothing else (no tensor op,
so no thread pool exists yet and forking is safe); each tool run is a fork of it that sets its own working folder,
environment (the one the test gives, as a fresh process would see it), argv, stdout and stderr, runs the tool's file
as ``__main__`` (`runpy.run_path`) in its own session, and exits through the interpreter's normal shutdown. What the
test sees is what `subprocess.run` gives: the exit status (negative: killed by that signal) and both streams.

Only a plain ``python tools/<name>.py`` command in the tests' tool environment goes through it
(`tests.helpers.run_command`; ``python -c CODE`` too when the caller says its code does not care which modules are
already imported; and ``python tests/rank_launcher.py ...``, whose ranks are forked from the run's fork); launchers
(deepspeed, torchrun, accelerate), other interpreter options, and a run whose environment changes how those modules
import (``TRITON_INTERPRET``, ``DS_ACCELERATOR``, a different ``PYTHONPATH``) start a real interpreter.
``SQUAD_TEST_FORK=0`` turns the server off (every run a fresh interpreter)."""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOAD = ("numpy", "torch", "deepspeed", "squad", "squad.train.engine", "squad.io", "squad.data", "squad.cli",
           "timm", "h5py")
# Variables whose value at import time shapes those modules: a run with another value starts a fresh interpreter.
IMPORT_TIME = ("TRITON_INTERPRET", "DS_ACCELERATOR", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
               "PYTHONHASHSEED")


class ToolServer:
    """One preloaded process; `run` forks a tool run from it (see the module docstring)."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen([python, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env,
                                     cwd=str(Path(__file__).resolve().parents[1]))

    def compatible(self, env: dict[str, str]) -> bool:
        return all(env.get(k) == self.env.get(k) for k in IMPORT_TIME)

    def run(self, argv: list[str], cwd: str | Path, env: dict[str, str], timeout: float) -> tuple[int | str, str, str]:
        """Runs ``argv`` (``[python, script, *args]``) as a fork; returns (exit status or "timeout", stdout, stderr).
        ``[python, tests/rank_launcher.py, ...]``: the ranks are forks of that fork (one session)."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            request = {"argv": argv[1:], "cwd": str(cwd), "env": env, "out": str(out), "err": str(err),
                       "ranks": Path(argv[1]).name == "rank_launcher.py"}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = json.loads(self._line(300))["pid"]  # the first request waits for the preload (minutes when loaded)
            try:
                status = json.loads(self._line(timeout))["rc"]
            except TimeoutError:
                with_group(pid, signal.SIGKILL)
                json.loads(self._line(30))
                status = "timeout"
            return status, out.read_text(errors="replace"), err.read_text(errors="replace")

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the tool server exited")
        return line.decode()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def with_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _child(request: dict, protocol: tuple[int, int]) -> None:
    """In the fork: becomes the tool run, then leaves through the interpreter's shutdown (SystemExit)."""
    for fd in protocol:
        os.close(fd)
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("ranks"):  # tests/rank_launcher.py --num_gpus N --master_port P SCRIPT ARGS: its ranks forked here
        from rank_launcher import launch, parse

        launch(*parse(request["argv"][1:]))  # exits
    if request["argv"][0] == "-c":  # python -c CODE [ARGS]
        sys.argv = request["argv"][1:]
        sys.argv[0] = "-c"
        sys.path[0] = ""
        exec(compile(request["argv"][1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        script = os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def preload() -> None:
    """The environment tools/*.py set before torch loads, then `PRELOAD` imported (no tensor op: forking stays safe)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what tools/*.py set before torch loads libgomp
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def _serve() -> None:
    preload()
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, (requests.fileno(), replies.fileno()))  # returns only by raising SystemExit
        replies.write((json.dumps({"pid": pid}) + "\n").encode())
        replies.flush()
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        replies.write((json.dumps({"rc": rc}) + "\n").encode())
        replies.flush()


if __name__ == "__main__":
    _serve()  # sys.path[0] (this folder) becomes each run's tools/ folder, as for ``python tools/<name>.py``
