"""What every Triton kernel file of squad shares: the interpreter test and the wrapping of kernel bodies.

Kernel bodies are plain functions wrapped at first use for the compiler (`JITFunction`) or for Triton's CPU
interpreter (`InterpretedFunction`), following the mode Triton itself was imported in; device helpers the kernels
call are wrapped the same way at import (`device_function`), and the compiler inlines them.
"""

from __future__ import annotations

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from .device import triton_interpreting


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter.

    Triton reads TRITON_INTERPRET=1 when `triton.language` is first imported (and `import torch` imports it), building
    its library helpers for one mode; so the variable must be in the environment before Python imports torch.
    This reports the mode Triton actually runs in.
    """
    return triton_interpreting()


def device_function(fn):
    """``@triton.jit`` for a helper the kernels call, in the mode Triton was imported in (`interpreter_enabled`):
    a `JITFunction` the compiler inlines into the kernel, or an `InterpretedFunction` the interpreter calls."""
    return InterpretedFunction(fn) if interpreter_enabled() else JITFunction(fn)


def wrap_kernels(*fns) -> dict[str, object]:
    """The kernel bodies ``fns`` by name, wrapped for the compiler or the interpreter."""
    wrap = InterpretedFunction if interpreter_enabled() else JITFunction
    return {fn.__name__: wrap(fn) for fn in fns}
