"""The expert shard files of an expert-parallel run's checkpoint tags: their names, and reading experts out of them.

A training run whose MoE layers spread their experts over ranks (``model.moe.expert_parallel`` /
``model.moa.expert_parallel`` > 1) keeps those experts out of DeepSpeed's files; rank i < P of each layout writes
``expert_shards_rank<i>.pt`` into the tag folder (`squad.train.expert_shards`)::

    {"format": "squad.expert_shards/1",
     "shards": {"blocks.0.mlp.experts.w1": {"first": 8,          # global index of its first expert
                                            "num_experts": 16,   # experts of the whole layer
                                            "weight": [8, D, H] float32 (master weights),
                                            "exp_avg": [8, D, H] | None, "exp_avg_sq": [8, D, H] | None,
                                            "step": float}, ...}}

The names are the single-process model's, so a tag's experts put back together (`whole_experts`) complete the
module weights of DeepSpeed's model-states file into the whole model's state dict, whatever the expert-parallel size
and number of ranks that wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from squad.io.checkpoints import DamagedCheckpointError, load_checkpoint_file

if TYPE_CHECKING:  # torch is imported where a tensor is made: the checkpointer's torch-free checks name shard files
    import torch

SHARD_FORMAT = "squad.expert_shards/1"
SHARD_FILE = "expert_shards_rank{:05d}.pt"
SHARD_GLOB = "expert_shards_rank*.pt"


def read_pieces(tag_dir: str | Path) -> dict[str, list[dict]]:
    """Every shard piece of a tag's shard files, by weight name ({} when the tag has none)."""
    pieces: dict[str, list[dict]] = {}
    for file in sorted(Path(tag_dir).glob(SHARD_GLOB)):
        content = load_checkpoint_file(file)
        if not isinstance(content, dict) or content.get("format") != SHARD_FORMAT:
            raise DamagedCheckpointError(f"{file}: not an expert shard file ({SHARD_FORMAT})", file)
        for name, piece in content["shards"].items():
            pieces.setdefault(name, []).append(piece)
    return pieces


def assemble(pieces: list[dict], rows: range, tag_dir: str | Path, name: str):
    """Rows ``rows`` of one expert weight (and its Adam moments when every piece has them) from its pieces.

    Returns:
        (weight [len(rows), ...], (exp_avg, exp_avg_sq, step) or None).

    Raises:
        DamagedCheckpointError: some expert of ``rows`` is in no piece (naming the weight and the experts).
    """
    weight = moments = None
    have = set()
    with_moments = bool(pieces) and all(p.get("exp_avg") is not None for p in pieces)
    for p in pieces:
        first, w = int(p["first"]), p["weight"]
        lo, hi = max(rows.start, first), min(rows.stop, first + w.shape[0])
        if lo >= hi:
            continue
        if weight is None:
            weight = w.new_empty(len(rows), *w.shape[1:])
            if with_moments:
                moments = [w.new_empty(weight.shape), w.new_empty(weight.shape), float(p["step"])]
        weight[lo - rows.start : hi - rows.start] = w[lo - first : hi - first]
        if moments is not None:
            moments[0][lo - rows.start : hi - rows.start] = p["exp_avg"][lo - first : hi - first]
            moments[1][lo - rows.start : hi - rows.start] = p["exp_avg_sq"][lo - first : hi - first]
        have.update(range(lo, hi))
    missing = [e for e in rows if e not in have]
    if missing:
        raise DamagedCheckpointError(f"{tag_dir}: experts {missing[:4]}{'...' if len(missing) > 4 else ''} of "
                                     f"{name} are in none of its {SHARD_GLOB} files", Path(tag_dir))
    return weight, None if moments is None else tuple(moments)


def check_shards(tag_dir: str | Path, expected: Iterable[str] = ()) -> None:
    """Checks that a tag's shard files hold every expert of every sharded weight (torch-level, the files mapped, not
    read): a shard file removed, or replaced by another rank's, leaves some experts in none of them.

    Args:
        tag_dir: the tag folder.
        expected: the weights the tag's marker says it keeps in shard files (``COMPLETE``'s ``expert_shards``).

    Raises:
        DamagedCheckpointError: a file that is not a shard file, or a weight with experts in no file (naming them).
    """
    tag_dir = Path(tag_dir)
    cover: dict[str, tuple[int, set[int]]] = {}
    for file in sorted(tag_dir.glob(SHARD_GLOB)):
        content = load_checkpoint_file(file, mmap=True)
        if not isinstance(content, dict) or content.get("format") != SHARD_FORMAT:
            raise DamagedCheckpointError(f"{file}: not an expert shard file ({SHARD_FORMAT})", file)
        for name, piece in content["shards"].items():
            first, rows = int(piece["first"]), int(piece["weight"].shape[0])
            cover.setdefault(name, (int(piece["num_experts"]), set()))[1].update(range(first, first + rows))
    for name in sorted(set(expected) | set(cover)):
        total, have = cover.get(name, (0, set()))
        missing = [e for e in range(total) if e not in have]
        if name not in cover or missing:
            which = f"experts {missing[:4]}{'...' if len(missing) > 4 else ''} of {name} are" if missing else \
                f"{name} is"
            raise DamagedCheckpointError(f"{tag_dir}: {which} in none of its {SHARD_GLOB} files (a shard file is "
                                         f"missing, or holds another rank's experts)", tag_dir)


def shard_names(tag_dir: str | Path) -> set[str]:
    """The weights a tag keeps in shard files (single-process names; empty for a run without expert parallelism).
    The files are mapped, not read: only their index is."""
    names: set[str] = set()
    for file in sorted(Path(tag_dir).glob(SHARD_GLOB)):
        content = load_checkpoint_file(file, mmap=True)
        names.update(content.get("shards", {}) if isinstance(content, dict) else {})
    return names


def whole_experts(tag_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every sharded expert weight of a tag, whole ([E, ...] float32), by the single-process model's names; {} for
    a tag of a run without expert parallelism."""
    out = {}
    for name, pieces in read_pieces(tag_dir).items():
        total = int(pieces[0]["num_experts"])
        out[name], _ = assemble(pieces, range(total), tag_dir, name)
    return out
