"""A squad model as a `torch.export` program: one ``.pt2`` file that runs with PyTorch alone, without squad.

    from squad.deploy.export import export_program, save_program
    program = export_program(squad.load("depth.pt"))          # an extracted model, a run folder, model.pt, a tag
    save_program(program, "depth.pt2")

    # anywhere with PyTorch (no squad):
    net = torch.export.load("depth.pt2").module()
    preds = net(images)                                        # images [B, 3, S, S] float32 → {task: prediction}

The program's signature:

- input: one float32 image batch ``[B, C, S, S]`` on the CPU, normalised as squad's data pipeline does (the
  model's ``img_size`` S and ``in_chans`` C are fixed; the batch size B is dynamic, any B ≥ 1);
- output: a dict task name → prediction, exactly what ``model(images, tasks).preds`` gives: ``[B, C_t, S, S]`` for
  dense tasks, ``[B, C_t]`` logits for class tasks. An extracted model gives its one task.

Every layer kind squad builds exports, so every paper config does: dense, Mixture-of-Depths (learned and attention
routing with top-k inference; A-MoD's scores come from the pure-PyTorch attention, `squad.kernels.reference`: the
Triton kernels are CUDA kernels for training and are never traced), MoE MLP and MoE attention (token-choice routing:
the program groups each input's tokens by expert with data-dependent group sizes, `squad.layers.experts`), and MoNE
at the capacity it is exported with. The routing inside the program is the model's own: the outputs equal squad's
(`check_program` measures the difference; the tests hold it to 1e-5).

Refused, with `ExportError` (a `ValueError`: tools/export.py exits 2) naming the layer and what to do:

- MoD threshold inference (``--mod-inference threshold``): how many tokens a block processes is counted per batch
  and a block that keeps none returns early, a host-side branch on data a program cannot hold; export with top-k
  inference (the default) instead.
- anything else torch.export fails on (the error is summarised with the model's routed layer kinds).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from squad.io.files import atomic_write_bytes
from squad.layers.mod import MoDBlock
from squad.models.single_task import SingleTaskModel
from squad.models.vit import SquadViT

__all__ = ["ExportError", "ExportedSquad", "check_program", "export_program", "load_program", "program_bytes",
           "program_info", "save_program"]

FORMAT = "squad.export/1"  # the .pt2's extra file ``squad.json`` records it with the tasks and input shape


class ExportError(ValueError):
    """A model (or a setting) that cannot become a torch.export program; the message says why and what to do."""


class ExportedSquad(nn.Module):
    """The module torch.export traces: images → {task: prediction}, the model's own forward pass for fixed tasks.

    It lays the rows out as `SquadViT.forward` does for "every image runs every task" (task-major task rows, one
    segment per task, fanned out from the images at the first task-specific block), with the batch size kept
    symbolic: the eager forward reads host lengths that would fix it.

    Args:
        model: the `SquadViT` (an extracted model's inner model).
        tasks: canonical task names, each once.
    """

    def __init__(self, model: SquadViT, tasks: Sequence[str]):
        super().__init__()
        self.model = model
        self.tasks = list(tasks)
        self.task_ids = model.task_index(self.tasks)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """images [B, C, S, S] → {task: prediction}."""
        model = self.model
        x0 = model.embed(images)
        b = x0.shape[0]
        t = len(self.tasks)
        rows = None if t == 1 else torch.arange(b, device=x0.device).repeat(t)  # task row i·B + j reads image j
        ids = torch.cat([torch.full((b,), task, dtype=torch.long, device=x0.device) for task in self.task_ids])
        segments = [(task, i * b, (i + 1) * b) for i, task in enumerate(self.task_ids)]
        tokens, ctx = model.forward_tokens(x0, ids, segments, rows)
        if ctx.shared_rows is not None:  # no task-specific block: every head reads the image rows
            return {name: model.heads[name](tokens) for name in self.tasks}
        return {name: model.heads[name](tokens[i * b : (i + 1) * b]) for i, name in enumerate(self.tasks)}


def _inner(model: nn.Module) -> tuple[SquadViT, list[str]]:
    """The `SquadViT` inside ``model`` and the tasks it exports by default."""
    if isinstance(model, SingleTaskModel):
        return model.model, [model.task]
    if isinstance(model, SquadViT):
        return model, list(model.task_names)
    raise ExportError(f"export takes a squad model (SquadViT or an extracted SingleTaskModel), got "
                      f"{type(model).__name__}")


def _exportable(model: nn.Module, tasks: Sequence[str] | None) -> tuple[SquadViT, list[str]]:
    """The SquadViT inside ``model`` and the task names an export of it returns (each once; default: its tasks).

    Raises:
        ExportError: not a squad model, a task it does not predict, or a task named twice.
    """
    inner, default = _inner(model)
    try:
        names = [inner.task_names[i] for i in inner.task_index(list(tasks) if tasks else default)]
    except ValueError as e:
        if isinstance(model, SingleTaskModel):
            raise ExportError(f"this extracted model predicts {model.task} only ({e})") from None
        raise ExportError(str(e)) from None
    if len(set(names)) != len(names):
        raise ExportError(f"tasks {list(tasks or [])} name a task twice: list each task once")
    return inner, names


def _refusal(model: SquadViT) -> str | None:
    """Why ``model`` cannot be exported as it is set up, with what to do; None when it can."""
    for name, module in model.named_modules():
        if isinstance(module, MoDBlock) and module.router is not None and module.cfg.inference == "threshold":
            return (f"{name} (a Mixture-of-Depths block) runs threshold inference: the tokens it processes are "
                    f"counted on the host per batch (a data-dependent width torch.export cannot hold); export with "
                    f"top-k inference instead (--mod-inference topk: k = ceil(C·N) tokens per image)")
    return None


def export_program(model: nn.Module, tasks: Sequence[str] | None = None, *, dynamic_batch: bool = True,
                   example_batch: int = 2, dtype: torch.dtype = torch.float32) -> torch.export.ExportedProgram:
    """Traces a squad model into a `torch.export.ExportedProgram` (on the CPU, eval mode, in ``dtype``).

    Args:
        model: a `SquadViT` (full model: ``squad.load`` of a run folder, model.pt or checkpoint tag) or an extracted
            `SingleTaskModel` (``squad.load_extracted``). It is moved to the CPU in ``dtype`` and set to eval mode
            (in place); set MoNE's capacity / MoD's inference mode before (`squad.models.inference.set_inference`).
        tasks: tasks the program predicts (names or aliases; default: all of the model's, or the extracted task).
        dynamic_batch: a symbolic batch size (any B ≥ 1); False fixes B = ``example_batch``.
        example_batch: the batch size traced with (≥ 2: torch.export fixes sizes traced at 0 or 1).
        dtype: float32 (default) or bfloat16 (``--precision bf16``): the weights' dtype and the images' the program
            takes.

    Returns:
        The program: ``program.module()(images)`` → {task: prediction}.

    Raises:
        ExportError: not a squad model, an unknown task, a setting that cannot be exported (the message names the
            layer and what to do), or torch.export failing on the model (its error, summarised).
    """
    inner, names = _exportable(model, tasks)
    why = _refusal(inner)
    if why is not None:
        raise ExportError(f"cannot export: {why}")
    if example_batch < 2:
        raise ExportError(f"example_batch must be >= 2 (torch.export fixes a traced size of 0 or 1), got "
                          f"{example_batch}")
    inner.to(device="cpu", dtype=dtype).eval()
    wrapper = ExportedSquad(inner, names).eval()
    cfg = inner.cfg
    example = torch.randn(example_batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=torch.Generator()
                          .manual_seed(0)).to(dtype)
    shapes = ({0: torch.export.Dim("batch", min=1)},) if dynamic_batch else None
    try:
        with torch.no_grad():
            return torch.export.export(wrapper, (example,), dynamic_shapes=shapes, strict=False)
    except Exception as e:  # noqa: BLE001 - torch.export's errors are many kinds; say which model failed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        kinds = sorted({type(m).__name__ for m in inner.modules() if getattr(m, "kind", None)})
        raise ExportError(f"torch.export could not trace {cfg.name or 'this model'} (routed layers: "
                          f"{', '.join(kinds) or 'none'}): {type(e).__name__}: {first}") from e


def program_bytes(program: torch.export.ExportedProgram) -> bytes:
    """The ``.pt2`` file of ``program`` (`torch.export.save` into memory), with ``squad.json`` (`program_info`)."""
    buf = io.BytesIO()
    torch.export.save(program, buf, extra_files={"squad.json": json.dumps(program_info(program))})
    return buf.getvalue()


def save_program(program: torch.export.ExportedProgram, path: str | Path) -> Path:
    """Writes ``program`` as a ``.pt2`` file, atomically (`squad.io.files.atomic_write_bytes`), its folder created.

    The file also holds ``squad.json`` (`program_info`: format, tasks, input shape), readable without squad with
    ``torch.export.load(path, extra_files={"squad.json": ""})``. It is serialised in memory first: torch's zip writer
    aborts the process when the disk fills under it.

    Returns:
        ``path``.

    Raises:
        squad.io.files.WriteError: the file could not be written (a full disk: the message names the path and the
            free space; no partial file is left).
    """
    return atomic_write_bytes(path, program_bytes(program), "the exported program")


def program_info(program: torch.export.ExportedProgram) -> dict:
    """What a program `export_program` made takes and gives.

    Returns:
        ``{"format": "squad.export/1", "tasks": [...], "input": ["B", C, S, S], "dtype": "float32"}`` (``"B"`` when
        the batch size is symbolic, else the fixed one).
    """
    (images,) = program.example_inputs[0]
    batch = images.shape[0]
    dynamic = not isinstance(program.graph_module.graph.find_nodes(op="placeholder")[-1].meta["val"].shape[0], int)
    return {"format": FORMAT, "tasks": list(program.call_spec.out_spec.context),
            "input": ["B" if dynamic else batch, *images.shape[1:]], "dtype": str(images.dtype).removeprefix("torch.")}


def load_program(path: str | Path | bytes) -> nn.Module:
    """The callable module of a ``.pt2`` file (`torch.export.load(path).module()`): images → {task: prediction}.

    Args:
        path: the file, or its bytes (`program_bytes`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a torch.export program.
    """
    if isinstance(path, bytes):
        source: Any = io.BytesIO(path)
        path = "<program bytes>"
    else:
        path = source = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"exported program not found: {path}")
    try:
        return torch.export.load(source).module()
    except Exception as e:  # noqa: BLE001 - a zip that is not an ExportedProgram, a truncated file, ...
        raise ValueError(f"{path}: not a torch.export program ({type(e).__name__}: {e})") from e


@torch.no_grad()
def check_program(program: torch.export.ExportedProgram | nn.Module, model: nn.Module, images: torch.Tensor,
                  tasks: Sequence[str] | None = None) -> dict[str, float]:
    """Max |exported − squad| per task on ``images`` (the model's own ``model(images, tasks).preds``).

    Returns:
        task → max absolute difference.
    """
    inner, default = _inner(model)
    names = [inner.task_names[i] for i in inner.task_index(list(tasks) if tasks else default)]
    run = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    got = run(images)
    want = inner(images, names).preds
    return {t: float((got[t] - want[t]).abs().max()) for t in names}
