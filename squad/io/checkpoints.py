"""Reading DeepSpeed checkpoint files with ``weights_only``: every file squad reads from a checkpoint tag goes through
`load_checkpoint_file` (``weights_only=True``, with exactly DeepSpeed's few plain records allowed:
`deepspeed_safe_globals`), and `check_tag_file` also checks that a tag's model-states file finds every ZeRO shard it
lists.

A file that would need arbitrary unpickling is an `UnsafeCheckpointError` (squad never writes one: it was modified or
planted), a truncated, missing or unreadable one a `DamagedCheckpointError`. Where the tags live, what marks one
complete, saving and resuming are `squad.train.checkpointer`'s.
"""

from __future__ import annotations

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
