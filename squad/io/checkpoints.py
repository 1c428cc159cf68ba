"""Reading DeepSpeed checkpoint files with ``weights_only``: every file squad reads from a checkpoint tag goes through
`load_checkpoint_file` (``weights_only=True``, with exactly DeepSpeed's few plain records allowed:
`deepspeed_safe_globals`), and `check_tag_file` also checks that a tag's model-states file finds every ZeRO shard it
lists.

A file that would need arbitrary unpickling is an `UnsafeCheckpointError` (squad never writes one: it was modified or
planted), a truncated, missing or unreadable one a `DamagedCheckpointError`.

The tag layout's names and how to read it also live here, torch-free, so that `squad.load` and the tools' fast checks
read a run's tags without the training floor: `tag_for`, the ``COMPLETE`` marker (`read_marker`, `marked_step`),
`complete_tags`, `find_resume_tag`, `resume_candidates` and `checkpoint_tag` (which tag a path names). Writing tags,
resuming, damaged-tag fallback and conversions are `squad.train.checkpointer`'s.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file with the module weights and the client state
MODEL_STATES_ZERO3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # its counterpart under ZeRO-3 (no weights in it)
ZERO_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")  # one per data-parallel rank


# ---------------------------------------------------------------------------------------------- safe reading
class CheckpointError(ValueError):
    """A checkpoint file squad will not load; ``file`` names it."""

    every_rank = True  # a resume agrees on it across ranks (squad.train.checkpointer): the tools print it once

    def __init__(self, message: str, file: str | Path):
        super().__init__(message)
        self.file = str(file)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that only arbitrary unpickling would load (it could run code): never loaded."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file that is missing, truncated or otherwise unreadable."""


def deepspeed_safe_globals() -> list:
    """The only non-tensor classes allowed in a DeepSpeed checkpoint file beside plain data: the fp16 loss scalers, the
    bf16/ZeRO optimizers' fragment addresses and ZeRO's stage enum (plain attribute records; nothing else is allowed).
    DeepSpeed is imported only here, for such files: loading never needs it otherwise."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [DynamicLossScaler, LossScaler, fragment_address, ZeroStageEnum]


def refusal_reason(error: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in a few words (its own message is a page long)."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    if found:
        return f"it holds {found.group(1)}, which weights_only loading does not allow"
    return f"{type(error).__name__}: {error}"[:200]


def load_checkpoint_file(file: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of a DeepSpeed checkpoint file; if DeepSpeed stored one of its own records
    beside the weights, once more with exactly those classes allowed (`deepspeed_safe_globals`).

    Args:
        file: the file (``mp_rank_00_model_states.pt``, a ZeRO optimizer shard, ...).
        map_location: as for ``torch.load``.
        mmap: map the file instead of reading it (tensors are read as they are used).

    Returns:
        The file's contents.

    Raises:
        UnsafeCheckpointError: only arbitrary unpickling would load it (the file names what it holds).
        DamagedCheckpointError: missing, truncated or otherwise unreadable.
    """
    import torch

    try:
        return torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        error: BaseException = e
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise DamagedCheckpointError(f"{file}: not a loadable DeepSpeed checkpoint ({type(e).__name__}: "
                                     f"{str(e)[:200]})", file) from e
    allowed = deepspeed_safe_globals()
    if allowed:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            error = e
        except Exception as e:  # noqa: BLE001
            raise DamagedCheckpointError(f"{file}: not a loadable DeepSpeed checkpoint ({type(e).__name__}: "
                                         f"{str(e)[:200]})", file) from e
    raise UnsafeCheckpointError(f"{file}: weights_only loading refuses this checkpoint ({refusal_reason(error)}); "
                                f"squad never unpickles files without weights_only", file) from error


def tag_files(tag_dir: Path) -> list[Path]:
    """Every file of a checkpoint tag that DeepSpeed may read (its ``.pt`` files), sorted."""
    return sorted(p for p in Path(tag_dir).iterdir() if p.is_file() and p.suffix == ".pt")


def model_states_file(tag_dir: Path) -> Path:
    """The tag's model-states file: ``mp_rank_00_model_states.pt``, or rank 0's under ZeRO-3 (which has one per rank
    and no module weights: `squad.io.zero3`)."""
    tag_dir = Path(tag_dir)
    return tag_dir / MODEL_STATES_ZERO3 if (tag_dir / MODEL_STATES_ZERO3).is_file() else tag_dir / MODEL_STATES


def check_tag_file(tag_dir: Path, file: Path, names: set[str]) -> None:
    """Loads one file of a tag safely; the model-states file must also list every ZeRO shard the tag needs."""
    states = load_checkpoint_file(file, mmap=True)
    if file.name not in (MODEL_STATES, MODEL_STATES_ZERO3):
        return
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise DamagedCheckpointError(f"{file}: no module weights in this DeepSpeed checkpoint", file)
    ds = states.get("ds_config") if isinstance(states.get("ds_config"), dict) else {}
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage or any(ZERO_SHARD.match(n) for n in names):
        have = {int(m.group(1)) for n in names if (m := ZERO_SHARD.match(n))}
        missing = [r for r in range(int(states.get("dp_world_size") or 1)) if r not in have]
        if missing:
            name = f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
            raise DamagedCheckpointError(f"{tag_dir / name}: missing (the optimizer shard of data-parallel rank "
                                         f"{missing[0]})", tag_dir / name)


COMPLETE = "COMPLETE"  # marker file of a tag every rank finished saving
TAG_CONFIG = "config.yaml"  # the resolved run config a tag was trained with (what a resume compares against)
LATEST = "latest"  # names the newest complete tag
SAVING = ".saving"  # saves in progress: <ckpt_dir>/.saving/<tag>
CONVERTED = ".convert"  # tags converted for loading: <ckpt_dir>/.convert/<tag>


# ------------------------------------------------------------------------------------------------------ layout
def tag_for(step: int) -> str:
    """The tag (folder name) of the checkpoint at optimiser step ``step``."""
    return f"step{step:08d}"


def read_marker(tag_dir: Path) -> dict | None:
    """A tag's ``COMPLETE`` record (``step``, and from this version on ``world_size`` and ``zero_stage``); None
    without a readable marker (the tag is not complete)."""
    try:
        record = json.loads((Path(tag_dir) / COMPLETE).read_text())
        int(record["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, dict) else None


def marked_step(tag_dir: Path) -> int | None:
    """The step in a tag's ``COMPLETE`` marker; None when the tag is not complete."""
    record = read_marker(tag_dir)
    return None if record is None else int(record["step"])


def complete_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first (a tag whose marker is unreadable counts as incomplete)."""
    if not Path(ckpt_dir).is_dir():
        return []
    steps = {p.name: marked_step(p) for p in Path(ckpt_dir).iterdir() if p.is_dir() and not p.name.startswith(".")}
    return sorted((t for t, s in steps.items() if s is not None), key=lambda t: steps[t])


def find_resume_tag(ckpt_dir: Path) -> str | None:
    """The tag to resume from: ``latest`` if it is complete, else the newest complete tag, else None."""
    latest = Path(ckpt_dir) / LATEST
    if latest.is_file():
        tag = latest.read_text().strip()
        if tag and not tag.startswith(".") and marked_step(Path(ckpt_dir) / tag) is not None:
            return tag
    tags = complete_tags(ckpt_dir)
    return tags[-1] if tags else None


def resume_candidates(ckpt_dir: Path) -> list[str]:
    """Complete tags to try, best first: `find_resume_tag`, then the older complete tags, newest first."""
    first = find_resume_tag(ckpt_dir)
    if first is None:
        return []
    step = marked_step(Path(ckpt_dir) / first) or 0
    older = [t for t in reversed(complete_tags(ckpt_dir)) if t != first and (marked_step(Path(ckpt_dir) / t) or 0)
             <= step]
    return [first, *older]


def checkpoint_tag(path: Path) -> Path | None:
    """The tag folder ``path`` names for loading a model (`squad.load`): a tag, its model-states file, or a
    checkpoints folder (its `find_resume_tag`); None when ``path`` is none of those.

    Raises:
        FileNotFoundError: a checkpoints folder without a complete tag.
    """
    path = Path(path)
    if path.is_file():
        return path.parent if path.name in (MODEL_STATES, MODEL_STATES_ZERO3) else None
    if not path.is_dir():
        return None
    if (path / COMPLETE).is_file() or model_states_file(path).is_file():
        return path
    if (path / LATEST).is_file() or complete_tags(path):
        tag = find_resume_tag(path)
        if tag is None:
            raise FileNotFoundError(f"{path}: no complete checkpoint (tags without a {COMPLETE} marker were "
                                    f"interrupted while saving)")
        return path / tag
    return None
