"""Reading and writing every file squad makes; `load` opens any model squad wrote.

- model_files.py: ``model.pt``, extracted single-task files and checkpoint tags as models (`load`, `load_model`,
  `load_extracted`, `read_payload`; `export_model`, `save_extracted`), with the file formats.
- checkpoints.py: the checkpoint layout (tags, the ``COMPLETE`` marker, ``latest``) and reading its files with
  ``weights_only`` (`load_checkpoint_file`).
- files.py: atomic writes (`atomic_write_text`, `atomic_torch_save`) and the message a failed write gives
  (`write_failure`).
- weights.py: the weight files other models start from (timm state dicts, dense squad models).
- expert_files.py: the expert shard files of an expert-parallel run's tags, and its experts put back together.
- zero3.py: a ZeRO-3 tag's fp32 weights put back together from its ranks' partitions.

`io` reads and writes; building and changing models is `squad.models`'s (`io` asks it to build).
"""

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

__all__ = [
    "CHECKPOINT_FORMAT",
    "EXTRACTED_FORMAT",
    "MODEL_FORMAT",
    "atomic_torch_save",
    "atomic_write_text",
    "export_model",
    "load",
    "load_extracted",
    "load_model",
    "read_payload",
    "save_extracted",
    "write_failure",
]
