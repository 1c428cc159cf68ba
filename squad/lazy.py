"""Importing on first use, so that ``import squad`` and a tool's argument and config checks run without torch.

A tool refuses a config typo, a missing path or a locked run folder in a fraction of a second only if nothing on the
way imports torch (1.5–60 s, depending on the machine's load), DeepSpeed or timm. Two patterns keep it so:

- a package whose ``__init__`` re-exports names from its modules imports each one when it is first asked for
  (`exports`, PEP 562 ``__getattr__``): ``squad``, ``squad.io``, ``squad.data``;
- a module that needs torch only inside its functions binds ``torch = module("torch")`` (`LazyModule`): the real
  module is imported at the first attribute access. The tasks use it, since the config builds them to check heads and
  task options.

``python -X importtime -c "import squad"`` shows what an import costs; the tests assert on ``sys.modules`` (torch is
not loaded when a config error is reported), never on a time.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for a package whose public names are imported on first use.

    Args:
        package: the package's ``__name__``.
        names: each public name → the module that defines it.

    Returns:
        ``(__getattr__, __dir__)``, to bind at the package's top level. A name once imported is stored in the package,
        so later lookups are plain attribute reads.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


class LazyModule:
    """A stand-in for a module, imported at the first attribute access (``torch = LazyModule("torch")``).

    Only attribute access is deferred (``torch.zeros``, ``torch.Tensor`` in an ``isinstance``); annotations that name
    the module stay strings under ``from __future__ import annotations``. Use `no_grad` instead of the decorator
    ``@torch.no_grad()``, which would import torch when the class is defined.
    """

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # called only for names the stand-in itself lacks
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        loaded = "loaded" if self._name in sys.modules else "not loaded yet"
        return f"<lazy module {self._name!r} ({loaded})>"


def module(name: str) -> LazyModule:
    """The module ``name``, imported at its first attribute access (`LazyModule`)."""
    return LazyModule(name)


def no_grad(fn: Callable) -> Callable:
    """``torch.no_grad()`` as a decorator that imports torch only when ``fn`` is first called."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without its import of ``torch._dynamo`` (about 2 s of the start of
    every process, most of which never compile): torch's decorator only marks ``fn`` with this attribute, which dynamo
    reads when it meets the call (tests/test_compile.py checks that the public decorator marks a function the same
    way). Under ``torch.compile`` ``fn``'s result is taken as a constant at trace time."""
    fn._dynamo_marked_constant = True
    return fn
