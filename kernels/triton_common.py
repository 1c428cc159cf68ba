"""What every Triton kernel file of squad shares: the interpreter test and the wrapping of kernel bodies.

Kernel bodies are plain functions wrapped at first use for the compiler (`JITFunction`) or for Triton's CPU
interpreter (`InterpretedFunction`), following the mode Triton itself was imported in; device helpers the kernels
call are wrapped the same way at import (`device_function`), and the compiler inlines them. The helpers the grouped
and nested kernels share live here: exact GELU and its derivative, the row-tile → group lookup and the grouped
launch order.
"""

from __future__ import annotations

import triton.language as tl
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


@device_function
def gelu(x):
    """Exact GELU (erf form, as `torch.nn.functional.gelu`) of an fp32 tile."""
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@device_function
def gelu_grad(x):
    """d gelu(x) / dx = Φ(x) + x · φ(x) of an fp32 tile."""
    return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)


@device_function
def grouped_order(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Program id → (row tile, N tile) in grouped launch order (the ``"grouped"`` order of `squad.kernels.tiles`):
    programs come in groups of GROUP_M row tiles × every N tile, row tiles fastest inside a group, so a group's input
    rows and each N column's weight tile are reused from L2 by the programs running beside them. GROUP_M = 1: a row
    tile's N tiles one after another."""
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % size_m
    tile_n = (pid % per_group) // size_m
    return tile_m, tile_n


@device_function
def tile_group(tile, ENDS, G, R, BLOCK_M: tl.constexpr):
    """Row tile → (group, first row, end row): tiles are numbered group by group, each group's rows cut into
    BLOCK_M-row tiles; group G is the tail of rows past the last group (its output is zero). (-1, 0, 0) past the last
    tile."""
    grp = -1
    first = 0
    end = 0
    seen = 0  # tiles of the groups before g
    prev = 0  # first row of group g
    for g in range(G + 1):
        e = tl.where(g < G, tl.load(ENDS + tl.minimum(g, G - 1)), R)
        n = tl.cdiv(e - prev, BLOCK_M)
        hit = (tile >= seen) & (tile < seen + n)
        grp = tl.where(hit, g, grp)
        first = tl.where(hit, prev + (tile - seen) * BLOCK_M, first)
        end = tl.where(hit, e, end)
        seen += n
        prev = e
    return grp, first, end
