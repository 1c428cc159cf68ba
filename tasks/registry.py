"""The task registry: canonical names, command-line aliases, and plug-in registration.

The 13 Taskonomy tasks are built in; `register_task` adds more (a new domain for router fine-tuning, say) in the
style of LibMTL's plug-ins: a name, a factory returning a `Task`, optional aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .base import Task
from .classification import ClassTask
from .depth import DepthTask
from .normal import NormalTask
from .scalar import SCALAR_SPECS, ScalarTask

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

_SPEC_BY_NAME = {spec.name: spec for spec in SCALAR_SPECS}
_BUILTIN: dict[str, Callable[..., Task]] = {
    "class_object": lambda **kw: ClassTask("class_object", **kw),
    "class_scene": lambda **kw: ClassTask("class_scene", **kw),
    "depth_euclidean": lambda: DepthTask("depth_euclidean"),
    "depth_zbuffer": lambda: DepthTask("depth_zbuffer"),
    "normal": NormalTask,
    **{name: (lambda spec=spec: ScalarTask(spec)) for name, spec in _SPEC_BY_NAME.items()},
}
_EXTRA: dict[str, Callable[..., Task]] = {}
_EXTRA_ALIASES: dict[str, str] = {}
_CACHE: dict[str, Task] = {}


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
    taken = set(_BUILTIN) | set(_EXTRA) | set(ALIASES) | set(_EXTRA_ALIASES)
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
    _CACHE.pop(name, None)
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
    if key in _EXTRA_ALIASES:
        return _EXTRA_ALIASES[key]
    names = ", ".join([*TASK_NAMES, *_EXTRA])
    aliases = ", ".join(f"{a}→{c}" for a, c in {**ALIASES, **_EXTRA_ALIASES}.items())
    raise ValueError(f"unknown task {name!r}; valid names: {names}; aliases: {aliases}")


def get_task(name: str, **options) -> Task:
    """Returns the task for a canonical name or alias.

    Args:
        name: e.g. ``"depth"`` or ``"depth_euclidean"``.
        **options: passed to the task's factory, e.g. ``get_task("class_object", loss="mse")``; without options
            the same shared instance is returned on every call.

    Raises:
        ValueError: for an unknown name (listing the valid ones) or options the task does not take.
    """
    canonical = canonical_name(name)
    factory = _EXTRA.get(canonical) or _BUILTIN[canonical]
    if options:
        try:
            return factory(**options)
        except TypeError as e:
            raise ValueError(f"task {canonical}: unsupported options {sorted(options)} ({e})") from e
    if canonical not in _CACHE:
        task = factory()
        if task.name != canonical:
            raise ValueError(f"the factory registered for {canonical!r} built a task named {task.name!r}")
        _CACHE[canonical] = task
    return _CACHE[canonical]


def resolve_task_names(names: str | Iterable[str]) -> list[str]:
    """Canonical names of a task list, deduplicated, in the order given.

    Args:
        names: an iterable of names/aliases, or one string (comma-separated allowed); ``"all"`` stands for the 13
            Taskonomy tasks in `TASK_NAMES` order.

    Raises:
        ValueError: for an unknown name or an empty list.
    """
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        expanded = TASK_NAMES if n.strip() == "all" else (canonical_name(n),)
        for c in expanded:
            if c not in out:
                out.append(c)
    if not out:
        raise ValueError("empty task list; give task names or 'all'")
    return out
