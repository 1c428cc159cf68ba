"""The H100 cost model's calibration: 84de653's code recorded by the current recorder, priced, compared with what an
H100 measured there (`squad.bench.costmodel.MEASURED_CASES`), and refitted on demand.

- `record_commit`: extracts the commit with ``git archive`` into a temporary folder (tasks/, kernels/ and configs/
  linked under squad/ where the package installs them), and runs `squad.bench.legacy` there in a subprocess whose
  ``squad`` is the old package; returns its recordings. Everything runs on the meta device: about ten seconds.
- `calibration_rows`: the rows `tools/bench.py --only traffic` adds: the kernel model's (`costmodel.KernelModel`,
  what the traffic table prices with) central figure / measured for every case, its low and high in the details;
  one "skipped" row where git or the commit is not at hand.
- `fit_report`: ``tools/bench.py --fit-traffic``: refits the fitted model's constants and reports both fits'
  residuals (what ``reports/bench/traffic_fit.json`` holds and `costmodel.FITTED` copies), and the kernel model's
  low / central / high against each measured figure.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from squad.timing import BenchResult

from . import costmodel
from .traffic import OpRecord, record_from_dict

COMMIT = "84de653"  # what shared/gpu/MEASURED.md measured
REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = Path(__file__).resolve().parent


class CalibrationUnavailable(RuntimeError):
    """The measured commit cannot be recorded here (no git, no history, or the recording failed)."""


def _git(*args: str, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise CalibrationUnavailable("git is not installed")
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, **kwargs)


def extract_commit(commit: str, dest: Path) -> Path:
    """``git archive`` of ``commit`` into ``dest``, arranged as the package installs (squad/tasks, squad/kernels,
    squad/configs linked to the top-level folders). Returns ``dest``."""
    found = _git("cat-file", "-e", f"{commit}^{{commit}}")
    if found.returncode != 0:
        raise CalibrationUnavailable(f"commit {commit} is not in the repository at {REPO} (a shallow clone?)")
    archive = _git("archive", "--format=tar", commit)
    if archive.returncode != 0:
        raise CalibrationUnavailable(f"git archive {commit} failed: {archive.stderr.decode()[-300:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    for name in ("tasks", "kernels", "configs"):
        link = dest / "squad" / name
        if (dest / name).is_dir() and not link.exists():
            link.symlink_to(Path("..") / name)
    return dest


def record_commit(commit: str = COMMIT, timeout: float = 600.0) -> dict[str, list[OpRecord]]:
    """Every calibration case recorded on ``commit``'s code (`squad.bench.legacy`), by case name."""
    with tempfile.TemporaryDirectory(prefix=f"squad-{commit}-") as tmp:
        tree = Path(tmp) / "tree"
        tree.mkdir()
        extract_commit(commit, tree)
        out = Path(tmp) / "records.json"
        env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run([sys.executable, str(BENCH_DIR / "legacy.py"), "--bench", str(BENCH_DIR),
                               "--out", str(out)], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise CalibrationUnavailable(f"recording {commit} failed:\n{proc.stderr[-2000:]}")
        data = json.loads(out.read_text())
    return {case: [record_from_dict(r) for r in records] for case, records in data.items()}


@functools.cache
def _cached(commit: str) -> dict[str, list[OpRecord]]:
    return record_commit(commit)


def calibration_rows(commit: str = COMMIT) -> list[BenchResult]:
    """The kernel model's central figure / measured for every measured case (informational rows, unit ``x measured
    (H100 model)``; ``details`` has low, central and high)."""
    try:
        recordings = _cached(commit)
    except (CalibrationUnavailable, OSError, subprocess.SubprocessError) as e:
        return [BenchResult("traffic_model_calibration", math.nan, "", "skipped", None, {"reason": str(e)})]
    rows = []
    for r in costmodel.kernel_residual_rows(recordings):
        rows.append(BenchResult(f"traffic_calibration_{r['name']}", r["modelled"] / r["measured"], "",
                                "x measured (H100 model)", None, {**r, "commit": commit}))
    return rows


def fit_report(commit: str = COMMIT) -> dict:
    """Refits the constants to ``commit``'s recordings: the fitted constants, their residuals, the residuals of the
    stored constants (`costmodel.FITTED`) and the counts of every recorded case (JSON-ready)."""
    recordings = record_commit(commit)
    fitted = costmodel.fit(recordings)
    from .traffic import Traffic

    return {"commit": commit, "measured": "shared/gpu/MEASURED.md (one H100 80GB HBM3, bf16)",
            "model": costmodel.__doc__.split("\n\n")[2], "fitted": fitted.as_dict(),
            "residuals": costmodel.residual_rows(fitted, recordings),
            "stored": costmodel.FITTED.as_dict(),
            "stored_residuals": costmodel.residual_rows(costmodel.FITTED, recordings),
            "kernel_model": costmodel.KernelModel.at().as_dict(),
            "kernel_model_residuals": costmodel.kernel_residual_rows(recordings),
            "cases": {name: Traffic(recs).totals() for name, recs in recordings.items()}}


def format_fit(report: dict) -> str:
    """The fit as text: constants, then measured / modelled / error per case."""
    lines = [f"fitted to {report['commit']}: " + costmodel.CostModel(**report["fitted"]).describe()]
    head = f"{'measured case':<30}{'unit':>6}{'measured':>10}{'modelled':>10}{'error':>8}"
    lines += [head, "-" * len(head)]
    for r in report["residuals"]:
        lines.append(f"{r['name']:<30}{r['unit']:>6}{r['measured']:>10.2f}{r['modelled']:>10.2f}"
                     f"{r['error'] * 100:>7.1f}%")
    if "kernel_model_residuals" in report:
        lines.append("")
        lines.append("the kernel model (what the traffic table prices with; not fitted): low / central / high")
        head = (f"{'measured case':<30}{'unit':>6}{'measured':>10}{'low':>9}{'central':>9}{'high':>9}{'error':>8}"
                "  inside")
        lines += [head, "-" * len(head)]
        for r in report["kernel_model_residuals"]:
            lines.append(f"{r['name']:<30}{r['unit']:>6}{r['measured']:>10.2f}{r['low']:>9.2f}{r['modelled']:>9.2f}"
                         f"{r['high']:>9.2f}{r['error'] * 100:>7.1f}%  {'yes' if r['inside'] else 'no'}")
    return "\n".join(lines)
