"""Hugging Face-style model folders and hub ids: the weights as safetensors beside a ``config.json``, no pickle.

A folder squad writes (`write_folder`; `squad.deploy.hf.save_pretrained` adds the model card) — format
``"squad.hf/1"``::

    config.json                      format, squad_version, architecture, the model config, tasks, inference
                                     options, the extraction (task, kept experts) of an extracted model, extra
                                     (step, final metrics, trained tasks, ...)
    model.safetensors                the weights (squad's parameter names, float32)
    model-00001-of-0000N.safetensors + model.safetensors.index.json
                                     the same, sharded past ``max_shard_size`` (the hub's layout: the index maps each
                                     tensor to its file)
    expert_usage.safetensors         the expert-usage statistics saved with the model (absent when none)
    README.md                        the model card (`squad.deploy.hf`)

`read_folder` builds the model from ``config.json`` and loads the tensors with safetensors (never pickle). A folder
from a newer squad (a format ``squad.hf/N`` this squad does not read) is refused naming the version that wrote it.

Hub ids: ``hf-hub:org/name`` (``hf-hub:org/name@revision`` for a branch, tag or commit) resolve through
huggingface_hub's ``snapshot_download``: its cache (``HF_HUB_CACHE``), ``HF_HUB_OFFLINE=1`` (the cache only) and
revisions (`resolve`). Both environment variables are read at each call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from squad.io.files import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:  # torch is imported where tensors are handled: `is_hub_id` serves torch-free start-up checks
    import torch

FORMAT = "squad.hf/1"
FORMAT_NAME = "squad.hf"
READABLE = (1,)  # the folder format versions this squad reads
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
USAGE = "expert_usage.safetensors"
HUB_PREFIX = "hf-hub:"
MAX_SHARD_SIZE = 5 * 10**9  # bytes per weights file before the weights are sharded (the hub's own default)
# what a hub download fetches: the folder's own files (not whatever else a repository holds)
HUB_FILES = [CONFIG, "*.safetensors", INDEX, "README.md"]


def is_hub_id(source: str | Path) -> bool:
    """Whether ``source`` is a hub id (``hf-hub:org/name[@revision]``)."""
    return str(source).startswith(HUB_PREFIX)


def resolve(source: str | Path) -> Path:
    """The local path of ``source``: itself, or for a hub id the snapshot folder in huggingface_hub's cache.

    ``hf-hub:org/name@rev`` downloads (or, with ``HF_HUB_OFFLINE=1``, finds in the cache) the repository's folder
    files at revision ``rev`` (default ``main``); ``HF_HUB_CACHE`` names the cache.

    Raises:
        FileNotFoundError: the id is not in the cache (offline) or not on the hub; the message names it.
        ValueError: a malformed id.
    """
    if not is_hub_id(source):
        return Path(source)
    text = str(source)
    repo, _, revision = text[len(HUB_PREFIX):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"{text}: a hub id is hf-hub:ORG/NAME (or hf-hub:ORG/NAME@REVISION)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        folder = snapshot_download(repo_id=repo, revision=revision or None, allow_patterns=HUB_FILES,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None, local_files_only=offline)
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE is set and the cache" if offline else "the hub is unreachable and the cache"
        raise FileNotFoundError(f"{text}: {where} ({os.environ.get('HF_HUB_CACHE') or 'the default cache'}) holds "
                                f"no {repo} at revision {revision or 'main'}") from e
    except (HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(f"{text}: not found on the hub ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from e
    return Path(folder)


def is_folder(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face-style folder (a ``config.json`` in it; `read_config` checks that squad
    wrote it). Run folders hold ``config.yaml`` instead."""
    return path.is_dir() and (path / CONFIG).is_file()


# ------------------------------------------------------------------------------------------------------ writing
def write_folder(folder: str | Path, config: dict, state: dict[str, torch.Tensor], usage: dict | None = None,
                 max_shard_size: int = MAX_SHARD_SIZE) -> list[Path]:
    """Writes ``config.json``, the weights (sharded past ``max_shard_size`` bytes) and the expert usage.

    Args:
        folder: the folder (created); stale weight shards of an earlier write there are removed.
        config: plain JSON data (`squad.deploy.hf.folder_config` makes it); ``format`` and ``squad_version`` are
            set here.
        state: the weights (copied to the CPU, contiguous).
        usage: an `ExpertUsage.state_dict`, or None.
        max_shard_size: bytes of tensors per weights file.

    Returns:
        The files written, in order.
    """
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    shards = _shards(state, max_shard_size)
    for old in [*folder.glob("model-*-of-*.safetensors"), folder / INDEX, folder / WEIGHTS, folder / USAGE]:
        old.unlink(missing_ok=True)
    written = []
    meta = {"format": FORMAT}
    if len(shards) == 1:
        written.append(atomic_write_bytes(folder / WEIGHTS, save(shards[0], meta), "the model weights"))
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            written.append(atomic_write_bytes(folder / name, save(shard, meta), "a model weights shard"))
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(v.numel() * v.element_size() for v in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        written.append(atomic_write_text(folder / INDEX, json.dumps(index, indent=2) + "\n", "the weights index"))
    config = dict(config)
    if usage is not None:
        tensors, plain = _usage_tensors(usage)
        written.append(atomic_write_bytes(folder / USAGE, save(tensors, meta), "the expert usage"))
        config["usage"] = plain
    config = {"format": FORMAT, "squad_version": _version(), **config}
    written.append(atomic_write_text(folder / CONFIG, json.dumps(plain_data(config), indent=2) + "\n",
                                     "the model config"))
    return written


def _shards(state: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """The tensors in order, cut into groups of at most ``limit`` bytes (a bigger tensor is a group of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    return shards


def _usage_tensors(usage: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {f"{table}/{layer}": t.detach().cpu().contiguous().clone() for table in ("counts", "mass", "tokens")
               for layer, t in usage[table].items()}
    return tensors, {"tasks": list(usage["tasks"]), "kinds": dict(usage["kinds"]), "top_k": dict(usage["top_k"])}


def plain_data(obj: Any) -> Any:
    """``obj`` as JSON data: tensors become lists, tuples lists, other objects their ``str``."""
    if isinstance(obj, dict):
        return {str(k): plain_data(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain_data(v) for v in obj]
    if hasattr(obj, "tolist"):  # a tensor (or a numpy array)
        return obj.tolist()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


def _version() -> str:
    """The installed squad's version (what ``squad.__version__`` says)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("squad")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


# ------------------------------------------------------------------------------------------------------ reading
def read_config(folder: Path) -> dict:
    """``config.json`` of a squad folder, its format checked.

    Raises:
        ValueError: not a squad folder, or a format version this squad does not read (naming the squad version that
            wrote it and this one).
    """
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / CONFIG}: not readable JSON ({e})") from e
    fmt = config.get("format") if isinstance(config, dict) else None
    name, _, version = str(fmt).partition("/")
    if name != FORMAT_NAME or not version.isdigit():
        raise ValueError(f"{folder}: config.json is not a squad model's (format {fmt!r}, expected {FORMAT!r}); "
                         f"save one with squad.save_pretrained or tools/export.py --format hf")
    if int(version) not in READABLE:
        raise ValueError(f"{folder}: written by squad {config.get('squad_version', '?')} in format {fmt}, which "
                         f"this squad ({_version()}) cannot read (it reads "
                         f"{', '.join(f'{FORMAT_NAME}/{v}' for v in READABLE)}); install squad "
                         f"{config.get('squad_version', 'of that version')} or newer")
    return config


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors`` or of the shards its index names (safetensors: no pickle).

    Raises:
        FileNotFoundError: no weights file, or a shard the index names is missing.
    """
    from safetensors.torch import load_file

    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{folder}: no {WEIGHTS} (nor {INDEX} of sharded weights)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder}: the weights shard {name} its index names is missing")
        state.update(load_file(folder / name))
    return state


def read_usage(folder: Path, config: dict) -> dict | None:
    """The `ExpertUsage.state_dict` saved in the folder, or None."""
    if "usage" not in config or not (folder / USAGE).is_file():
        return None
    from safetensors.torch import load_file

    tensors = load_file(folder / USAGE)
    usage: dict = {**config["usage"], "counts": {}, "mass": {}, "tokens": {}}
    for key, t in tensors.items():
        table, _, layer = key.partition("/")
        usage[table][layer] = t
    return usage
