"""Tile configurations of squad's Triton GEMM kernels: one home for what a kernel's wrapper launches with and what a
cost model reads.

Each ``*_config`` returns a dict of three kinds of entries:

- the kernel's block sizes, as its constexprs name them (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ...; powers of two
  >= 16);
- ``GROUP_M`` where the launch is grouped (below): how many row tiles form one group;
- launch settings in lower case, which the wrapper takes out before the launch (`launch_settings`): ``num_warps``,
  ``num_stages`` and ``order``, the **launch order** — which tiles run one after another, and so which operand tiles
  a cost model may count as found in L2 rather than loaded again:

  - ``"grouped"``: programs are numbered in groups of ``GROUP_M`` row tiles; inside a group every N tile of those
    row tiles runs before the next group starts (Triton's grouped ordering, an L2 swizzle). The input rows of a
    group are read from HBM once and reused by its N tiles while they are hot; the weight tile of an N column is
    reused by the group's row tiles.
  - ``"heads_inner"``: one program per (row tile, head), the heads of a row tile numbered consecutively: the row
    tile's input is read once and served from L2 to every head's program.
  - ``"rows_looped"``: one program per output tile (per group or head), each looping over all its rows
    (weight-gradient kernels); programs of the same rows are numbered group- or head-fastest, so they sweep the rows
    together.
  - ``"rows_split"``: one program per (output tile, row chunk): the rows cut into ``splits`` chunks of whole row
    tiles (`split_rows`), each program reducing its chunk into a float32 partial tile, then a second kernel summing
    the partials in chunk order (deterministic, no atomics; ``splits`` = 1: the one partial is the result, no second
    kernel). Programs of one chunk are numbered consecutively (heads fastest, then N tiles), so a chunk's rows are
    read from HBM once and served from L2 to every output tile's program.
  - ``"rows_outer"``: (MoNE's kernels) one program per row tile, looping over the output features inside.

Nothing here imports Triton: the wrappers (`grouped`, `heads`, `nested`) and the kernel files (`triton_*`) both
import from this file, and it from nothing of theirs.
"""

from __future__ import annotations

import math

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # operand dtypes the Triton kernels take
LAUNCH_KEYS = ("num_warps", "num_stages", "order", "splits")  # a config's launch settings (the rest: constexprs)
WAVE_SMS = 132  # SMs of the GPU the split launches are sized for (an H100 SXM, an H200)
SPLIT_WAVES = 8  # waves of WAVE_SMS programs a ``rows_split`` launch aims at (2-3 of resident blocks at 3 a SM)
SPLIT_MIN_TILES = 32  # row tiles a chunk holds at least: its float32 partial tile's store and sum stay small
#                       against its loads and its MMA (2,048 rows of 16-bit tiles: ~1/20 of its bytes, 1/8 of its time)


def pow2_block(size: int, cap: int) -> int:
    """A power of two >= 16 covering ``size``, at most ``cap``."""
    return max(16, min(cap, 1 << max(size - 1, 0).bit_length()))


def launch_settings(config: dict) -> tuple[dict, dict]:
    """(the kernel's constexprs, Triton's launch options) of a config: ``order`` and ``splits`` are the wrapper's
    business and dropped here; ``GROUP_M`` defaults to 1 (rows fastest) where a kernel takes it and a hand-made config
    leaves it out."""
    cfg = dict(config)
    launch = {k: cfg.pop(k) for k in LAUNCH_KEYS if k in cfg}
    launch.pop("order", None)
    launch.pop("splits", None)
    return cfg, launch


def row_splits(rows: int, block_m: int, programs: int) -> int:
    """Chunks to cut ``rows`` into for a ``rows_split`` launch of ``programs`` output tiles: enough for SPLIT_WAVES
    waves of WAVE_SMS programs, each chunk at least SPLIT_MIN_TILES row tiles (1 for a small problem)."""
    wanted = -(-SPLIT_WAVES * WAVE_SMS // max(programs, 1))
    return max(1, min(wanted, -(-rows // block_m) // SPLIT_MIN_TILES))


def split_rows(rows: int, block_m: int, splits: int) -> tuple[int, int]:
    """(rows a chunk holds, chunks) when ``rows`` are cut into at most ``splits`` chunks of whole BLOCK_M-row tiles:
    every chunk but the last full, none empty (one chunk of nothing for no rows)."""
    tiles = -(-rows // block_m)
    chunk = max(1, -(-tiles // max(splits, 1))) * block_m
    return chunk, max(1, -(-rows // chunk))


# ------------------------------------------------------------------------------------ grouped expert GEMMs
def mm_config(k: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_grouped._grouped_mm_kernel` for a [*, K] × [K, N] product of ``dtype``: 128×128×32 tiles for 16-bit
    operands (64×64×32 for float32), narrower where N or K is; grouped launch order, 8 row tiles a group. Block sizes
    fit the 99 KiB of shared memory of an sm_86/sm_89 block (checked by compiling for sm_80 in the tests)."""
    wide = dtype == torch.float32
    return {"BLOCK_M": 64 if wide else 128, "BLOCK_N": pow2_block(n, 64 if wide else 128),
            "BLOCK_K": pow2_block(k, 32), "GROUP_M": 8, "num_warps": 4 if wide else 8,
            "num_stages": 2 if wide else 3, "order": "grouped"}


def wgrad_config(k: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_grouped._grouped_wgrad_kernel` for a [K, N] gradient: one program per (group, dW tile) looping over
    the group's rows BLOCK_M at a time."""
    wide = dtype == torch.float32
    return {"BLOCK_M": 32, "BLOCK_K": pow2_block(k, 64 if wide else 128),
            "BLOCK_N": pow2_block(n, 64 if wide else 128), "num_warps": 4 if wide else 8,
            "num_stages": 2 if wide else 3, "order": "rows_looped"}


def gate_tiles(n: int, dtype: torch.dtype) -> int:
    """Columns of the gate-gradient partial sums ``squad::grouped_mm``'s ``gate_grad`` returns for an output width N
    (one per N tile)."""
    return math.ceil(n / mm_config(1, n, dtype)["BLOCK_N"])


# ---------------------------------------------------------------------------------- MoE attention's heads
def select_config(k: int, d: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_heads._head_select_kernel` for an [M, K] × [K, d] product per head: one program per (row tile,
    head), the heads of a row tile consecutive."""
    wide = dtype == torch.float32
    return {"BLOCK_M": 64 if wide else 128, "BLOCK_D": pow2_block(d, 128), "BLOCK_K": pow2_block(k, 32 if wide else 64),
            "num_warps": 4 if wide else 8, "num_stages": 2 if wide else 3, "order": "heads_inner"}


def gather_config(n: int, d: int, k2: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_heads._head_gather_kernel`: K stepped one head (d features) at a time, then the dense K2 operand;
    grouped launch order."""
    wide = dtype == torch.float32
    return {"BLOCK_M": 64 if wide else 128, "BLOCK_N": pow2_block(n, 64 if wide else 128),
            "BLOCK_D": pow2_block(d, 128), "BLOCK_K": pow2_block(k2, 32), "GROUP_M": 8, "num_warps": 4 if wide else 8,
            "num_stages": 2, "order": "grouped"}


def head_wgrad_config(m: int, e: int, n: int, d: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_heads._head_wgrad_kernel` for E heads' [d, N] gradients over M rows: one program per (head, N tile,
    row chunk), ``splits`` chunks (`row_splits`: modsquad_vit_b's 30,732 rows × 24 heads × 6 N tiles in bf16 take 8,
    1,152 programs, where one program per output tile looping over every row launched 144 on 132 SMs)."""
    wide = dtype == torch.float32
    cfg = {"BLOCK_M": 32 if wide else 64, "BLOCK_D": pow2_block(d, 128), "BLOCK_N": pow2_block(n, 64 if wide else 128),
           "num_warps": 4 if wide else 8, "num_stages": 2 if wide else 3, "order": "rows_split"}
    cfg["splits"] = row_splits(m, cfg["BLOCK_M"], e * -(-n // cfg["BLOCK_N"]))
    return cfg


# ---------------------------------------------------------------------------------------- MoNE's kernels
MLP_MAX_CHUNKS = 8  # the fused MLP kernel's output accumulators (`triton_nested_mlp.MAX_CHUNKS`)


def nested_config(k: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    """`triton_nested`'s projection kernel (as `mm_config`, without the grouped order)."""
    wide = dtype == torch.float32
    return {"BLOCK_M": 64 if wide else 128, "BLOCK_N": pow2_block(n, 64 if wide else 128),
            "BLOCK_K": pow2_block(k, 32), "num_warps": 4 if wide else 8, "num_stages": 2 if wide else 3,
            "order": "rows_outer"}


def nested_mlp_config(d: int, hidden: int, dtype: torch.dtype) -> dict[str, object] | None:
    """`triton_nested_mlp`'s fused MLP kernel for width D and hidden width H: output features in chunks of BLOCK_W
    (64, or 128 past 8 · 64), first-projection K tiles of 64 features in 16-bit (32 in float32; a token of width w
    reads its width rounded up to the tile). None where D exceeds 8 chunks of 128 (no fused kernel)."""
    block_w = 64 if d <= MLP_MAX_CHUNKS * 64 else 128
    if d > MLP_MAX_CHUNKS * block_w:
        return None
    wide = dtype == torch.float32
    return {"BLOCK_M": 32 if wide else 64, "BLOCK_H": pow2_block(hidden, 64),
            "BLOCK_K": pow2_block(d, 32 if wide else 64), "BLOCK_W": block_w, "W_CHUNKS": -(-d // block_w),
            "num_warps": 4 if wide else 8, "num_stages": 2, "order": "rows_outer"}
