"""Reading and writing every file squad makes; `load` opens any model squad wrote.

- model_files.py: ``model.pt``, extracted single-task files and checkpoint tags as models (`load`, `load_model`,
  `load_extracted`, `read_payload`; `export_model`, `save_extracted`), with the file formats.
- checkpoints.py: reading a DeepSpeed checkpoint file with ``weights_only`` and DeepSpeed's few records allowed
  (`load_checkpoint_file`); the layout of the tags, saving and resuming are `squad.train.checkpointer`'s.
- files.py: atomic writes (`atomic_write_text`, `atomic_torch_save`) and the message a failed write gives
  (`write_failure`).
- hf_folder.py: Hugging Face-style folders (``model.safetensors`` sharded with the hub's index past a size,
  ``config.json``; `load` reads them without pickle) and ``hf-hub:org/name`` ids resolved through huggingface_hub.
- weights.py: the weight files other models start from (timm state dicts, dense squad models).
- expert_files.py: the expert shard files of an expert-parallel run's tags, and its experts put back together.
- zero3.py: a ZeRO-3 tag's fp32 weights put back together from its ranks' partitions.

`io` reads and writes; building and changing models is `squad.models`'s (`io` asks it to build). The names below
are imported on first use, so ``squad.io.files`` (atomic text writes) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from squad.lazy import exports

_EXPORTS = {
    "atomic_torch_save": "squad.io.files",
    "atomic_write_text": "squad.io.files",
    "write_failure": "squad.io.files",
    "CHECKPOINT_FORMAT": "squad.io.model_files",
    "EXTRACTED_FORMAT": "squad.io.model_files",
    "MODEL_FORMAT": "squad.io.model_files",
    "export_model": "squad.io.model_files",
    "load": "squad.io.model_files",
    "load_extracted": "squad.io.model_files",
    "load_model": "squad.io.model_files",
    "read_payload": "squad.io.model_files",
    "save_extracted": "squad.io.model_files",
}

__all__ = [
    "CHECKPOINT_FORMAT", "EXTRACTED_FORMAT", "MODEL_FORMAT", "atomic_torch_save", "atomic_write_text", "export_model",
    "load", "load_extracted", "load_model", "read_payload", "save_extracted", "write_failure",
]

if TYPE_CHECKING:
    from squad.io.files import atomic_torch_save, atomic_write_text, write_failure
    from squad.io.model_files import (
        CHECKPOINT_FORMAT,
        EXTRACTED_FORMAT,
        MODEL_FORMAT,
        export_model,
        load,
        load_extracted,
        load_model,
        read_payload,
        save_extracted,
    )


__getattr__, __dir__ = exports(__name__, _EXPORTS)
