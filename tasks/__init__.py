"""The tasks (installed as `squad.tasks`): decoding, targets, heads, masked losses and metrics.

The 13 Taskonomy tasks (`TASK_NAMES`) and PASCAL-Context's and NYUD-v2's (`PASCAL_TASKS`, `NYUD_TASKS`; modules
`segmentation` and `dense`). Use `get_task(name)` (aliases accepted; ``get_task(name, model.cfg.task_options)`` for
a model's configured task); `squad.tasks.base` documents the interface and the calling convention shared by the
model, the data pipeline and the training engine. `edges` scores boundaries as SEISM does (the edge task's odsF).
"""

from .base import DecodeError, Task
from .classification import ClassTask
from .dense import EdgeTask, NyudDepthTask, SaliencyTask, SurfaceNormalsTask
from .depth import DepthTask
from .normal import NormalTask
from .registry import (
    ALIASES,
    BENCHMARK_ALIASES,
    DENSE_LABEL_TASKS,
    NYUD_TASKS,
    PASCAL_TASKS,
    TASK_NAMES,
    TaskOptions,
    canonical_name,
    get_task,
    options_for,
    register_task,
    resolve_task_names,
    unregister_task,
)
from .scalar import SCALAR_SPECS, ScalarSpec, ScalarTask
from .segmentation import SegmentationTask

__all__ = [
    "ALIASES", "BENCHMARK_ALIASES", "DENSE_LABEL_TASKS", "NYUD_TASKS", "PASCAL_TASKS", "SCALAR_SPECS", "TASK_NAMES",
    "ClassTask", "DecodeError", "DepthTask", "EdgeTask", "NormalTask", "NyudDepthTask", "SaliencyTask", "ScalarSpec",
    "ScalarTask", "SegmentationTask", "SurfaceNormalsTask", "Task", "TaskOptions", "canonical_name", "get_task",
    "options_for", "register_task", "resolve_task_names", "unregister_task",
]
