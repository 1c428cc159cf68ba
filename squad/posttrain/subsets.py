"""The images a fine-tune learns from: deterministic training subsets of a split (a share of it, or a few images per
class) and the held-out share of a subset that picks the learning rate and the stopping step.

Subsets are a seeded permutation of the split, of which the first ``ceil(fraction · N)`` images are used (so smaller
fractions are subsets of larger ones), or ``shots`` images per class (class = argmax of the label distribution).
"""

from __future__ import annotations

import math

import torch

from squad.tasks import get_task


def class_labels(dataset, task: str) -> torch.Tensor:
    """[N] class of every sample (argmax of its label distribution; -1 where the label is invalid).

    Reads only the label files (not the images).
    """
    spec = get_task(task, getattr(dataset, "task_options", None))
    if spec.head_kind != "class":
        raise ValueError(f"shots per class need a class task; {spec.name} is {spec.head_kind}")
    labels = []
    for i in range(len(dataset)):
        value, mask = spec.decode(dataset._read(i, spec.domain))
        labels.append(int(value.argmax()) if bool(mask.all()) else -1)
    return torch.tensor(labels, dtype=torch.long)


def subset_indices(n: int, fraction: float | None = None, shots: int | None = None,
                   labels: torch.Tensor | None = None, seed: int = 0) -> list[int]:
    """Deterministic training subset of a dataset of ``n`` samples.

    Args:
        n: dataset size.
        fraction: share of the samples in (0, 1]: the first ceil(fraction · n) of a seeded permutation.
        shots: instead, this many samples per class (``labels`` needed), in permutation order.
        labels: [n] class per sample (-1 = unusable).
        seed: permutation seed.

    Raises:
        ValueError: neither or both of fraction and shots, or values out of range.
    """
    if (fraction is None) == (shots is None):
        raise ValueError("give exactly one of fraction or shots")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    if fraction is not None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        return order[: max(1, math.ceil(fraction * n - 1e-9))]
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    if labels is None or labels.numel() != n:
        raise ValueError("shots per class need one label per sample")
    taken: dict[int, int] = {}
    out = []
    for i in order:
        c = int(labels[i])
        if c >= 0 and taken.get(c, 0) < shots:
            taken[c] = taken.get(c, 0) + 1
            out.append(i)
    if not out:
        raise ValueError("no sample has a valid class label")
    return out


def holdout_split(indices: list[int], share: float, seed: int) -> tuple[list[int], list[int]]:
    """(images learned from, held-out images) of a training subset: a seeded shuffle, the first ``share`` held out
    (at least one image on each side).

    Raises:
        ValueError: fewer than 2 images.
    """
    n = len(indices)
    if n < 2:
        raise ValueError(f"a fraction of {n} image(s) cannot be split into learning and held-out images")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    k = min(n - 1, max(1, round(share * n)))
    held = [indices[i] for i in order[:k]]
    fit = [indices[i] for i in order[k:]]
    return fit, held
