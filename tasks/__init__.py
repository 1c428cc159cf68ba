"""The 13 Taskonomy tasks (installed as `squad.tasks`): decoding, targets, heads, masked losses and metrics.

Use `get_task(name)` (aliases accepted) and `TASK_NAMES`; `squad.tasks.base` documents the interface and the calling
convention shared by the model, the data pipeline and the training engine.
"""

from .base import DecodeError, Task
from .classification import ClassTask
from .depth import DepthTask
from .normal import NormalTask
from .registry import ALIASES, TASK_NAMES, canonical_name, get_task, register_task, resolve_task_names, unregister_task
from .scalar import SCALAR_SPECS, ScalarSpec, ScalarTask

__all__ = [
    "ALIASES", "SCALAR_SPECS", "TASK_NAMES", "ClassTask", "DecodeError", "DepthTask", "NormalTask", "ScalarSpec",
    "ScalarTask", "Task", "canonical_name", "get_task", "register_task", "resolve_task_names", "unregister_task",
]
