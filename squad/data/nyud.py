"""NYUD-v2 in the MTI-Net layout (MTI-Net / ATRC / InvPT / TaskPrompter / MLoRE): the reader.

Sources read for the layout and encodings (facts only): SimonVandenhende/Multi-Task-Learning-PyTorch
``data/nyud.py`` (MTI-Net, archive ``NYUD_MT.tgz``), prismformore/Multi-Task-Transformer
``TaskPrompter/data/nyud.py`` (the ATRC release ``NYUDv2.tar.gz`` InvPT and its successors use), and
facebookresearch/astmt ``fblib/dataloaders/nyud.py`` (an older ``.mat`` variant, 41-way, not read here). 795 training
and 654 validation images of 425 × 560 (crops of the 480 × 640 Kinect frames).

Layout (``root`` = the ``NYUD_MT`` / ``NYUDv2`` folder; ``{id}`` a line of the split list). The two public variants
differ only in file types; the reader takes, per file, the first extension that exists:

======================  =================================  ============================================
path                    MTI-Net (``NYUD_MT.tgz``)           ATRC / InvPT (``NYUDv2.tar.gz``)
======================  =================================  ============================================
``gt_sets/train.txt``   one id per line (``val.txt`` too)   same
``images/{id}``         ``.jpg`` RGB                        ``.png`` RGB
``segmentation/{id}``   ``.png`` 8-bit: 0 = unlabelled,     same
                        1..40 the 40 NYU-40 classes
``depth/{id}``          ``.npy`` float32 H × W, metres,     same
                        0 = no measurement
``normals/{id}``        ``.npy`` float32 H × W × 3 in       ``.png`` 8-bit RGB, n = 2·c/255 − 1
                        [−1, 1]; a zero vector = invalid
``edge/{id}``           ``.npy`` float32 H × W in {0, 1}    ``.png`` 8-bit, 0 / 255
======================  =================================  ============================================

Both loaders train 40-way segmentation: label 0 → ignore (255), label k → k − 1 (the ``nyud_semseg`` task does this
in its decode, from the stored PNG). Depth 0 is ignored (``AddIgnoreRegions``); normals of zero length are ignored.

What the reader hands each task's ``decode`` (the raw form, at the file's size):

=============  ==============================================================================================
task           raw array
=============  ==============================================================================================
nyud_semseg    ``uint8 [H, W]`` the PNG as stored (0 = unlabelled, 1..40)
nyud_depth     ``float32 [H, W]`` metres, 0 = invalid (the ``.npy`` as stored)
normals        ``uint8 [H, W, 3]``: the ``.png`` as stored, or the ``.npy`` encoded as c = round((n + 1)·127.5)
               with invalid (zero-length) vectors written as the fill (128, 128, 128)
edge           ``uint8 [H, W]`` {0, 1} (PNG: value > 127; ``.npy``: value > 0.5)
=============  ==============================================================================================

Sizes and augmentation: as for PASCAL-Context (`squad.data.benchmark`): evaluation fits the longer side to
``image_size`` and pads to a square (padding masked); training scales by a random factor, crops or pads, and flips.
Depth is resized mask-aware in float (no measurement never blends into measured pixels).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from squad.data.benchmark import BenchmarkBase, first_existing, read_image, read_npy, read_png
from squad.data.samples import CorruptFileError

NORMALS_FILL = 128  # the code of an invalid normal (decodes to a vector shorter than 0.1)

# folder and accepted extensions (first that exists) per task; rgb first
_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rgb": ("images", (".jpg", ".png")),
    "nyud_semseg": ("segmentation", (".png",)),
    "nyud_depth": ("depth", (".npy",)),
    "normals": ("normals", (".png", ".npy")),
    "edge": ("edge", (".png", ".npy")),
}


def encode_normals(normals: np.ndarray) -> np.ndarray:
    """Float normals in [-1, 1] ``[H, W, 3]`` → the 8-bit code c = round((n + 1)·127.5); zero-length (invalid)
    vectors → the fill (128, 128, 128).

    Raises:
        CorruptFileError: not ``[H, W, 3]`` or not finite.
    """
    n = np.asarray(normals)
    if n.ndim != 3 or n.shape[2] != 3 or not np.issubdtype(n.dtype, np.floating):
        raise CorruptFileError(f"normals: expected float [H, W, 3], got {n.dtype} {n.shape}")
    if not np.isfinite(n).all():
        raise CorruptFileError("normals: non-finite values")
    code = np.clip(np.rint((n.astype(np.float64) + 1.0) * 127.5), 0, 255).astype(np.uint8)
    code[(n == 0).all(axis=2)] = NORMALS_FILL
    return code


class NYUDDataset(BenchmarkBase):
    """NYUD-v2 (MTI-Net layout, either file variant; module docstring) with the Dataset contract of `SampleDataset`.

    Args: as `squad.data.benchmark.BenchmarkBase`; tasks among `NYUD_TASKS` (``"all"`` = the four), splits
    ``train`` / ``val`` from ``gt_sets``.
    """

    dataset = "nyud"
    split_dir = "gt_sets"

    def _sources(self, domain: str, sample_id: str) -> list[Path | None]:
        name = "rgb" if domain == "rgb" else self.pipeline.task(domain).name
        if name not in _FILES:
            raise KeyError(f"{self.dataset}: no files for task {name!r}")
        folder, exts = _FILES[name]
        exists = self._exists
        if exists is None:
            return [first_existing(self.root / folder, sample_id, exts)]
        for ext in exts:
            p = self.root / folder / f"{sample_id}{ext}"
            if exists(p):
                return [p]
        return [None]

    def _read_task(self, sample_id: str, domain: str) -> np.ndarray:
        path = self._sources(domain, sample_id)[0]
        if path is None:
            raise CorruptFileError(f"{self.root}: the {domain} file of {sample_id} has gone")
        if domain == "rgb":
            return read_image(path)
        name = self.pipeline.task(domain).name
        npy = path.suffix == ".npy"
        arr = read_npy(path) if npy else read_png(path)
        if name == "nyud_depth":
            arr = np.squeeze(arr)
            if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.number):
                raise CorruptFileError(f"{path}: expected a depth map [H, W], got {arr.dtype} {arr.shape}")
            arr = arr.astype(np.float32)
            if not np.isfinite(arr).all():
                raise CorruptFileError(f"{path}: non-finite depths")
            return arr
        if name == "normals":
            return encode_normals(arr) if npy else arr
        if name == "edge":
            arr = np.squeeze(arr)
            if arr.ndim != 2:
                raise CorruptFileError(f"{path}: expected an edge map [H, W], got shape {arr.shape}")
            return (arr > 0.5).astype(np.uint8) if npy else (arr > 127).astype(np.uint8)
        if arr.ndim != 2:  # nyud_semseg
            raise CorruptFileError(f"{path}: expected a single-channel PNG, got shape {arr.shape}")
        return arr
