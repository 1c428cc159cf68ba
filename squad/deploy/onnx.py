"""A squad model as an ONNX file, for runtimes outside PyTorch (ONNX Runtime, TensorRT), checked in ONNX Runtime.

    from squad.deploy.onnx import export_onnx, check_onnx
    export_onnx(squad.load("runs/demo"), "demo.onnx")             # the dynamo exporter (torch.onnx.export(dynamo=True))
    diffs = check_onnx("demo.onnx", model, images)                 # task → max |ONNX Runtime − squad|

    # anywhere with ONNX Runtime (no PyTorch, no squad):
    session = onnxruntime.InferenceSession("demo.onnx")
    depth, normal, scene = session.run(None, {"images": images})   # one output per task, named after it

The graph is what the ``.pt2`` export traces (`squad.deploy.export.ExportedSquad`: images → {task: prediction}, the
model's own routing), on the CPU in float32, with the batch size dynamic (input ``images`` ``[batch, C, S, S]``) and
one output per task named after it. Every layer kind the ``.pt2`` export takes is expressed (dense, MoE MLP, MoE
attention, MoD top-k with learned or attention routing, MoNE at the capacity set on the model): the CPU path of the
routed layers is plain ATen (the Triton kernels are CUDA-only and never traced). Two ATen ops the routed layers use
have no ONNX translation in torch's library, and get one here (`TRANSLATIONS`):

- ``aten.sort.stable`` (tokens grouped by expert, token order kept in a group): ONNX's TopK is not stable, so the
  keys are made unique first (key · n + position, in int64) and sorted ascending with TopK over all n;
- ``aten.searchsorted`` (each expert's first row in the sorted order): a count of the entries below each value
  (``ReduceSum(Less(sorted, value))``), O(n · values) — values are the E + 1 group boundaries.

Refused, with `squad.deploy.export.ExportError` naming the layer: MoD threshold inference (as for ``.pt2``), and
bfloat16 (ONNX Runtime's CPU kernels run float32).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from squad.deploy.export import ExportedSquad, ExportError, _exportable, _inner, _refusal
from squad.io.files import atomic_write_bytes

__all__ = ["TRANSLATIONS", "check_onnx", "export_onnx"]

INPUT = "images"
OPSET = 18
OPTIMIZE = True  # onnxscript's graph optimiser (constant folding, dead nodes): smaller graphs, slower export


def _sort_stable(self, stable=None, dim: int = -1, descending: bool = False):
    """aten.sort.stable of an integer tensor along its last axis, stable: TopK over unique keys."""
    from onnxscript import opset18 as op

    if dim not in (-1, 0):  # the routed layers sort flat 1-D index vectors
        raise ExportError(f"ONNX export sorts 1-D tensors only (aten.sort.stable dim={dim})")
    n = op.Shape(self, start=-1)  # [1]
    pos = op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1))  # [n]
    key = op.Cast(self, to=7)  # int64
    key = op.Add(op.Mul(op.Neg(key) if descending else key, n), pos)  # unique, in (value, position) order
    _, order = op.TopK(key, n, axis=-1, largest=0, sorted=1)
    return op.GatherElements(self, order, axis=-1), order


def _searchsorted(sorted_sequence, self, out_int32: bool = False, right: bool = False, side=None, sorter=None):
    """aten.searchsorted of a 1-D sorted sequence: per value, the entries below it (≤ with ``right``)."""
    from onnxscript import opset18 as op

    if sorter is not None:
        raise ExportError("ONNX export: aten.searchsorted with a sorter is not expressed")
    v = op.Unsqueeze(self, op.Constant(value_ints=[-1]))  # [..., 1] against the [n] sequence
    below = op.LessOrEqual(sorted_sequence, v) if right or side == "right" else op.Less(sorted_sequence, v)
    return op.ReduceSum(op.Cast(below, to=6 if out_int32 else 7), op.Constant(value_ints=[-1]), keepdims=0)


TRANSLATIONS: dict[Any, Any] = {torch.ops.aten.sort.stable: _sort_stable,
                                torch.ops.aten.searchsorted.Tensor: _searchsorted}


def export_onnx(model: nn.Module, path: str | Path | None = None, tasks: Sequence[str] | None = None, *,
                example_batch: int = 2) -> bytes:
    """Exports ``model`` as ONNX with torch's dynamo exporter (float32, CPU, batch dynamic).

    Args:
        model: a `SquadViT` or extracted `SingleTaskModel` (moved to the CPU in float32 and set to eval mode, in
            place; set MoNE's capacity / MoD's inference mode before: `squad.models.inference.set_inference`).
        path: the file to write atomically (None: only return the bytes).
        tasks: tasks it predicts (default: all of the model's, or the extracted task).
        example_batch: the batch size traced with (≥ 2).

    Returns:
        The ONNX file's bytes (one input ``images`` [batch, C, S, S]; one output per task, named after it).

    Raises:
        ExportError: not a squad model, an unknown task, a layer the export cannot express (named), or the
            exporter failing (its error, summarised with the model's routed layer kinds).
    """
    inner, names = _exportable(model, tasks)
    why = _refusal(inner)
    if why is not None:
        raise ExportError(f"cannot export to ONNX: {why}")
    try:
        import onnx
        import onnxscript  # noqa: F401 - the dynamo exporter's translation library
    except ImportError as e:
        raise ExportError(f"ONNX export needs onnx and onnxscript ({e}): pip install 'squad[onnx]'") from None
    if example_batch < 2:
        raise ExportError(f"example_batch must be >= 2 (a traced size of 0 or 1 is fixed), got {example_batch}")
    inner.to(device="cpu", dtype=torch.float32).eval()
    wrapper = ExportedSquad(inner, names).eval()
    cfg = inner.cfg
    example = torch.randn(example_batch, cfg.in_chans, cfg.img_size, cfg.img_size,
                          generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            program = torch.onnx.export(wrapper, (example,), dynamo=True, input_names=[INPUT], output_names=names,
                                         dynamic_shapes=({0: torch.export.Dim("batch", min=1)},), opset_version=OPSET,
                                         custom_translation_table=TRANSLATIONS, verbose=False, optimize=OPTIMIZE)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - the exporter raises many kinds; say which model failed and where
        text = str(e)
        first = next((ln.strip() for ln in text.splitlines() if "No ONNX function" in ln or "Error" in ln),
                     text.strip().splitlines()[0] if text.strip() else type(e).__name__)
        kinds = sorted({type(m).__name__ for m in inner.modules() if getattr(m, "kind", None)})
        raise ExportError(f"ONNX export of {cfg.name or 'this model'} failed (routed layers: "
                          f"{', '.join(kinds) or 'none'}): {type(e).__name__}: {first[:500]}") from e
    buf = io.BytesIO()
    program.model_proto.producer_name = "squad"
    onnx.save_model(program.model_proto, buf)
    data = buf.getvalue()
    if path is not None:
        atomic_write_bytes(path, data, "the ONNX model")
    return data


def check_onnx(source: str | Path | bytes, model: nn.Module, images: torch.Tensor) -> dict[str, float]:
    """Max |ONNX Runtime − squad| per task on ``images``: the file run in ONNX Runtime's CPU provider against
    ``model(images, tasks).preds``.

    Raises:
        ValueError: an output of the file that the model does not have.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only (not the optimiser's notes on nodes it leaves unfolded)
    session = ort.InferenceSession(source if isinstance(source, bytes) else str(source), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = session.run(None, {session.get_inputs()[0].name: images.detach().float().cpu().numpy()})
    inner, _ = _inner(model)
    with torch.no_grad():
        want = inner(images.float(), names).preds
    return {t: float(np.abs(g - want[t].numpy()).max()) for t, g in zip(names, got, strict=True)}
