"""``make gpu-check``: what one GPU says about squad, in one command of at most 9 minutes on an H100, written as one
JSON and one markdown table.

Stages, each in its own process with its own time limit (a stage that crashes or overruns is reported as such and
the next one runs; the whole check keeps to `TOTAL_S`):

- ``tests``: ``pytest -m gpu`` (every test marked as needing a GPU);
- ``kernels``: every backend of the routed ops timed at the shipped configs' shapes, the faster recorded in the
  kernel choice file that ``auto`` reads (`squad.bench.backends`, `squad.kernels.choice`), so the stages after it
  run what ``auto`` picks;
- ``bench``: the GPU rows of ``tools/bench.py`` (MoE MLP, MoE attention, MoD, MoNE, routed attention: bf16, CUDA
  events), each beside the traffic profile's modelled figure for it (`squad.bench.traffic_profile.predictions`: the
  H100 cost model, measured against model);
- ``step``: the ``train_step`` bench of modsquad_vit_b and mtl_vit_b, eager and compiled (images/s, MFU, peak memory);
- ``deepspeed``: a 60-step bf16 run of ``configs/demo.yaml`` under the ``deepspeed`` launcher with ``train.compile``
  on a freshly rendered synthetic dataset (steps done, images/s, final loss).

Everything but the measurements runs on any machine: `assemble`, `join_predictions` and `markdown` are tested on
the CPU, and without a GPU the check refuses with exit 2 before it starts (`require_gpu`). Stages run as
``python -m squad.bench.gpucheck STAGE RESULT_JSON WORK_DIR``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOTAL_S = 540.0  # 9 minutes for everything on one H100
GPU_BENCH_CASES = ["moe_mlp", "moa", "mod", "mone", "routed_attention"]
DEMO_STEPS = 60
FILES = ("gpu_check.json", "gpu_check.md")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage: its name and the seconds it may take (cut to what is left of `TOTAL_S`)."""

    name: str
    budget_s: float


STAGES = [Stage("tests", 120.0), Stage("kernels", 90.0), Stage("bench", 240.0), Stage("step", 150.0),
          Stage("deepspeed", 170.0)]  # the first H200 check took 72, 31, 23, 131 s; DeepSpeed overran 100 s; kernels
# now also times MoE attention's three backends at three shapes (the Triton head kernels compile on first use); bench
# now also compiles each routed case's dense twin (inductor: tens of seconds each)


class NoGpu(RuntimeError):
    """The check needs a CUDA GPU and this machine has none (the message says where to run it)."""


def require_gpu() -> str:
    """The GPU's name; `NoGpu` when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpu("make gpu-check needs a CUDA GPU and torch sees none on this machine; run it on a GPU machine "
                    "(docs/gpu.md, 'make gpu-check': the device command with .whl and .gpu carried)")
    return torch.cuda.get_device_name(0)


# ------------------------------------------------------------------------------------------------ the stages
def stage_tests(work: Path) -> dict:
    """``pytest -m gpu``: counts from its JUnit XML."""
    xml = work / "gpu_tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider",
                           f"--junitxml={xml}"], cwd=REPO, capture_output=True, text=True)
    print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n")
    counts = junit_counts(xml) if xml.is_file() else {}
    ok = proc.returncode == 0 and counts.get("tests", 0) > 0
    return {"status": "ok" if ok else "failed", "returncode": proc.returncode, **counts,
            "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""}


def junit_counts(xml: Path) -> dict:
    """tests / failures / errors / skipped / passed summed over a JUnit XML file's test suites."""
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def stage_kernels(work: Path) -> dict:
    """Each routed op's backends timed, the winners written to the kernel choice file."""
    from squad.kernels.choice import choices_path

    from .backends import measure

    rows = measure()
    failed = [f"{r['op']} {r['dims']}" for r in rows if "error" in r]
    return {"status": "failed" if failed else "ok", "errors": failed, "rows": rows, "choices": str(choices_path())}


def stage_bench(work: Path) -> dict:
    """The GPU bench rows (each routed layer against its eager and its compiled twin) and the traffic profile's
    predictions by the cost model of this GPU, joined."""
    import torch

    from .cases import result_dict, run_cases
    from .costmodel import gpu_model_name

    gpu = gpu_model_name(torch.cuda.get_device_name(0))
    measured = [result_dict(r) for r in run_cases(GPU_BENCH_CASES, device="cuda", options={"compiled": "twins"})]
    failed = [r["case"] for r in measured if r["unit"] == "error"]
    return {"status": "failed" if failed else "ok", "errors": failed, "rows": measured, "model_gpu": gpu,
            "joined": model_join(measured, gpu)}


def model_join(measured: Sequence[dict], gpu: str) -> list[dict]:
    """Measured GPU rows beside what the traffic profile, priced by ``gpu``'s cost model, predicts for them."""
    from .cases import result_dict
    from .traffic_profile import LAYERS, predictions, profile_layer

    traffic = [row for layer in LAYERS for row in profile_layer(layer, gpu)]
    return join_predictions(measured, predictions(traffic), [result_dict(r) for r in traffic])


def rejoin(report: dict) -> dict:
    """``report`` (a gpu_check.json) with its measured bench rows joined again with today's cost model of the GPU
    that measured them (no GPU needed: the model changed, the measurements stand); says so in ``rejoined``."""
    from .costmodel import gpu_model_name

    bench = report.get("stages", {}).get("bench", {})
    if not bench.get("rows"):
        raise ValueError("the report has no measured bench rows to join (its bench stage did not run or failed)")
    gpu = gpu_model_name(report.get("environment", {}).get("gpu"))
    bench.update(model_gpu=gpu, joined=model_join(bench["rows"], gpu))
    env = environment(gpu=False)
    report["rejoined"] = {"commit": env["commit"], "date": env["date"], "model_gpu": gpu}
    return report


def join_predictions(measured: Sequence[dict], predicted: dict[str, dict], traffic: Sequence[dict] = ()) -> list[dict]:
    """Every measured GPU row beside the model's figure for it, where the traffic profile predicts one.

    Args:
        measured: the GPU rows (`squad.bench.cases.result_dict`).
        predicted: `traffic_profile.predictions` (GPU case → modelled ratio).
        traffic: the traffic rows, for the modelled milliseconds of candidate and baseline.

    Returns:
        One dict per measured row: ``case``, ``unit``, ``target``, ``ok``, ``measured``, ``modelled`` (central; None
        where nothing is predicted) with ``modelled_low`` / ``modelled_high`` (the model's range) and ``inside``
        (the measured figure within it), ``model_error`` (modelled / measured − 1), measured / modelled (central)
        milliseconds of candidate and baseline where both exist, and ``twin: "eager"`` on a row that measured the
        eager twin of a layer the model compares with a fused one.
    """
    def central(ms):  # the kernel model's {low, central, high}, or one figure
        return ms["central"] if isinstance(ms, dict) else ms

    modelled_ms = {}
    for t in traffic:
        layer, twin = t["details"].get("layer"), t["details"].get("twin")
        for key in ("gpu_case", "eager_case"):
            if layer is not None and t["details"].get(key):
                modelled_ms[t["details"][key]] = (central(layer["model_ms"]), central(twin["model_ms"]))
    out = []
    for r in measured:
        p = predicted.get(r["case"])
        value, model = r["value"], p["modelled"] if p else None
        entry = {"case": r["case"], "unit": r["unit"], "target": r["target"], "ok": r["ok"], "measured": value,
                 "modelled": model, "model_error": (model / value - 1) if model is not None and value else None}
        if p and p.get("twin") == "eager":
            entry["twin"] = "eager"  # the model prices a fused twin; this row measured an eager one
        if p and "low" in p:
            entry.update(modelled_low=p["low"], modelled_high=p["high"],
                         inside=bool(value is not None and p["low"] <= value <= p["high"]))
        d = r.get("details", {})
        if "candidate_s" in d and r["case"] in modelled_ms:
            cand, base = modelled_ms[r["case"]]
            entry.update(measured_ms=(d["candidate_s"] * 1e3, d["baseline_s"] * 1e3), modelled_ms=(cand, base))
        out.append(entry)
    return out


def stage_step(work: Path) -> dict:
    """modsquad_vit_b and mtl_vit_b training steps, eager and compiled (no activation checkpointing)."""
    from .cases import result_dict
    from .step import bench_train_step

    rows = [result_dict(r) for r in bench_train_step(checkpointing=False)]
    failed = [r["case"] for r in rows if r["unit"] == "error"]
    return {"status": "failed" if failed else "ok", "errors": failed, "rows": rows}


STEP_LINE = re.compile(r"step (\d+)/(\d+) loss ([-\d.naninf]+) .* ([\d.]+) img/s")


def stage_deepspeed(work: Path) -> dict:
    """configs/demo.yaml for `DEMO_STEPS` steps in bf16 with train.compile, under the deepspeed launcher."""
    import shutil

    if shutil.which("deepspeed") is None:
        return {"status": "failed", "error": "no deepspeed launcher on PATH (carry .whl and source .gpu/on_device.sh)"}
    data, run_dir = work / "synthetic", work / "demo_run"
    t0 = time.perf_counter()
    made = subprocess.run([sys.executable, "tools/make_data.py", "synthetic", "--out", str(data), "--n", "64"],
                          cwd=REPO, capture_output=True, text=True)
    render_s = time.perf_counter() - t0
    if made.returncode != 0:
        return {"status": "failed", "error": f"rendering the data failed: {made.stderr[-800:]}"}
    sets = [f"data.root={data}", f"optim.steps={DEMO_STEPS}", "optim.warmup_steps=10", "train.precision=bf16",
            "train.compile=true", "train.eval_every=0", "train.ckpt_every=0", "train.progress=false",
            "data.val_batches=1"]
    cmd = ["deepspeed", "--num_gpus", "1", "tools/train.py", "--config", "configs/demo.yaml", "--out", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    returncode, log = stream(cmd)
    wall = time.perf_counter() - t0
    return {"status": "ok" if returncode == 0 else "failed", "returncode": returncode,
            "command": " ".join(cmd), "render_s": render_s, "wall_s": wall, **parse_train_log(log)}


def stream(cmd: Sequence[str]) -> tuple[int, str]:
    """Runs ``cmd``, each line of its output printed (into the stage's log) as it comes, so a stage stopped at its
    limit still leaves what the command said; returns (exit code, the whole output)."""
    lines = []
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return proc.returncode, "".join(lines)


def parse_train_log(text: str) -> dict:
    """The step lines of a training log: steps reached, total, final loss, last and best images/s."""
    steps = [(int(s), int(n), float(loss), float(rate)) for s, n, loss, rate in STEP_LINE.findall(text)]
    if not steps:
        return {"steps": 0}
    last = steps[-1]
    return {"steps": last[0], "total_steps": last[1], "final_loss": last[2], "last_img_s": last[3],
            "best_img_s": max(s[3] for s in steps), "finite": all(math.isfinite(s[2]) for s in steps)}


STAGE_FUNCTIONS: dict[str, Callable[[Path], dict]] = {"tests": stage_tests, "kernels": stage_kernels,
                                                      "bench": stage_bench, "step": stage_step,
                                                      "deepspeed": stage_deepspeed}


# ----------------------------------------------------------------------------------------------- the parent
def run_stage(stage: Stage, out_dir: Path, work: Path, timeout: float,
              argv: Sequence[str] | None = None) -> dict:
    """Runs one stage in a child process (its output in ``out_dir/<stage>.log``): its result, or a ``timeout`` /
    ``crashed`` status. ``argv`` replaces the child's command (the tests' stand-ins; ``{result}`` and ``{work}`` in
    it name the result file and the work folder)."""
    result_file = work / f"{stage.name}.json"
    if argv:
        cmd = [a.format(result=result_file, work=work) for a in argv]
    else:
        cmd = [sys.executable, "-m", "squad.bench.gpucheck", stage.name, str(result_file), str(work)]
    t0 = time.perf_counter()
    with open(out_dir / f"{stage.name}.log", "w") as log:
        # a session of its own: at the limit the stage and everything it started (a DeepSpeed launcher and its
        # ranks) are stopped together, so nothing holds the GPU into the next stage
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "timeout", "limit_s": round(timeout), "wall_s": time.perf_counter() - t0,
                    "log": f"{stage.name}.log"}
    wall = time.perf_counter() - t0
    if not result_file.is_file():
        return {"status": "crashed", "returncode": proc.returncode, "wall_s": wall,
                "log": f"{stage.name}.log"}
    return {**json.loads(result_file.read_text()), "wall_s": wall}


def run_check(out_dir: Path, stages: Sequence[Stage] = tuple(STAGES), total_s: float = TOTAL_S,
              commands: dict[str, Sequence[str]] | None = None) -> dict:
    """Runs the stages in order within ``total_s`` and writes `FILES` into ``out_dir``; returns the report."""
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="squad-gpu-check-") as tmp:
        for stage in stages:
            left = total_s - (time.perf_counter() - start)
            if left < 20:
                results[stage.name] = {"status": "skipped", "reason": f"{left:.0f} s left of {total_s:.0f}"}
                continue
            work = Path(tmp) / stage.name
            work.mkdir()
            results[stage.name] = run_stage(stage, out_dir, work, min(stage.budget_s, left),
                                            (commands or {}).get(stage.name))
    report = assemble(results, environment(), time.perf_counter() - start, [s.name for s in stages])
    (out_dir / FILES[0]).write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / FILES[1]).write_text(markdown(report))
    return report


def environment(gpu: bool = True) -> dict:
    """GPU (``gpu``: asked of torch), torch, Triton and DeepSpeed versions, the commit, the date."""
    import importlib.metadata as md

    import torch

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"gpu": torch.cuda.get_device_name(0) if gpu and torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": version("triton"), "deepspeed": version("deepspeed"),
            "commit": commit.stdout.strip() or None, "date": datetime.datetime.now().isoformat(timespec="seconds")}


def assemble(results: dict[str, dict], env: dict, wall_s: float, asked: Sequence[str] | None = None) -> dict:
    """The report: environment, every stage's result, the wall time and an overall ``ok`` (every stage asked for —
    all of `STAGES` by default — ran and passed; a missed performance target is reported, not failed)."""
    asked = set(asked) if asked is not None else {s.name for s in STAGES}
    ok = all(r.get("status") == "ok" for r in results.values()) and set(results) == asked
    return {"format": "squad.gpu_check/1", "environment": env, "wall_s": wall_s, "ok": ok, "stages": results}


def _fmt(value, spec: str = ".3f") -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(report: dict) -> str:
    """The report as markdown: the environment, then one table per stage."""
    env, stages = report["environment"], report["stages"]
    lines = [f"# make gpu-check — {env.get('gpu') or 'no GPU'}", "",
             f"commit {env.get('commit')}, {env.get('date')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"deepspeed {env.get('deepspeed')}; {report['wall_s']:.0f} s in all; "
             f"{'all stages passed' if report['ok'] else 'NOT all stages passed'}", "",
             "| stage | status | wall s |", "| --- | --- | --- |"]
    lines += [f"| {name} | {r.get('status')} | {_fmt(r.get('wall_s'), '.0f')} |" for name, r in stages.items()]
    tests = stages.get("tests", {})
    if "tests" in tests:
        lines += ["", f"GPU tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
                      f"{tests['skipped']} skipped"]
    kernels = stages.get("kernels", {}).get("rows")
    if kernels:
        lines += ["", f"## Routed-op backends (bf16; MoE MLP fwd+bwd, MoNE inference), recorded in "
                      f"{stages['kernels'].get('choices')}", "",
                  "| op | shape | configs | ms per backend | `auto` takes |", "| --- | --- | --- | --- | --- |"]
        for r in kernels:
            ms = ", ".join(f"{b} {v:.3f}" for b, v in r.get("ms", {}).items()) or r.get("error", "—")
            shape = ",".join(f"{k}{v}" for k, v in r["dims"].items())
            lines.append(f"| {r['op']} | {shape} | {', '.join(r['configs'])} | {ms} | {r.get('choice', '—')} |")
    joined = stages.get("bench", {}).get("joined")
    if joined:
        again = report.get("rejoined")
        note = f"; joined again at {again['commit']} on {again['date']}" if again else ""
        lines += ["", f"## GPU rows, measured beside the {stages['bench'].get('model_gpu', 'H100')} cost model "
                      f"(a MODEL: squad.bench.costmodel{note})", "",
                  "| case | measured | modelled | model range | model error | target | ok | "
                  "ms measured (cand / base) | ms modelled |", "|" + " --- |" * 9]
        for j in joined:
            ms = " / ".join(f"{v:.2f}" for v in j["measured_ms"]) if "measured_ms" in j else "—"
            model_ms = " / ".join(f"{v:.2f}" for v in j["modelled_ms"]) if "modelled_ms" in j else "—"
            err = f"{j['model_error'] * 100:+.0f} %" if j["model_error"] is not None else "—"
            ok = "" if j["ok"] is None else ("yes" if j["ok"] else "NO")
            span = (f"{j['modelled_low']:.2f}–{j['modelled_high']:.2f} ({'inside' if j['inside'] else 'OUTSIDE'})"
                    if "modelled_low" in j else "—")
            case = j["case"] + (" (eager twin; the model's is fused)" if j.get("twin") == "eager" else "")
            lines.append(f"| {case} | {_fmt(j['measured'])} | {_fmt(j['modelled'])} | {span} | {err} | "
                         f"{j['target']} | {ok} | {ms} | {model_ms} |")
    rows = stages.get("step", {}).get("rows")
    if rows:
        lines += ["", "## Training step (13 tasks, AdamW, bf16)", "", "| case | value | unit | MFU | peak GiB |",
                  "| --- | --- | --- | --- | --- |"]
        for r in rows:
            d = r.get("details", {})
            lines.append(f"| {r['case']} | {_fmt(r['value'])} | {r['unit']} | {_fmt(d.get('mfu'))} | "
                         f"{_fmt(d.get('peak_memory_gib'), '.1f')} |")
    ds = stages.get("deepspeed", {})
    if "steps" in ds:
        lines += ["", f"## DeepSpeed: {ds['steps']}/{ds.get('total_steps', DEMO_STEPS)} steps of configs/demo.yaml "
                      f"(bf16, train.compile) in {_fmt(ds.get('wall_s'), '.0f')} s; last "
                      f"{_fmt(ds.get('last_img_s'), '.1f')} img/s, final loss {_fmt(ds.get('final_loss'), '.4f')}"]
    return "\n".join(lines) + "\n"


def _child(argv: Sequence[str]) -> int:
    stage, result, work = argv
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    out = STAGE_FUNCTIONS[stage](Path(work))
    Path(result).write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
