"""Running any squad model on image files: readable pictures and raw values per task (the library of tools/predict.py).

    from squad.deploy.predict import predict
    summary = predict(squad.load("runs/demo"), ["photos/"], "predictions", PredictConfig(tasks=["depth", "normal"]))

Models: whatever `squad.load` opens — a run folder, ``model.pt``, a DeepSpeed checkpoint tag, an extracted
single-task file (tools/extract.py), an adapted MoD/A-MoD model (tools/adapt_pretrained.py) — or a model in memory
(a `SquadViT` or `SingleTaskModel`). MoNE's e_c and MoD's inference mode are set as tools/evaluate.py sets them
(`squad.models.inference.set_inference`).

Images (`list_images`, `load_image`): JPEG and PNG files (any other format Pillow opens works when the file is named
directly; a folder is scanned, not recursively, for ``.jpg``, ``.jpeg`` and ``.png`` in sorted order). Any size and
mode: grey and palette images become RGB, an alpha channel is dropped (as the data reader drops it), 16-bit images
are scaled to 8 bits (÷ 257), a JPEG's EXIF orientation is applied. Each image is **centre-cropped to a square and
resized**, never tiled: the centred square of side min(H, W), resized to the model's ``img_size`` with the
antialiased bilinear resize the evaluation pipeline uses (`squad.data.transforms.resize_raw`), then scaled to
[0, 1]. A square image is thus exactly the input tools/evaluate.py gives the model (`SamplePipeline` without
augmentation). Outputs are at the model's ``img_size``; the crop box in the original pixels is in the summary, so
a prediction can be put back on the photo: upsample the ``.npy`` onto that box (e.g. ``F.interpolate``, nearest for
segment ids). For the whole of a wide image, cut it into squares first and predict each.

A file that cannot be read (corrupt, truncated, not an image, too large for Pillow) is reported — logged, and listed
under ``"skipped"`` with the reason — and the run goes on.

Outputs, per image, in ``OUT/<image stem>/`` (``<stem>_2``, ``_3``, ... when two inputs share a stem):

* ``<task>.png`` — the picture a person reads (`squad.deploy.pictures`) for dense tasks; ``<task>.json`` — the
  top-5 classes (index, probability, and the name when class names were given) for class tasks;
* raw values, ``encode="npy"``: ``<task>.npy``, ``float32 [C, H, W]`` in task units (``Task.to_units``: metres,
  unit normals, ...; class tasks: the probability vector ``[C]``);
  ``encode="taskonomy"``: ``<task>_taskonomy.png``, the dataset's own encoding (`squad.deploy.encode`; 16-bit depth
  in 1/512 m ...); class tasks keep ``<task>.npy``, which is Taskonomy's own format for them. A head outside
  Taskonomy (e.g. a timm classifier) has no task units: its ``.npy`` holds the head's raw output.

and ``OUT/predictions.json``, the summary `predict` returns: the checkpoint, tasks, preprocessing, inference
settings, device, and per image its path, output folder, original size, crop box and files (class tasks' top-5
too), then the skipped files with their reasons.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
from PIL import Image, ImageOps, UnidentifiedImageError

from squad.config.tools import PredictConfig
from squad.data.transforms import decode_rgb, resize_raw
from squad.deploy.encode import encode_taskonomy, has_taskonomy_encoding
from squad.deploy.pictures import picture, save_png, top_k
from squad.io.files import atomic_save, atomic_write_text, check_writable, sync_tree
from squad.layers.heads import DenseHead
from squad.models.compile import compile_model
from squad.models.inference import inference_settings, set_inference
from squad.models.precision import cast_model, precision_name
from squad.models.single_task import SingleTaskModel
from squad.models.vit import SquadViT
from squad.tasks import Task, TaskOptions, get_task

log = logging.getLogger("squad.predict")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
SUMMARY = "predictions.json"
Encoding = Literal["npy", "taskonomy"]

_READ_ERRORS = (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error, Image.DecompressionBombError)


class UnreadableImageError(ValueError):
    """An image file Pillow cannot decode (corrupt, truncated, not an image) or an image mode it cannot convert."""


# ---------------------------------------------------------------------------------------------------------- images
def list_images(inputs: str | Path | Iterable[str | Path]) -> list[Path]:
    """The image files named by ``inputs``: files as given, folders scanned (not recursively) for image extensions.

    Args:
        inputs: files and folders; a folder contributes its ``.jpg``/``.jpeg``/``.png`` files (any case), sorted by
            name; a named file is taken whatever its extension (and reported later if it is no image).

    Returns:
        The files, each once, in the order given.

    Raises:
        FileNotFoundError: an input does not exist.
        ValueError: no image files at all.
    """
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    out: dict[Path, None] = {}
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            for f in sorted(p.iterdir()):
                if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS:
                    out[f] = None
        elif p.exists():
            out[p] = None
        else:
            raise FileNotFoundError(f"image path not found: {p}")
    if not out:
        raise ValueError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) in {', '.join(str(i) for i in inputs)}")
    return list(out)


def _rgb8(im: Image.Image) -> np.ndarray:
    """A Pillow image of any mode → ``uint8 [H, W, 3]``."""
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):  # 16-bit PNGs (Pillow may open them as 32-bit "I")
        a = np.asarray(im).astype(np.float64)
        grey8 = np.clip(np.round(a / 257.0), 0, 255).astype(np.uint8)
        return np.repeat(grey8[:, :, None], 3, axis=2)
    if im.mode == "F":
        raise UnreadableImageError("floating-point images are not supported (save it as an 8- or 16-bit image)")
    return np.array(im.convert("RGB"))  # grey, palette, RGBA (alpha dropped), CMYK, YCbCr, 1-bit


def center_box(height: int, width: int) -> tuple[int, int, int]:
    """``(top, left, side)``: the centred square of side min(H, W) — the crop `load_image` takes."""
    side = min(height, width)
    return (height - side) // 2, (width - side) // 2, side


def load_image(path: str | Path, size: int) -> tuple[torch.Tensor, dict]:
    """Reads one image and prepares it as the model's input (see the module docstring).

    Args:
        path: a JPEG / PNG (or any file Pillow opens).
        size: the model's ``img_size``.

    Returns:
        ``(image, info)``: ``float32 [3, size, size]`` in [0, 1], and ``{"size": [H, W], "crop": [top, left, side],
        "mode": Pillow mode}`` in the original's pixels (after EXIF orientation).

    Raises:
        UnreadableImageError: the file cannot be decoded (the message says why).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            try:
                im = ImageOps.exif_transpose(im)
            except _READ_ERRORS:  # a broken EXIF block: keep the pixels as stored
                pass
            raw = _rgb8(im)
    except FileNotFoundError:
        raise
    except UnidentifiedImageError:
        raise UnreadableImageError("not an image Pillow can read") from None
    except Image.DecompressionBombError as e:
        raise UnreadableImageError(f"too large: {e}") from None
    except _READ_ERRORS as e:
        raise UnreadableImageError(f"cannot decode it ({type(e).__name__}: {e})") from None
    h, w = raw.shape[:2]
    if h == 0 or w == 0:
        raise UnreadableImageError(f"empty image ({h}×{w})")
    top, left, side = center_box(h, w)
    square = raw[top: top + side, left: left + side]
    resized = resize_raw(square, (size, size), "bilinear")  # the evaluation pipeline's resize (no-op at size)
    return decode_rgb(resized), {"size": [h, w], "crop": [top, left, side], "mode": mode}


# ---------------------------------------------------------------------------------------------------------- models
def _inner(model: nn.Module) -> SquadViT:
    inner = model.model if isinstance(model, SingleTaskModel) else model
    if not isinstance(inner, SquadViT):
        raise ValueError(f"expected a squad model (SquadViT or SingleTaskModel), got {type(model).__name__}")
    return inner


def resolve_tasks(model: nn.Module, tasks: str | Iterable[str] | None) -> list[str]:
    """The model's canonical head names for ``tasks`` (names or aliases; a string may hold several, comma-separated).

    Raises:
        ValueError: a task the model does not have (the message lists the model's tasks), or an empty list.
    """
    inner = _inner(model)
    if tasks is None:
        return list(inner.task_names)
    if isinstance(tasks, str):
        tasks = [tasks]
    names = [n.strip() for t in tasks for n in str(t).split(",") if n.strip()]
    if not names:
        raise ValueError(f"no tasks given; this model has {', '.join(inner.task_names)}")
    out: list[str] = []
    for i in inner.task_index(names):
        if inner.task_names[i] not in out:
            out.append(inner.task_names[i])
    return out


def _task(name: str, options: TaskOptions | None = None) -> Task | None:
    """The registered task of a head (configured by the model's ``task_options``), or None for a head outside the
    registry (its outputs stay raw)."""
    try:
        return get_task(name, options)
    except ValueError:
        return None


def default_device() -> str:
    """``"cuda"`` when a GPU is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------------- outputs
def _out_names(paths: Sequence[Path]) -> list[str]:
    taken: set[str] = set()
    names = []
    for p in paths:
        base = p.stem or p.name
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        taken.add(name)
        names.append(name)
    return names


def _write(folder: Path, task: str, kind: str, value: np.ndarray, encode: Encoding,
           names: list[str] | None) -> tuple[dict[str, str], list[dict] | None]:
    """Writes one task's outputs for one image; returns ``{what: file name}`` and the top-5 for class heads."""
    files: dict[str, str] = {}
    spec = _task(task)
    raw = value.astype(np.float32)
    # each file whole or absent (squad.io.files); synced once, before predictions.json is written
    if kind == "dense":
        save_png(folder / f"{task}.png", picture(task, value), sync=False)
        files["picture"] = f"{task}.png"
        if encode == "taskonomy" and spec is not None and has_taskonomy_encoding(spec.name):
            save_png(folder / f"{task}_taskonomy.png", encode_taskonomy(spec.name, value), sync=False)
            files["taskonomy"] = f"{task}_taskonomy.png"
        else:
            atomic_save(folder / f"{task}.npy", lambda f: np.save(f, raw), sync=False)
            files["npy"] = f"{task}.npy"
        return files, None
    probs = value if spec is not None else _softmax(value)
    top = top_k(probs, 5, names)
    atomic_write_text(folder / f"{task}.json", json.dumps({"task": task, "top5": top}, indent=2) + "\n", sync=False)
    files["top5"] = f"{task}.json"
    atomic_save(folder / f"{task}.npy", lambda f: np.save(f, raw), sync=False)
    files["npy"] = f"{task}.npy"
    return files, top


def _softmax(logits: np.ndarray) -> np.ndarray:
    if logits.size < 2:
        return logits
    return torch.softmax(torch.from_numpy(np.asarray(logits, dtype=np.float32)), dim=-1).numpy()


def _batches(paths: Sequence[Path], batch_size: int) -> Iterator[Sequence[Path]]:
    for i in range(0, len(paths), batch_size):
        yield paths[i: i + batch_size]


# ------------------------------------------------------------------------------------------------------- predict
@torch.inference_mode()
def run_model(model: nn.Module, images: torch.Tensor, tasks: Sequence[str]) -> dict[str, torch.Tensor]:
    """One fused pass: ``{task: prediction in task units}`` (``Task.to_units``; raw outputs for non-Taskonomy heads).

    Args:
        model: a `SquadViT` or `SingleTaskModel`, on the images' device, in eval mode.
        images: ``float32 [B, 3, S, S]`` in [0, 1] (`load_image`).
        tasks: the model's canonical head names (`resolve_tasks`).
    """
    inner = _inner(model)
    dtype = next(inner.parameters()).dtype  # a model cast to bf16 / fp16 takes its inputs in that dtype
    preds = inner(images.to(dtype), list(tasks)).preds
    out = {}
    for t in tasks:
        spec = _task(t, inner.cfg.task_options)
        out[t] = spec.to_units(preds[t]) if spec is not None else preds[t].float()
    return out


def predict(model: nn.Module, images: str | Path | Iterable[str | Path], out: str | Path,
            cfg: PredictConfig | None = None, *, class_names: dict[str, list[str]] | None = None,
            progress: bool = False) -> dict:
    """Runs a model on image files and writes, per image and task, a picture and the raw values (module docstring).

    Args:
        model: a loaded model, full or extracted (`squad.load`; moved to ``cfg.device``, set to eval mode).
        images: image files and folders (`list_images`).
        out: the output folder (created).
        cfg: the tasks (names or aliases; default: every task of the model), images per forward pass, device
            (default: ``cuda`` when available, else ``cpu``), the raw values' encoding (``"npy"`` in task units or
            ``"taskonomy"``, the dataset's PNG encodings), torch.compile, and the inference settings
            (`squad.models.inference.set_inference`) — `squad.config.tools.PredictConfig`.
        class_names: ``{task: names}`` for class tasks, one name per class (shown in the top-5).
        progress: show a progress bar over the images (tqdm, on stderr).
    Returns:
        The summary written to ``out/predictions.json``: ``{"checkpoint", "tasks", "encode", "image_size",
        "preprocess", "inference", "device", "precision", "images": [{"path", "out", "size", "crop", "files", "top5"?}],
        "skipped": [{"path", "reason"}]}`` (paths in ``files`` are relative to the image's folder, ``out`` to
        ``out``).

    Raises:
        ValueError: an unknown task (listing the model's tasks), a bad setting, an encoding other than npy /
            taskonomy, class names of the wrong length, or no images.
        FileNotFoundError: a missing image path.
        PermissionError: ``out`` cannot be created or written (checked before any image is read).
        squad.io.files.WriteError: a file could not be written (a full disk): the images written before it are
            whole, the file being written is removed, and no ``predictions.json`` is written.
    """
    cfg = cfg or PredictConfig()
    cfg.check()
    checkpoint = (getattr(model, "meta", None) or {}).get("path")
    inner = _inner(model)
    set_inference(inner, **dataclasses.asdict(cfg.inference))
    names = resolve_tasks(model, cfg.tasks)
    kinds = {t: _head_kind(inner, t) for t in names}
    class_names = _check_class_names(inner, class_names or {}, names)
    paths = list_images(images)
    device = torch.device(cfg.device if cfg.device is not None else default_device())
    out = check_writable(out, "output folder", folder=True)
    dtype = cast_model(model.eval(), cfg.precision, device)
    if cfg.compile:
        compile_model(model)
    size = inner.cfg.img_size
    folders = dict(zip(paths, _out_names(paths), strict=True))
    done: list[dict] = []
    skipped: list[dict] = []
    from tqdm import tqdm

    with tqdm(total=len(paths), unit="image", disable=not progress, dynamic_ncols=True) as bar:
        for chunk in _batches(paths, cfg.batch_size):
            batch, infos = [], []
            for p in chunk:
                try:
                    image, info = load_image(p, size)
                except (UnreadableImageError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
                    reason = str(e) if isinstance(e, UnreadableImageError) else f"{type(e).__name__}: {e}"
                    log.warning("skipped %s: %s", p, reason)
                    skipped.append({"path": str(p), "reason": reason})
                    bar.update(1)
                    continue
                batch.append(image)
                infos.append((p, info))
            if not batch:
                continue
            preds = run_model(model, torch.stack(batch).to(device), names)
            preds = {t: v.float().cpu().numpy() for t, v in preds.items()}
            for i, (p, info) in enumerate(infos):
                folder = out / folders[p]  # created by the first file written into it
                entry = {"path": str(p), "out": folders[p], **{k: info[k] for k in ("size", "crop")}, "files": {}}
                for t in names:
                    files, top = _write(folder, t, kinds[t], preds[t][i], cfg.encode, class_names.get(t))
                    entry["files"][t] = files
                    if top is not None:
                        entry.setdefault("top5", {})[t] = top
                done.append(entry)
                bar.update(1)
    summary = {
        "checkpoint": checkpoint,
        "model": inner.cfg.name,
        "tasks": names,
        "encode": cfg.encode,
        "image_size": size,
        "preprocess": f"centred square of side min(H, W), resized to {size}x{size} (antialiased bilinear), RGB in "
                      "[0, 1]; crop = [top, left, side] in the original's pixels",
        "inference": inference_settings(inner),
        "device": str(device),
        "precision": precision_name(dtype),
        "images": done,
        "skipped": skipped,
    }
    sync_tree(out)  # every image's files on disk before the summary that lists them
    atomic_write_text(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def _head_kind(inner: SquadViT, task: str) -> str:
    """``"dense"`` (a per-pixel head) or ``"class"`` (class and token heads: one vector per image)."""
    return "dense" if isinstance(inner.heads[task], DenseHead) else "class"


def _channels(inner: SquadViT, task: str) -> int:
    head = inner.heads[task]
    return head.channels if isinstance(head, DenseHead) else head.fc.out_features


def _check_class_names(inner: SquadViT, names: dict[str, list[str]], tasks: Sequence[str]) -> dict[str, list[str]]:
    out = {}
    for task, labels in names.items():
        (i,) = inner.task_index([task])
        canonical = inner.task_names[i]
        if _head_kind(inner, canonical) != "class":
            raise ValueError(f"class names given for {canonical}, which is not a class task")
        channels = _channels(inner, canonical)
        if len(labels) != channels:
            raise ValueError(f"class names for {canonical}: {len(labels)} names for {channels} classes")
        if canonical in tasks:
            out[canonical] = list(labels)
    return out


def read_class_names(path: str | Path) -> list[str]:
    """Class names from a local file: a JSON list, or plain text with one name per line (blank lines skipped).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a JSON file that is not a list of strings.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ValueError(f"{path}: expected a JSON list of class names")
        return data
    return [line.strip() for line in text.splitlines() if line.strip()]


__all__ = ["IMAGE_EXTENSIONS", "SUMMARY", "UnreadableImageError", "center_box", "default_device", "list_images",
           "load_image", "predict", "read_class_names", "resolve_tasks", "run_model"]
