"""Which backend a routed op takes at a shape: the choice a GPU measured, read by every run on that kind of GPU.

Two routed ops have two backends each on the CUDA path (`squad.kernels.device.cuda_path`):

- ``moe_mlp`` (the MoE MLP's expert GEMMs, config key ``model.moe.kernel``): ``grouped_mm``, the library's grouped
  GEMM (`torch.nn.functional.grouped_mm`) on tokens permuted into expert order and back, or ``triton``, squad's
  ScatterMoE-style kernels (`squad.kernels.grouped`) that gather and scatter rows themselves;
- ``mone`` (MoNE's nested projections at inference, config key ``model.mone.kernel``): ``cublas``, one matmul per
  width slice, or ``triton``, the nested kernels (`squad.kernels.nested`);
- ``moa`` (MoE attention's query and output projections, config key ``model.moa.kernel``), three: ``cublas``, the
  dense all-head form on plain GEMMs with gathers, ``heads``, the same form on squad's Triton head kernels
  (`squad.kernels.heads`), or ``routed``, grouped GEMMs over the expert-sorted (token, slot) rows
  (`squad.layers.experts.heads`, `squad.layers.moe_attention`).

A layer whose key says ``auto`` takes the backend measured faster at its shape on the GPU it runs on, and until a
GPU has measured that shape the library's backend (``grouped_mm``, ``cublas``) — for ``moa`` the form a cost model
prices lower (``cublas`` for the dense form: `squad.layers.moe_attention.projection_costs`). ``make gpu-check``
times every backend at the shipped configs' shapes and records the winner here (`record`).

The choice file is JSON at `choices_path`: ``$SQUAD_KERNEL_CHOICES`` when set, else
``$XDG_CACHE_HOME/squad/kernel_choices.json`` (``~/.cache/squad/kernel_choices.json``) — per user and machine image,
like Triton's and inductor's caches, so a cluster's nodes that share a home directory share one measurement::

    {"version": 1,
     "devices": {"NVIDIA H100 80GB HBM3": {
         "moe_mlp|E16,D768,H192,k4|bfloat16": {"backend": "grouped_mm",
                                               "ms": {"grouped_mm": 1.9, "triton": 3.1}, "measured": "2026-…"}}}}

A shape key is the op, its widths (`shape_key`) and the dtype; a run looks its shapes up by the name torch gives its
GPU. A shape the file does not hold takes what a GPU of the same name measured in a committed ``make gpu-check``
(`SHIPPED`: the winners of its kernels stage, kept beside the report), and only then the library's backend. Reading
the file happens once per process and (op, shape, device) and never inside a compiled graph: `torch.compile` takes
the answer as a constant.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path

import torch

from squad.lazy import constant_result

BACKENDS = {"moe_mlp": ("grouped_mm", "triton"), "mone": ("cublas", "triton"), "moa": ("cublas", "heads", "routed")}
LIBRARY = {"moe_mlp": "grouped_mm", "mone": "cublas", "moa": "cublas"}  # ``auto``'s backend until a GPU has measured
ENV = "SQUAD_KERNEL_CHOICES"
VERSION = 1
# The winners of committed `make gpu-check` runs, by the GPU's name and shape key: what ``auto`` takes on a GPU of that
# name until the machine has measured its own (its choice file wins). reports/bench/gpu_check_h200/gpu_check.json's
# kernels stage (one NVIDIA H200, commit 6c5250c; tests/test_kernel_choice.py checks this table against it):
# grouped_mm 3.92 / 5.59 / 2.41 ms against triton 8.44 / 13.06 / 3.98 ms for the MoE MLPs, the nested Triton kernels
# 10.97 ms against the width slices' 17.02 ms for mone_vit_s inference.
SHIPPED = {
    "NVIDIA H200": {
        "moe_mlp|E16,D768,H768,k4|bfloat16": "grouped_mm",
        "moe_mlp|E64,D1024,H2048,k2|bfloat16": "grouped_mm",
        "moe_mlp|E16,D384,H384,k4|bfloat16": "grouped_mm",
        "mone|D384,H1536,heads6|bfloat16": "triton",
    },
}


def choices_path() -> Path:
    """Where the measured choices live: ``$SQUAD_KERNEL_CHOICES``, else the user's cache folder."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "squad" / "kernel_choices.json"


def shape_key(op: str, dims: dict[str, int], dtype: torch.dtype) -> str:
    """The key of ``op`` at widths ``dims`` (e.g. ``{"E": 16, "D": 768, "H": 192, "k": 4}``) in ``dtype``."""
    if op not in BACKENDS:
        raise ValueError(f"unknown routed op {op!r}; known: {sorted(BACKENDS)}")
    return f"{op}|{','.join(f'{k}{v}' for k, v in dims.items())}|{str(dtype).removeprefix('torch.')}"


def load_choices(path: Path | None = None) -> dict:
    """The choice file as a dict (``{"version": 1, "devices": {}}`` when there is none).

    Raises:
        ValueError: the file exists but is not a choice file (names the path).
    """
    path = choices_path() if path is None else Path(path)
    if not path.exists():
        return {"version": VERSION, "devices": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a kernel choice file ({e}); delete it or rerun `make gpu-check`") from e
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{path}: not a version-{VERSION} kernel choice file; delete it or rerun `make gpu-check`")
    return data


@functools.cache
def _measured(path: str, device_name: str, key: str) -> str | None:
    entry = load_choices(Path(path))["devices"].get(device_name, {}).get(key)
    backend = entry.get("backend") if isinstance(entry, dict) else None
    if backend is None:  # this machine has not measured the shape: what a GPU of its name measured (`SHIPPED`)
        backend = SHIPPED.get(device_name, {}).get(key)
    op = key.split("|", 1)[0]
    return backend if backend in BACKENDS.get(op, ()) else None


def device_name(device: torch.device) -> str | None:
    """The name torch gives the GPU ``device`` is on; None off CUDA (nothing is measured there)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


@constant_result
def measured_backend(key: str, device_type: str, device_index: int) -> str | None:
    """The backend a GPU of this kind measured faster at ``key`` (`shape_key`), or None if none has."""
    index = None if device_index < 0 else device_index
    name = device_name(torch.device(device_type, index))
    return None if name is None else _measured(str(choices_path()), name, key)


def resolve(op: str, requested: str, dims: dict[str, int], dtype: torch.dtype, device: torch.device,
            library_runs: bool = True, unmeasured: str | None = None) -> str:
    """The backend ``op`` takes: ``requested`` unless it is ``auto``; for ``auto`` the measured choice at this shape
    on this GPU, else ``unmeasured`` when given (a cost model's pick), else the library's backend — or ``triton``
    where the library op cannot take the operands (``library_runs`` False, e.g. float32 `grouped_mm` on CUDA)."""
    if requested != "auto":
        return requested
    device = torch.device(device)
    found = measured_backend(shape_key(op, dims, dtype), device.type, -1 if device.index is None else device.index)
    if found is not None:
        return found
    if unmeasured is not None:
        return unmeasured
    return LIBRARY[op] if library_runs else "triton"


def record(op: str, dims: dict[str, int], dtype: torch.dtype, device_name: str, times_ms: dict[str, float],
           path: Path | None = None) -> str:
    """Writes the faster backend of ``times_ms`` (milliseconds per backend, same work) for this shape and GPU into
    the choice file (other entries kept; written atomically) and returns it."""
    unknown = set(times_ms) - set(BACKENDS[op])
    if unknown or not times_ms:
        raise ValueError(f"{op}: times for {sorted(times_ms)}, expected some of {BACKENDS[op]}")
    path = choices_path() if path is None else Path(path)
    data = load_choices(path)
    best = min(times_ms, key=times_ms.get)
    data["devices"].setdefault(device_name, {})[shape_key(op, dims, dtype)] = {
        "backend": best, "ms": {k: round(v, 4) for k, v in times_ms.items()},
        "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    _measured.cache_clear()
    return best
