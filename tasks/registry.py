"""The task registry: canonical names, command-line aliases, and plug-in registration.

The 13 Taskonomy tasks (`TASK_NAMES`) and the tasks of PASCAL-Context and NYUD-v2 (`PASCAL_TASKS`, `NYUD_TASKS`,
together `DENSE_LABEL_TASKS`; their short names in `BENCHMARK_ALIASES`) are built in; `register_task` adds more (a
new domain for router fine-tuning, say) in the style of LibMTL's plug-ins: a name, a factory returning a `Task`,
optional aliases.

Task options travel with what owns them, never through a process-wide setting: ``get_task(name)`` is the task
with its defaults; ``get_task(name, options)`` the task as a model configures it, ``options`` being the model's
``model.task_options`` (``{task name or alias: {option: value}}``, e.g. ``{"edge_occlusion": {"decode": "clip"}}``;
entries of other tasks are ignored); ``get_task(name, decode="clip")`` gives one task's options directly. A model
(`squad.models.vit.SquadViT.get_task`), its config (`ModelConfig.get_task`), the datasets built for it and its
evaluators each hold their own, so two models with different options decode and score side by side in one process.
Configured tasks are cached per (task, options): the same options give the same instance.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .base import Task
from .classification import ClassTask
from .dense import EdgeTask, NyudDepthTask, SaliencyTask, SurfaceNormalsTask
from .depth import DepthTask
from .normal import NormalTask
from .scalar import SCALAR_SPECS, ScalarTask, edge_occlusion_spec
from .segmentation import human_parts_task, nyud_semseg_task, semseg_task

TASK_NAMES: tuple[str, ...] = (
    "class_object", "class_scene", "depth_euclidean", "depth_zbuffer", "normal", "principal_curvature", "reshading",
    "edge_texture", "edge_occlusion", "keypoints2d", "keypoints3d", "segment_unsup2d", "segment_unsup25d",
)

ALIASES: dict[str, str] = {
    "object": "class_object",
    "scene": "class_scene",
    "depth": "depth_euclidean",
    "zdepth": "depth_zbuffer",
    "curvature": "principal_curvature",
    "edge2d": "edge_texture",
    "edge3d": "edge_occlusion",
    "segment2d": "segment_unsup2d",
    "segment25d": "segment_unsup25d",
}

# PASCAL-Context (the PASCAL_MT layout's five tasks) and NYUD-v2 (MTI-Net's four); normals and edge are shared
PASCAL_TASKS: tuple[str, ...] = ("semseg", "human_parts", "saliency", "normals", "edge")
NYUD_TASKS: tuple[str, ...] = ("nyud_semseg", "nyud_depth", "normals", "edge")
DENSE_LABEL_TASKS: tuple[str, ...] = ("semseg", "human_parts", "saliency", "normals", "edge", "nyud_semseg",
                                      "nyud_depth")
TASK_GROUPS: dict[str, tuple[str, ...]] = {"all": TASK_NAMES, "pascal_context": PASCAL_TASKS, "nyud": NYUD_TASKS}

# the public multi-task code's names (Multi-Task-Learning-PyTorch / M3ViT: "sal", "normals", "edge"), where they do
# not clash with Taskonomy's ("depth" and "normal" stay Taskonomy's)
BENCHMARK_ALIASES: dict[str, str] = {
    "sal": "saliency",
    "parts": "human_parts",
    "edges": "edge",
    "nyud_seg": "nyud_semseg",
}

_SPEC_BY_NAME = {spec.name: spec for spec in SCALAR_SPECS}
_BUILTIN: dict[str, Callable[..., Task]] = {
    "class_object": lambda **kw: ClassTask("class_object", **kw),
    "class_scene": lambda **kw: ClassTask("class_scene", **kw),
    "depth_euclidean": lambda: DepthTask("depth_euclidean"),
    "depth_zbuffer": lambda: DepthTask("depth_zbuffer"),
    "normal": NormalTask,
    **{name: (lambda spec=spec: ScalarTask(spec)) for name, spec in _SPEC_BY_NAME.items()},
    "edge_occlusion": lambda **kw: ScalarTask(edge_occlusion_spec(**kw)),  # decode="blur" | "clip", blur_sigma
    "semseg": semseg_task,
    "human_parts": human_parts_task,
    "saliency": SaliencyTask,  # beta2, loss="bce" | "balanced"
    "normals": SurfaceNormalsTask,
    "edge": EdgeTask,  # max_dist (0.0075 PASCAL-Context, 0.011 NYUD-v2), thresholds, pos_weight
    "nyud_semseg": nyud_semseg_task,
    "nyud_depth": NyudDepthTask,
}
_EXTRA: dict[str, Callable[..., Task]] = {}
_EXTRA_ALIASES: dict[str, str] = {}
_CACHE: dict[tuple[str, str], Task] = {}  # (canonical name, options as sorted JSON) → the instance

TaskOptions = Mapping[str, Mapping[str, Any]]
"""A model's ``model.task_options``: task name or alias → that task's options."""


def register_task(name: str, factory: Callable[..., Task], aliases: Iterable[str] = ()) -> None:
    """Adds a task to the registry.

    Args:
        name: canonical name; must not clash with an existing name or alias.
        factory: called with the options given to `get_task` (none by default); returns a `Task` whose `name`
            equals `name`.
        aliases: extra short names.

    Raises:
        ValueError: if the name or an alias is already taken.
    """
    taken = set(_BUILTIN) | set(_EXTRA) | set(ALIASES) | set(BENCHMARK_ALIASES) | set(_EXTRA_ALIASES)
    for n in (name, *aliases):
        if n in taken:
            raise ValueError(f"task name {n!r} is already registered")
    _EXTRA[name] = factory
    for a in aliases:
        _EXTRA_ALIASES[a] = name


def unregister_task(name: str) -> None:
    """Removes a task added by `register_task` (built-in tasks cannot be removed).

    Raises:
        ValueError: `name` is built in or was never registered.
    """
    if name not in _EXTRA:
        raise ValueError(f"task {name!r} was not added with register_task")
    del _EXTRA[name]
    for key in [k for k in _CACHE if k[0] == name]:
        del _CACHE[key]
    for alias in [a for a, c in _EXTRA_ALIASES.items() if c == name]:
        del _EXTRA_ALIASES[alias]


def canonical_name(name: str) -> str:
    """Resolves an alias to its canonical task name.

    Raises:
        ValueError: for an unknown name; the message lists the valid names and aliases.
    """
    key = name.strip()
    if key in _BUILTIN or key in _EXTRA:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in BENCHMARK_ALIASES:
        return BENCHMARK_ALIASES[key]
    if key in _EXTRA_ALIASES:
        return _EXTRA_ALIASES[key]
    names = ", ".join([*TASK_NAMES, *DENSE_LABEL_TASKS, *_EXTRA])
    aliases = ", ".join(f"{a}→{c}" for a, c in {**ALIASES, **BENCHMARK_ALIASES, **_EXTRA_ALIASES}.items())
    raise ValueError(f"unknown task {name!r}; valid names: {names}; aliases: {aliases}")


def options_for(name: str, options: TaskOptions | None) -> dict[str, Any]:
    """The options ``options`` (a model's ``task_options``) give task ``name``: its entries under the canonical name
    and under aliases, merged in the order given (empty when none names it).

    Raises:
        ValueError: an unknown task name in ``options`` (listing the valid ones).
    """
    canonical = canonical_name(name)
    out: dict[str, Any] = {}
    for key, opts in (options or {}).items():
        if canonical_name(str(key)) == canonical:
            out.update(dict(opts or {}))
    return out


def get_task(name: str, options: TaskOptions | None = None, /, **task_options: Any) -> Task:
    """Returns the task for a canonical name or alias, with its defaults or configured.

    Args:
        name: e.g. ``"depth"`` or ``"depth_euclidean"``.
        options: a model's task options (``model.task_options``: ``{task: {option: value}}``); only the entry of
            this task (under its name or an alias) is used. None: the defaults.
        **task_options: this task's options given directly, e.g. ``get_task("edge_occlusion", decode="clip")``;
            they override ``options``.

    Returns:
        The same instance for the same task and options (no options: the shared default instance).

    Raises:
        ValueError: for an unknown name (listing the valid ones) or options the task does not take.
    """
    canonical = canonical_name(name)
    chosen = {**options_for(canonical, options), **task_options}
    try:
        key = (canonical, json.dumps(chosen, sort_keys=True))
    except TypeError:  # options that JSON cannot hold (a callable, say): a fresh, uncached instance
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    factory = _EXTRA.get(canonical) or _BUILTIN[canonical]
    try:
        task = factory(**chosen)
    except TypeError as e:
        if not chosen:
            raise
        raise ValueError(f"task {canonical}: unsupported options {sorted(chosen)} ({e})") from e
    if task.name != canonical:
        raise ValueError(f"the factory registered for {canonical!r} built a task named {task.name!r}")
    if key is not None:
        _CACHE[key] = task
    return task


def check_task_options(options: TaskOptions | None) -> None:
    """Builds every task ``options`` configures, so that a bad name or option fails here (config validation).

    Raises:
        ValueError: an unknown task, or options its factory does not take (the factory's message names the option).
    """
    for name in options or {}:
        get_task(str(name), options)


def resolve_task_names(names: str | Iterable[str]) -> list[str]:
    """Canonical names of a task list, deduplicated, in the order given.

    Args:
        names: an iterable of names/aliases, or one string (comma-separated allowed); ``"all"`` stands for the 13
            Taskonomy tasks in `TASK_NAMES` order, ``"pascal_context"`` for `PASCAL_TASKS`, ``"nyud"`` for
            `NYUD_TASKS`.

    Raises:
        ValueError: for an unknown name or an empty list.
    """
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        expanded = TASK_GROUPS.get(n.strip()) or (canonical_name(n),)
        for c in expanded:
            if c not in out:
                out.append(c)
    if not out:
        raise ValueError("empty task list; give task names or 'all'")
    return out
