"""PASCAL-Context in the PASCAL_MT layout (ASTMT / MTI-Net / M3ViT / Mod-Squad Table 3): the reader.

Sources read for the layout and encodings (facts only): facebookresearch/astmt ``fblib/dataloaders/pascal_context.py``
and SimonVandenhende/Multi-Task-Learning-PyTorch ``data/pascal_context.py``, ``data/custom_transforms.py``
(``AddIgnoreRegions``), ``data/db_info/{nyu_classes,context_classes}.json``. The archive is ``PASCAL_MT.tgz``
(ASTMT's ``https://data.vision.ee.ethz.ch/kmaninis/share/MTL/PASCAL_MT.tgz``; the link is dead, mirrors exist).

Layout (``root`` = the ``PASCAL_MT`` folder; ``{id}`` is a VOC id such as ``2008_000002``):

====================================  ===========================================================================
path                                  contents (as the public loaders read it)
====================================  ===========================================================================
``ImageSets/Context/train.txt``       one id per line; 4,998 ids (``val.txt``: 5,105). The split lists.
``JPEGImages/{id}.jpg``               RGB JPEG of any size (PASCAL images are about 500 × 375, either way).
``semseg/pascal-context/{id}.png``    8-bit single-channel PNG (mode ``L`` or ``P``: the stored index is the
                                      label): 0 = background, 1..20 the VOC classes in the order aeroplane,
                                      bicycle, bird, boat, bottle, bus, car, cat, chair, cow, diningtable, dog,
                                      horse, motorbike, person, pottedplant, sheep, sofa, train, tvmonitor;
                                      255 = ignore. ``semseg/VOC12/{id}.png`` (same encoding) is preferred when
                                      it exists, as both loaders do.
``human_parts/{id}.mat``              PASCAL-Part annotation, one file for every image (an image without people
                                      has an ``objects`` list without class 15). MATLAB struct ``anno`` with field
                                      ``objects`` (1 × n struct array), each object with fields ``class`` (str),
                                      ``class_ind`` (int; 15 = person), ``mask`` (uint8 H × W instance mask) and
                                      ``parts`` (1 × m struct array with ``part_name`` (str) and ``mask`` (uint8
                                      H × W)); the loaders index it positionally as
                                      ``anno[0][0][1][0][obj] → (class, class_ind, mask, parts)``.
``ImageSets/Parts/{split}.txt``       the list of images with persons: a cache ASTMT writes on first use, JSON
                                      ``{id: [class_ind of each object, -1 for an empty mask]}`` (an image "has
                                      persons" when 15 is listed). Not needed here: the reader takes the same
                                      fact from the ``.mat`` itself (a person object with part pixels).
``sal_distill/{id}.png``              8-bit gray PNG, distilled saliency in 0..255; salient ⇔ value / 255 > 0.5.
``normals_distill/{id}.png``          8-bit RGB PNG, distilled normals: n = 2·c/255 − 1 per channel (x, y, z).
                                      Valid only on pixels whose PASCAL-Context class (``LabelMap`` below) is one
                                      of `NORMALS_VALID_CLASSES`; elsewhere the loaders zero the vector, which
                                      ``AddIgnoreRegions`` turns into ignore.
``pascal-context/trainval/{id}.mat``  PASCAL-Context full labels: ``LabelMap`` (H × W integer map of the 459
                                      context classes, 1..459, ``context_classes.json`` numbering). Edges come from
                                      it, and it masks the normals.
====================================  ===========================================================================

Human parts (6 parts, ASTMT's ``HUMAN_PART[6]``; `PART_IDS`): 1 head (hair, head, lear, lebrow, leye, mouth, nose,
rear, rebrow, reye), 2 torso (torso, neck), 3 upper arms (luarm, ruarm), 4 lower arms and hands (llarm, rlarm,
lhand, rhand), 5 upper legs (luleg, ruleg), 6 lower legs and feet (llleg, rlleg, lfoot, rfoot); 0 = background.
The target is built over every person object (``class_ind == 15``) that has parts: part masks are painted in
file order (a later part overwrites an earlier one). An image without such a person has no target: the loaders'
all-zero map becomes all-ignore (``AddIgnoreRegions``), and so the mask here is all False.

Edges (ASTMT ``_load_edge``): ``cv2.Laplacian(LabelMap, CV_64F)`` — the 4-neighbour kernel
``[[0, 1, 0], [1, -4, 1], [0, 1, 0]]`` with reflect-101 borders — then ``thin(|L| > 0)`` (skimage's
morphological thinning; `thin` here, the same two-subiteration algorithm), as {0, 1}. No dilation in the reader;
the evaluation tolerance is SEISM's maxDist 0.0075 of the image diagonal (`squad.eval`).

Normals' valid classes (`NORMALS_VALID_CLASSES`): the context ids of the class names that
``nyu_classes.json`` and ``context_classes.json`` share, except ``unknown``, plus ``tvmonitor`` (ASTMT's "custom
addition") — 170 ids.

What the reader hands each task's ``decode`` (the raw form, HxW at the file's size):

=============  =======================================================================================
task           raw array
=============  =======================================================================================
semseg         ``uint8 [H, W]`` the PNG's labels as stored (0..20, 255 ignore)
human_parts    ``uint8 [H, W]`` part ids 0..6; all 255 when the image has no person with parts
saliency       ``uint8 [H, W]`` the distilled PNG as stored (0..255; the task thresholds at 0.5)
normals        ``uint8 [H, W, 3]`` the PNG as stored, with pixels outside the valid classes set to the
               fill (128, 128, 128) — decodes to a vector shorter than 0.1, i.e. masked
edge          ``uint8 [H, W]`` {0, 1} derived from ``LabelMap`` as above
=============  =======================================================================================

Sizes (`squad.data.benchmark`): every image, whatever its aspect ratio, becomes ``image_size`` square.
Evaluation: resized so the longer side is ``image_size`` (aspect kept), then padded to a square, centred; padded
pixels are zero in rgb and masked in every target (so every pixel of the image is scored, at that resolution).
Training: the same fit scaled by a random factor in ``scale_range`` (default 0.75–1.5), a random crop or padding
to the square, and a horizontal flip (p = 0.5; normals' x negated) — one draw for rgb and every target; labels
resized with nearest neighbour, normals and saliency as their task's ``resample`` says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from squad.data.benchmark import BenchmarkBase, label_edges, read_image, read_mat, read_png
from squad.data.samples import CorruptFileError

VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")

PERSON_CLASS = 15  # PASCAL-Part's class_ind of a person

PART_NAMES = ("background", "head", "torso", "upper_arm", "lower_arm", "upper_leg", "lower_leg")

PART_IDS: dict[str, int] = {
    **dict.fromkeys(("hair", "head", "lear", "lebrow", "leye", "mouth", "nose", "rear", "rebrow", "reye"), 1),
    **dict.fromkeys(("torso", "neck"), 2),
    **dict.fromkeys(("luarm", "ruarm"), 3),
    **dict.fromkeys(("llarm", "rlarm", "lhand", "rhand"), 4),
    **dict.fromkeys(("luleg", "ruleg"), 5),
    **dict.fromkeys(("llleg", "rlleg", "lfoot", "rfoot"), 6),
}

# PASCAL-Context class ids (context_classes.json numbering) of the classes NYU-v2 also has, plus tvmonitor.
NORMALS_VALID_CLASSES = frozenset((
    3, 4, 6, 9, 10, 11, 13, 15, 17, 18, 22, 23, 29, 30, 33, 34, 36, 37, 38, 39, 41, 43, 46, 49, 50, 51, 53, 55, 56,
    59, 61, 62, 65, 66, 68, 69, 72, 73, 78, 83, 84, 85, 87, 88, 95, 96, 101, 104, 105, 107, 111, 113, 115, 122,
    124, 135, 141, 142, 143, 146, 150, 154, 157, 158, 159, 165, 172, 174, 181, 183, 184, 191, 193, 195, 197, 199,
    202, 213, 215, 216, 219, 220, 223, 225, 228, 230, 232, 233, 238, 239, 242, 243, 246, 250, 251, 252, 255, 260,
    261, 263, 269, 272, 273, 275, 281, 283, 284, 285, 286, 287, 288, 290, 291, 292, 293, 295, 304, 307, 309, 310,
    314, 315, 319, 323, 329, 330, 331, 336, 342, 345, 349, 350, 351, 352, 355, 357, 368, 370, 371, 374, 379, 380,
    383, 384, 397, 401, 403, 405, 407, 408, 411, 412, 413, 414, 417, 419, 421, 423, 427, 429, 430, 432, 440, 441,
    442, 443, 444, 446, 454, 457,
))

NORMALS_FILL = 128  # the code of an invalid normal (decodes to a vector shorter than 0.1)
IGNORE = 255


def _name(x: Any) -> str:
    """A MATLAB char array as loadmat gives it (``array(['head'])``) → ``"head"``."""
    a = np.asarray(x)
    return str(a.reshape(-1)[0]) if a.size else ""


def human_parts_map(mat: dict[str, Any], path: str | Path = "human_parts") -> np.ndarray:
    """The 6-part target of one PASCAL-Part annotation (module docstring): ``uint8 [H, W]``, 0 background,
    1..6 parts, all `IGNORE` when no person object has part pixels.

    Raises:
        CorruptFileError: the file lacks the ``anno`` struct or has malformed objects.
    """
    try:
        objects = mat["anno"][0][0][1][0] if mat["anno"][0][0][1].size else []
        target: np.ndarray | None = None
        shape: tuple[int, ...] | None = None
        for obj in objects:
            mask = np.asarray(obj[2])
            shape = shape or mask.shape
            if int(np.asarray(obj[1]).reshape(-1)[0]) != PERSON_CLASS or np.asarray(obj[3]).size == 0:
                continue
            if target is None:
                target = np.zeros(mask.shape, dtype=np.uint8)
            for part in np.asarray(obj[3]).reshape(-1):
                name = _name(part[0])
                if name not in PART_IDS:
                    raise CorruptFileError(f"{path}: unknown person part {name!r}")
                target[np.asarray(part[1]).astype(bool)] = PART_IDS[name]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CorruptFileError(f"{path}: not a PASCAL-Part annotation ({type(e).__name__}: {e})") from e
    if target is None or not target.any():
        if shape is None:
            raise CorruptFileError(f"{path}: no objects, so no image size (every PASCAL-Part file has objects)")
        return np.full(shape[:2], IGNORE, dtype=np.uint8)
    return target


def label_map(mat: dict[str, Any], path: str | Path = "pascal-context") -> np.ndarray:
    """``LabelMap`` of a PASCAL-Context label file as an integer array.

    Raises:
        CorruptFileError: no 2-D ``LabelMap``.
    """
    lab = mat.get("LabelMap")
    if lab is None or np.asarray(lab).ndim != 2:
        raise CorruptFileError(f"{path}: no 2-D LabelMap")
    return np.asarray(lab).astype(np.int32)


def mask_normals(normals: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Distilled normals with the pixels outside `NORMALS_VALID_CLASSES` set to the fill (128, 128, 128).

    Raises:
        CorruptFileError: not an RGB image of the label map's size.
    """
    if normals.ndim != 3 or normals.shape[2] < 3:
        raise CorruptFileError(f"normals: expected an RGB PNG, got shape {normals.shape}")
    if normals.shape[:2] != labels.shape:
        raise CorruptFileError(f"normals: size {normals.shape[:2]} differs from the label map's {labels.shape}")
    out = np.ascontiguousarray(normals[:, :, :3]).copy()
    out[~np.isin(labels, list(NORMALS_VALID_CLASSES))] = NORMALS_FILL
    return out


class PascalContextDataset(BenchmarkBase):
    """PASCAL-Context (PASCAL_MT layout; module docstring) with the Dataset contract of `SampleDataset`.

    Args: as `squad.data.benchmark.BenchmarkBase`; tasks among `PASCAL_TASKS` (``"all"`` = the five), splits
    ``train`` / ``val`` from ``ImageSets/Context``.
    """

    dataset = "pascal_context"
    split_dir = "ImageSets/Context"

    def _sources(self, domain: str, sample_id: str) -> list[Path | None]:
        r = self.root
        if domain == "rgb":
            return [r / "JPEGImages" / f"{sample_id}.jpg"]
        name = self.pipeline.task(domain).name
        context = r / "pascal-context" / "trainval" / f"{sample_id}.mat"
        if name == "semseg":
            voc = r / "semseg" / "VOC12" / f"{sample_id}.png"
            exists = self._exists or (lambda p: p.is_file())
            return [voc if exists(voc) else r / "semseg" / "pascal-context" / f"{sample_id}.png"]
        if name == "human_parts":
            return [r / "human_parts" / f"{sample_id}.mat"]
        if name == "saliency":
            return [r / "sal_distill" / f"{sample_id}.png"]
        if name == "normals":
            return [r / "normals_distill" / f"{sample_id}.png", context]
        if name == "edge":
            return [context]
        raise KeyError(f"{self.dataset}: no files for task {name!r}")

    def _read_task(self, sample_id: str, domain: str) -> np.ndarray:
        if domain == "rgb":
            return read_image(self.root / "JPEGImages" / f"{sample_id}.jpg")
        name = self.pipeline.task(domain).name
        sources = self._sources(domain, sample_id)
        if name in ("semseg", "saliency"):
            arr = read_png(sources[0])
            if arr.ndim != 2:
                raise CorruptFileError(f"{sources[0]}: expected a single-channel PNG, got shape {arr.shape}")
            return arr
        if name == "human_parts":
            return human_parts_map(read_mat(sources[0]), sources[0])
        context = sources[-1]
        labels = self._cached(sample_id, "labels", lambda: label_map(read_mat(context), context))
        if name == "edge":
            return label_edges(labels)
        return mask_normals(read_png(sources[0]), labels)
