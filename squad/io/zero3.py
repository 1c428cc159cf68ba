"""The whole float32 weights of a ZeRO-3 checkpoint tag, read with ``weights_only`` and without DeepSpeed.

Under ZeRO stage 3 no file of a tag holds the module's weights: every data-parallel rank r writes
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` (the client state, buffers, the parameters' shapes in optimizer
order, the frozen parameters' partitions) and ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (its partition of
every trainable parameter's float32 master weights, ``fp32_flat_groups``, and of the Adam moments). A parameter of n
elements is split into W partitions of ceil(n / W) elements (the last padded), laid end to end in each rank's flat
groups in ``param_shapes`` order: `fp32_state_dict` puts them back together, as DeepSpeed's ``zero_to_fp32.py`` does
(which `squad.cli.export` also accepts), so ``squad.load`` and the tools open a ZeRO-3 tag like any other.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from squad.io.checkpoints import DamagedCheckpointError, load_checkpoint_file

ZERO3_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")  # one per data-parallel rank
ZERO3_FIRST = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def is_zero3_tag(tag_dir: str | Path) -> bool:
    """Whether a tag was written under ZeRO stage 3 (per-rank model-states files)."""
    return (Path(tag_dir) / ZERO3_FIRST).is_file()


def fp32_state_dict(tag_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a ZeRO-3 tag's module, whole, in float32, by the engine's module names.

    Raises:
        DamagedCheckpointError: a rank's file is missing, or the partitions do not add up to the shapes.
    """
    tag_dir = Path(tag_dir)
    first = load_checkpoint_file(tag_dir / ZERO3_FIRST)
    world = int(first.get("dp_world_size") or 1)
    states = [first] + [_read(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(1, world)]
    flats = []
    for r in range(world):
        optim = _read(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", mmap=True)
        groups = optim["optimizer_state_dict"]["fp32_flat_groups"]
        flats.append(torch.cat([g.reshape(-1).float() for g in groups]))  # this rank's partitions, end to end
    buffers = set(first.get("buffer_names") or [])
    out = {k: v.float() if v.is_floating_point() else v for k, v in first["module"].items() if k in buffers}
    offset = 0
    for shapes in first["param_shapes"]:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            pieces = [flat[offset : offset + part] for flat in flats]
            if any(p.numel() != part for p in pieces):
                raise DamagedCheckpointError(f"{tag_dir}: the optimizer partitions end before {name}", tag_dir)
            out[name] = torch.cat(pieces)[:numel].view(tuple(shape)).clone()
            offset += part
    for name, shape in (first.get("frozen_param_shapes") or {}).items():  # frozen: partitions in the model states
        numel = math.prod(shape)
        whole = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])[:numel]
        out[name] = whole.view(tuple(shape)).float().clone()
    for alias, source in (first.get("shared_params") or {}).items():
        if source in out:
            out[alias] = out[source]
    return out


def _read(file: Path, mmap: bool = False):
    if not file.is_file():
        raise DamagedCheckpointError(f"{file}: missing (a ZeRO-3 tag holds one per data-parallel rank)", file)
    return load_checkpoint_file(file, mmap=mmap)
