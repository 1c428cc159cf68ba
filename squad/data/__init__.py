"""Data: the Taskonomy, PASCAL-Context and NYUD-v2 readers, HDF5 shards, the sample pipelines, and the loaders.

Readers and the sample pipeline:

- samples.py: the sample contract every reader keeps (`SampleDataset`), the interface of the sample pipelines
  (`Pipeline`), `collate`, and the errors a reader raises (`CorruptFileError`, `EmptyDatasetError`).
- taskonomy.py: the Taskonomy tree reader (`TaskonomyDataset`), its layouts, split CSVs and file decoding.
- benchmark.py, pascal.py, nyud.py: PASCAL-Context (PASCAL_MT) and NYUD-v2 (MTI-Net / ATRC) readers, and their
  sample pipeline (`BenchmarkPipeline`: any aspect ratio, fit and pad).
- shards.py: HDF5 shards (`ShardDataset`, `BenchmarkShardDataset`), read with the same sample format.
- transforms.py: Taskonomy's sample pipeline (mask-aware resize, crop, flip; `SamplePipeline`), and its integer
  stage for training batches (`SamplePipeline.integers`: read and crop only).
- device.py: integer training batches (`collate_integers`) and their batched decoding on the training device
  (`decode_batch`: float targets, blur, flips, masks — equal to the per-sample pipeline's).
- accounting.py: files a dataset could not use, counted once over workers and ranks (`report`, `DataReport`).
- samplers.py: the resumable training sampler (with a read-sized epoch order: shuffled blocks, then a buffer) and
  the in-order evaluation batches.
- loaders.py: `build_dataset` (a `ShardDataset` / `BenchmarkShardDataset` when the folder holds a shard index,
  `PascalContextDataset` / `NYUDDataset` for those layouts, `TaskonomyDataset` otherwise), `build_loader`,
  `set_epoch`, `eval_loader`.

Making data (offline tools, tools/make_data.py): `squad.data.synthetic` (the synthetic renderers) and
`squad.data.offline` (``pack`` into shards, ``stats`` against real Taskonomy, random test trees).

The names below are imported on first use (`squad.lazy.exports`): ``squad.data.accounting`` loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from squad.lazy import exports

_EXPORTS = {
    "DataReport": "squad.data.accounting",
    "report": "squad.data.accounting",
    "DATASETS": "squad.data.benchmark",
    "BenchmarkBase": "squad.data.benchmark",
    "DatasetTaskError": "squad.data.benchmark",
    "check_dataset_tasks": "squad.data.benchmark",
    "build_dataset": "squad.data.loaders",
    "build_loader": "squad.data.loaders",
    "eval_loader": "squad.data.loaders",
    "set_epoch": "squad.data.loaders",
    "NYUDDataset": "squad.data.nyud",
    "PascalContextDataset": "squad.data.pascal",
    "CorruptFileError": "squad.data.samples",
    "EmptyDatasetError": "squad.data.samples",
    "Pipeline": "squad.data.samples",
    "SampleDataset": "squad.data.samples",
    "collate": "squad.data.samples",
    "INDEX_NAME": "squad.data.shards",
    "BenchmarkShardDataset": "squad.data.shards",
    "ShardDataset": "squad.data.shards",
    "detect_dataset": "squad.data.shards",
    "is_shard_root": "squad.data.shards",
    "TaskonomyDataset": "squad.data.taskonomy",
    "find_split_csv": "squad.data.taskonomy",
    "make_data_hint": "squad.data.taskonomy",
    "read_raw": "squad.data.taskonomy",
    "read_split_csv": "squad.data.taskonomy",
    "SamplePipeline": "squad.data.transforms",
}

__all__ = [
    "BenchmarkBase", "BenchmarkShardDataset", "CorruptFileError", "DATASETS", "DataReport", "DatasetTaskError",
    "EmptyDatasetError", "INDEX_NAME", "NYUDDataset", "PascalContextDataset", "Pipeline", "SampleDataset",
    "SamplePipeline", "ShardDataset", "TaskonomyDataset", "build_dataset", "build_loader", "check_dataset_tasks",
    "collate", "detect_dataset", "eval_loader", "find_split_csv", "is_shard_root", "make_data_hint", "read_raw",
    "read_split_csv", "report", "set_epoch",
]

if TYPE_CHECKING:
    from squad.data.accounting import DataReport, report
    from squad.data.benchmark import (
        DATASETS,
        BenchmarkBase,
        DatasetTaskError,
        check_dataset_tasks,
    )
    from squad.data.loaders import (
        build_dataset,
        build_loader,
        eval_loader,
        set_epoch,
    )
    from squad.data.nyud import NYUDDataset
    from squad.data.pascal import PascalContextDataset
    from squad.data.samples import (
        CorruptFileError,
        EmptyDatasetError,
        Pipeline,
        SampleDataset,
        collate,
    )
    from squad.data.shards import (
        INDEX_NAME,
        BenchmarkShardDataset,
        ShardDataset,
        detect_dataset,
        is_shard_root,
    )
    from squad.data.taskonomy import (
        TaskonomyDataset,
        find_split_csv,
        make_data_hint,
        read_raw,
        read_split_csv,
    )
    from squad.data.transforms import SamplePipeline

__getattr__, __dir__ = exports(__name__, _EXPORTS)
