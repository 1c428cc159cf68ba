"""One kernel launch as the traffic recorder counts it (`OpRecord`), and what the launches of squad's own custom ops
load (`SQUAD_OPS`): the recorder (`squad.bench.traffic`) sees an op's operands, these say what its kernels do with
them — the tiles' re-reads, the programs of the grid, the element-wise work on CUDA cores — from the tile configs
squad's kernels launch with (`squad.kernels.tiles`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass
class OpRecord:
    """One launched op: its aten name, FLOPs, bytes, kind (one of `KINDS`) and flags.

    Squad's Triton GEMMs also carry what their tiles do (module docstring, "tiles"): ``reloads``, one
    ``[bytes, extra reads, reuse distance in bytes]`` per operand the kernel's tiles read more than once (the
    operand's bytes, how many times more its tiles load it than `bytes` counts, and what the launch order touches
    between two loads of the same bytes); ``programs``, the programs of its grid that do work; ``cuda_core_ops``,
    element-wise operations it runs outside the tensor cores.
    """

    op: str
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    sync: bool = False
    atomic: bool = False
    pin: bool = False
    kind: str = "memory"
    dtype: str = ""
    reloads: list = dataclasses.field(default_factory=list)
    programs: int = 0
    cuda_core_ops: float = 0.0

    @property
    def tile_bytes(self) -> float:
        """Bytes its tiles load and store with no cache between them: `bytes` plus every re-read."""
        return self.bytes + sum(size * extra for size, extra, _ in self.reloads)

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def matmul(self) -> bool:
        """Whether the op does arithmetic worth counting (a GEMM or an attention kernel); setting it True makes a
        memory op a GEMM (what a custom op's pricing says)."""
        return self.kind != "memory"

    @matmul.setter
    def matmul(self, value: bool) -> None:
        if value and self.kind == "memory":
            self.kind = "gemm"
        elif not value:
            self.kind = "memory"


def logical_bytes(t: torch.Tensor) -> float:
    """Bytes of the distinct elements a tensor view addresses (an expanded, stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return float(n * t.element_size()) if t.numel() else 0.0


def distinct_bytes(tensors: Sequence[torch.Tensor | None]) -> float:
    seen: set[int] = set()
    total = 0.0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += logical_bytes(t)
    return total


# ------------------------------------------------------------------------------ squad's own custom ops
# The grouped GEMMs of the routed layers (`squad.kernels.grouped`) are one launch each: their FLOPs are the
# multiply-adds of every sorted row (rows past the last group, zero-filled, counted too: an upper bound), and an
# input read through a row index (a token's row gathered once per slot) is counted once per row that reads it, the
# traffic a GPU pays when the gathered rows miss in cache.
#
# What their tiles load beyond that (`OpRecord.reloads`) comes from each kernel's tile config and grid, read from
# squad.kernels as the kernels read them: a program computes one [BLOCK_M, BLOCK_N] output tile, so it loads its
# rows' input once per N tile of the output and its weight tile once per row tile; ``program_id(0)`` is the fastest
# index of the launch order (CUDA starts blocks in linear order, x first), so with the row tiles on axis 0 the
# input is re-read one whole pass over every row tile later, unless the config names a grouped launch order
# (``order: "grouped"`` with ``GROUP_M``, Triton's L2-swizzled matmul: GROUP_M row tiles run over every N tile
# before the next rows start; ``"heads_inner"``: a row tile's heads run one after another), which re-reads it a few
# row tiles later.


def _launch_group(config: dict) -> int | None:
    """Row tiles a grouped launch order runs together over every N tile (or every head): the config's ``GROUP_M``
    under ``order: "grouped"`` (or any GROUP_M > 1), 1 under ``"heads_inner"``; None for the plain walk (the row tiles
    of one N tile all run before the next N tile's)."""
    order, group = config.get("order"), int(config.get("GROUP_M") or 1)
    if order == "heads_inner":
        return 1
    if order == "grouped" or group > 1:
        return group
    return None


def _gemm_reloads(a_bytes: float, w_bytes: float, out_bytes: float, tiles_m: int, tiles_n: int, weights: int,
                  group_m: int | None, a_distinct: float | None = None) -> list[list[float]]:
    """Re-reads of a GEMM launched on a (row tiles, N tiles) grid, row tiles first: the input (``a_bytes`` as its
    tiles read it, ``a_distinct`` the distinct bytes behind them when rows are gathered) once per N tile past the
    first; each of ``weights`` weights (one per expert or head; a dense weight is 1) once per row tile past its
    first. Reuse distances, in distinct bytes (what decides whether a line is still in L2): the row-tile walk
    touches the whole input, an N tile's share of the weights and of the output between two reads of the same
    input rows; a grouped walk (``group_m`` row tiles) touches those row tiles' inputs and outputs and one weight."""
    a_distinct = a_bytes if a_distinct is None else min(a_bytes, a_distinct)
    grouped = group_m is not None
    group = min(max(group_m or 1, 1), tiles_m)
    swept = (a_distinct + out_bytes) * group / tiles_m + w_bytes / weights  # a row-tile group over every N tile
    out = []
    if tiles_n > 1:
        far = a_distinct + (w_bytes + out_bytes) / tiles_n
        out.append([a_bytes, float(tiles_n - 1), swept if grouped else far])
    if tiles_m > weights:
        near = (a_bytes + out_bytes / tiles_n) / tiles_m + w_bytes / weights / tiles_n  # the next row tile's
        out.append([w_bytes, (tiles_m - weights) / weights, swept if grouped else near])
    return out


def _row_tiles(rows: int, block: int, groups: int = 1) -> int:
    """Row tiles with work: every group's last tile may be partial (at most one more tile a group boundary)."""
    return -(-rows // block) + (groups - 1 if groups > 1 else 0)


def _rows_read(t: torch.Tensor, rows: torch.Tensor | None) -> float:
    """Bytes of ``t`` as read through ``rows`` (each indexed row once per index), or once when not indexed."""
    if rows is None:
        return logical_bytes(t)
    return float(rows.numel() * t.shape[1] * t.element_size())


def _price_grouped_mm(record: OpRecord, args: Sequence) -> None:
    from squad.kernels.grouped import mm_config

    a, a_rows, w, rows = args[0], args[1], args[2], args[8]
    g, k, n = w.shape
    record.matmul = True
    record.flops = 2.0 * rows * k * n
    record.bytes_read += _rows_read(a, a_rows) - logical_bytes(a)
    config = mm_config(k, n, a.dtype)
    tiles_m, tiles_n = _row_tiles(rows, config["BLOCK_M"], g), -(-n // config["BLOCK_N"])
    item = a.element_size()
    record.reloads = _gemm_reloads(rows * k * item, g * k * n * item, rows * n * item, tiles_m, tiles_n, g,
                                   _launch_group(config), logical_bytes(a))
    record.programs = tiles_m * tiles_n


def _price_grouped_wgrad(record: OpRecord, args: Sequence) -> None:
    """One program per (group, dW tile) loops over its group's rows: A's K slice is read once per N tile, B's N
    slice once per K tile. The grid is (groups, dW tiles), groups first: between two reads of a slice every group's
    rows pass for one dW tile (A's slice again after one such pass, B's after a row of N tiles)."""
    from squad.kernels.grouped import wgrad_config

    a, a_rows, b, b_rows, ends = args[0], args[1], args[2], args[3], args[5]
    rows = (a_rows if a_rows is not None else a).shape[0]
    k, n, g = a.shape[1], b.shape[1], ends.shape[0]
    record.matmul = True
    record.flops = 2.0 * rows * k * n
    record.bytes_read += _rows_read(a, a_rows) - logical_bytes(a) + _rows_read(b, b_rows) - logical_bytes(b)
    config = wgrad_config(k, n, a.dtype)
    tiles_k, tiles_n = -(-k // config["BLOCK_K"]), -(-n // config["BLOCK_N"])
    a_bytes, b_bytes = rows * k * a.element_size(), rows * n * b.element_size()
    a_distinct, b_distinct = min(a_bytes, logical_bytes(a)), min(b_bytes, logical_bytes(b))
    distinct = a_distinct / tiles_k + b_distinct / tiles_n
    grouped = _launch_group(config) is not None  # a grouped order runs one group's dW tiles together
    near = (a_distinct + b_distinct) / g  # one group's rows over every dW tile
    record.reloads = [[a_bytes, float(tiles_n - 1), near if grouped else distinct],
                      [b_bytes, float(tiles_k - 1), near if grouped else tiles_n * distinct]]
    record.reloads = [r for r in record.reloads if r[1] > 0]
    record.programs = g * tiles_k * tiles_n


def _nested_groups(groups: Sequence[int]) -> list[tuple[int, int]]:
    """(rows, width) of each group of a ``squad::nested_*`` op (its host ints [ends..., widths...])."""
    g = len(groups) // 2
    ends, widths = list(groups[:g]), list(groups[g:])
    return [(end - first, w) for first, end, w in zip([0, *ends[:-1]], ends, widths, strict=True)]


def _price_nested_linear(record: OpRecord, args: Sequence) -> None:
    """A nested projection reads the first w features of a token's row (input projections) or computes only the
    first w output features (output projections; with the residual read and written whole, or in place only there).
    Its FLOPs are what the kernel's tiles execute: w rounded up to its K tile (input) or N tile (output)."""
    from squad.kernels.nested import nested_config

    a, w, groups = args[0], args[1], _nested_groups(args[4])
    in_mode = len(args) == 11 and args[6] == "in"
    item = a.element_size()
    n_out, k = w.shape  # a may be [T, K], [T / R, R, K] or [T / R, R, H, K / H]
    config = nested_config(k, n_out, a.dtype)
    record.matmul = True
    if in_mode:
        tile = config["BLOCK_K"]
        record.flops = sum(2.0 * n * -(-width // tile) * tile * n_out for n, width in groups)
        record.bytes_read += sum(n * width for n, width in groups) * item - logical_bytes(a)
    else:
        tile = config["BLOCK_N"]
        record.flops = sum(2.0 * n * k * min(n_out, -(-width // tile) * tile) for n, width in groups)
    if len(args) == 7:  # in place (nested_linear_): only each group's first w features of the residual
        residual = args[5]
        touched = sum(n * width for n, width in groups) * residual.element_size()
        record.bytes_read += touched - logical_bytes(residual)
        record.bytes_written += touched - logical_bytes(residual)
    # tiles: (row tiles, N tiles), row tiles first; an output projection's N tiles stop at each group's width
    rows = sum(n for n, _ in groups)
    block_n = config["BLOCK_N"]
    tiles_n = (-(-n_out // block_n) if in_mode else
               max(1, round(sum(n * -(-min(n_out, width) // block_n) for n, width in groups) / max(rows, 1))))
    tiles_m = _row_tiles(rows, config["BLOCK_M"], len(groups))
    a_bytes = sum(n * width for n, width in groups) * item if in_mode else rows * k * item
    out_bytes = rows * n_out * item if in_mode else sum(n * width for n, width in groups) * item
    record.reloads = _gemm_reloads(a_bytes, n_out * k * w.element_size(), out_bytes, tiles_m, tiles_n, 1,
                                   _launch_group(config))
    record.programs = tiles_m * tiles_n


def _price_nested_norm(record: OpRecord, args: Sequence) -> None:
    """A nested layer norm reads every feature and writes each token's first w."""
    x, groups = args[0], _nested_groups(args[6])
    record.bytes_written = sum(n * width for n, width in groups) * x.element_size()


def _price_nested_mlp(record: OpRecord, args: Sequence) -> None:
    """MoNE's fused MLP sublayer: the FLOPs its tiles execute (`squad.kernels.nested.nested_mlp_flops`: each token's
    width rounded up to the kernel's K tile and output chunk, every hidden feature); every row read whole (the layer
    norm's statistics), only each token's first w features written."""
    from squad.kernels.nested import nested_mlp_config, nested_mlp_flops

    x, w1, groups = args[0], args[4], list(args[9])
    config = nested_mlp_config(x.shape[1], w1.shape[0], x.dtype)
    record.matmul = True
    if config is None:  # the op runs its reference there: price the useful work
        config = {"BLOCK_K": 1, "BLOCK_W": 1}
        record.flops = nested_mlp_flops(groups, w1.shape[0], config)
        record.bytes_written = sum(n * width for n, width in _nested_groups(groups)) * x.element_size()
        return
    record.flops = nested_mlp_flops(groups, w1.shape[0], config)
    sizes = _nested_groups(groups)
    record.bytes_written = sum(n * width for n, width in sizes) * x.element_size()
    d, hidden = x.shape[1], w1.shape[0]
    # tiles: one program per row tile, each loading all of W1 and W2 (every hidden chunk): the weights re-read once
    # per row tile, the next row tile's loads a weight pass later (2 · D · H elements; they stay in L2)
    tiles_m = _row_tiles(sum(n for n, _ in sizes), config["BLOCK_M"], len(sizes))
    w_bytes = 2.0 * d * hidden * w1.element_size()
    record.reloads = [[w_bytes, float(tiles_m - 1), w_bytes]] if tiles_m > 1 else []
    record.programs = tiles_m
    record.cuda_core_ops = sum(n * nested_mlp_row_ops(width, d, hidden, config) for n, width in sizes)


NORM_STATS_OPS = 6  # per feature, both statistics passes: convert, add (mean); convert, subtract, mask, FMA (variance)
NORMALISE_OPS = 6  # per feature: convert, subtract, two multiplies and an add ((x - μ)·rstd·γ + β), round to 16 bits
GELU_OPS = 23  # per hidden feature: bias add, exact GELU 0.5·x·(1 + erf(x/√2)) (erf ≈ 15 instructions), round
RESIDUAL_OPS = 5  # per output feature: bias, residual load convert, scale FMA, round


def nested_mlp_row_ops(width: int, d: int, hidden: int, config: dict) -> float:
    """Element-wise operations the fused MoNE MLP kernel runs on CUDA cores for one token of width ``width``: the
    norm statistics over all D features once, the normalisation of the token's first w features once per hidden
    chunk (BLOCK_H wide; the kernel normalises as it loads each K tile of the first projection, whose loop runs once
    per chunk), GELU on every hidden feature, the residual add of the w output features. A config that says
    ``NORM_ONCE`` (normalised row kept across chunks) normalises once."""
    k, block_w = config["BLOCK_K"], config["BLOCK_W"]
    chunks = 1 if config.get("NORM_ONCE") else -(-hidden // config["BLOCK_H"])
    return (NORM_STATS_OPS * d + NORMALISE_OPS * chunks * -(-width // k) * k + GELU_OPS * hidden
            + RESIDUAL_OPS * -(-width // block_w) * block_w)


def _price_row_norm(record: OpRecord, args: Sequence) -> None:
    """A layer norm of selected rows (`squad.kernels.rows`) reads only the rows its index names."""
    x, index = args[0], args[1]
    if index is not None:
        record.bytes_read += index.numel() * x.shape[2] * x.element_size() - logical_bytes(x)


def _price_row_scatter_lerp(record: OpRecord, args: Sequence) -> None:
    """A MoD block's write-back writes the indexed rows of x and never reads x."""
    x, index = args[0], args[1]
    record.bytes_read -= logical_bytes(x)
    record.bytes_written = index.numel() * x.shape[2] * x.element_size()


def _price_head_select_mm(record: OpRecord, args: Sequence) -> None:
    """MoE attention's all-head GEMM (`squad.kernels.heads`): every head's product is computed (2·M·K·E·d) and only
    the selected heads written; each operand read once (the slot map, the gates and the compact rows too)."""
    from squad.kernels.heads import select_config

    a, w, slots = args[0], args[1], args[2]
    record.matmul = True
    record.flops = 2.0 * a.shape[0] * a.shape[1] * w.shape[0] * w.shape[2]
    # grid (row tiles, heads), row tiles first: the input re-read once per head
    m, e = a.shape[0], w.shape[0]
    config = select_config(w.shape[1], w.shape[2], a.dtype)
    item = a.element_size()
    tiles_m = -(-m // config["BLOCK_M"])
    out_bytes = logical_bytes(slots) + m * args[3] * w.shape[2] * item
    record.reloads = _gemm_reloads(m * a.shape[1] * item, logical_bytes(w), out_bytes, tiles_m, e, e,
                                   _launch_group(config))
    record.programs = tiles_m * e


def _price_head_gather_mm(record: OpRecord, args: Sequence) -> None:
    """The GEMM over the virtual [M, E·d] operand (2·M·E·d·N, plus 2·M·K2·N for the dense second operand): the
    compact [M, k, d] rows read once."""
    from squad.kernels.heads import gather_config

    c, slots, gates, w, a2, w2 = args[0], args[1], args[2], args[3], args[4], args[5]
    record.matmul = True
    record.flops = 2.0 * c.shape[0] * w.shape[0] * w.shape[1] * w.shape[2]
    if a2 is not None:
        record.flops += 2.0 * a2.shape[0] * a2.shape[1] * w.shape[2]
    # grid (row tiles, N tiles), row tiles first: a row tile's compact rows, slots, gates and a2 once per N tile
    m, n = c.shape[0], w.shape[2]
    config = gather_config(n, w.shape[1], a2.shape[1] if a2 is not None else 16, c.dtype)
    rows_bytes = distinct_bytes([c, slots, gates, a2])
    weights = distinct_bytes([w, w2])
    tiles_m, tiles_n = -(-m // config["BLOCK_M"]), -(-n // config["BLOCK_N"])
    record.reloads = _gemm_reloads(rows_bytes, weights, m * n * c.element_size(), tiles_m, tiles_n, 1,
                                   _launch_group(config))
    record.programs = tiles_m * tiles_n


def _price_head_wgrad(record: OpRecord, args: Sequence) -> list[OpRecord]:
    """The weight gradient through the virtual operand: 2·M·E·d·N, on a grid (heads, N tiles, row chunks), heads
    fastest (order ``rows_split``, `squad.kernels.tiles`). Inside a chunk b's N slice is read once per head (the
    heads of one N tile run side by side: a chunk's N slice of b apart) and the compact rows and slots once per N
    tile (a pass over the chunk apart). Several chunks write float32 partials that a second kernel reads and sums
    into the results (the returned follow-up record); one chunk writes the results."""
    from squad.kernels.heads import wgrad_config
    from squad.kernels.tiles import split_rows

    c, slots, gates, b, heads = args[0], args[1], args[2], args[3], args[4]
    m, d, n = c.shape[0], c.shape[2], b.shape[1]
    record.matmul = True
    record.flops = 2.0 * m * heads * d * n
    config = wgrad_config(m, heads, n, d, c.dtype)
    _, splits = split_rows(m, config["BLOCK_M"], int(config.get("splits", 1)))
    tiles_n = -(-n // config["BLOCK_N"])
    rows_bytes, b_bytes = distinct_bytes([c, slots, gates]), logical_bytes(b)
    one_pass = (rows_bytes + b_bytes / tiles_n) / splits
    record.reloads = [[b_bytes, float(heads - 1), (b_bytes / tiles_n + rows_bytes / heads) / splits]]
    if tiles_n > 1:
        record.reloads.append([rows_bytes, float(tiles_n - 1), one_pass])
    record.programs = heads * tiles_n * splits
    if splits == 1:
        return []
    results = record.bytes_written  # dw (and db)
    partials = splits * (heads * d * n + (n if args[6] else 0)) * 4.0  # float32
    record.bytes_written = partials
    return [OpRecord("head_wgrad_sum", bytes_read=partials, bytes_written=results, dtype=record.dtype)]


SQUAD_OPS: dict[str, Callable[[OpRecord, Sequence], list[OpRecord] | None]] = {
    "head_select_mm": _price_head_select_mm,
    "head_gather_mm": _price_head_gather_mm,
    "head_wgrad": _price_head_wgrad,
    "grouped_mm": _price_grouped_mm,
    "grouped_wgrad": _price_grouped_wgrad,
    "nested_linear": _price_nested_linear,
    "nested_linear_": _price_nested_linear,
    "nested_norm": _price_nested_norm,
    "nested_mlp_": _price_nested_mlp,
    "row_norm": _price_row_norm,
    "row_scatter_lerp_": _price_row_scatter_lerp,
}
"""Pricing of ``squad::`` custom ops by their name (the ops' schemas: `squad.kernels.grouped`): each sets the op's
record and may return the records of kernels the op launches after it."""
