"""What a piece of PyTorch code asks of a GPU, counted op by op on any machine: kernels, host syncs, atomic ops,
FLOPs and bytes read + written.

A `TrafficRecorder` (a `TorchDispatchMode`) sees every aten op that reaches a kernel, forward and backward alike,
and prices it from its operands' shapes and dtypes alone — nothing is timed, so the counts are exact and the same on
every machine. Code runs on the ``meta`` device at full size (no memory, no arithmetic: a ViT-B block at 12 images ×
13 tasks costs milliseconds to record) or on real tensors. With ``cuda_path=True`` (the default) what is recorded is
the path a GPU takes (`squad.bench.cuda_path`): squad's routed layers take their CUDA algorithm (`force_cuda_path`:
the forced `squad.kernels.device` predicate), ``F.scaled_dot_product_attention`` is the one fused flash kernel CUDA
runs (where the CPU and ``meta`` would form an N×N softmax), and on ``meta`` squad's Triton attention runs its real
wrappers with each launch recorded from its operands.

What counts as what:

- **kernel**: an op that launches work. Views, metadata ops and allocations without a fill (``empty``) launch
  nothing and move no bytes. squad's custom attention ops (``squad::triton_attention``...) count as one kernel each;
  `TrafficRecorder.launch` records a kernel that cannot run where the recording runs (a Triton launch on ``meta``).
- **bytes**: every distinct input tensor read once at its logical size (a stride-0 expanded dimension counts once),
  every output written once; an in-place op reads and writes its target. A gather (``gather``, ``index_select``,
  ``index``, ``take``, ``embedding``) reads its source only where it indexes it: one output's worth of the source
  (an indexed row once per index that reads it, as squad's own gathering GEMMs are priced), not the whole source.
  Real kernels may read an operand twice (a matmul's tiles) or fuse two ops: this is the traffic the op graph
  implies, the quantity that decides memory-bound kernels.
- **FLOPs**: 2·m·n·k for matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, grouped matmuls), 4·B·H·Nq·Nk·d for an
  attention forward and 10·B·H·Nq·Nk·d for a flash backward (squad's two-kernel Triton backward: 14, see
  `_squad_attention`), convolution by its output; element-wise work is not counted as FLOPs (it is priced by its
  bytes).
- **kind**: ``gemm`` (cuBLAS: matmuls, convolutions), ``grouped_gemm`` (the library's grouped GEMM,
  ``aten::_grouped_mm`` / ``F.grouped_mm``, CUTLASS), ``squad_gemm`` (squad's own Triton GEMMs: grouped, head and
  nested ops), ``attention`` (PyTorch's fused attention), ``triton`` (squad's attention kernels; the CPU's
  ``chunked_attention`` stands for the Triton op CUDA runs there) or ``memory`` (everything else: element-wise,
  reductions, copies, gathers) — what `squad.bench.costmodel` prices at different rates.
- **tiles** (squad's Triton GEMMs): what the kernel's tiles load beyond the op's bytes, read from its tile config
  (`OpRecord.reloads`: an operand re-read once per tile of the other dimension, with the bytes the launch order
  touches between two reads of it, which decides whether the re-read hits L2), its programs (the wave term) and the
  element-wise work it does on CUDA cores (`OpRecord.cuda_core_ops`).
- **host sync**: an op whose result the host must wait for on CUDA (``_local_scalar_dense`` behind
  ``.item()``/``int()``/``bool()``, ``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask,
  ``repeat_interleave`` without an output size, ``bincount`` — CUDA's reads the input's min and max to size its
  output) and every ``Tensor.tolist()``. On ``meta`` tensors a host read has no value to return: it raises
  `HostReadOnMeta` after it is recorded, except ``bincount`` with a ``minlength`` covering the values (squad's
  routers clamp expert ids below it), which returns a ``minlength`` vector of unknown counts.
- **atomic**: ops that accumulate into shared rows (``index_add``, ``index_put`` with ``accumulate``,
  ``scatter_add``/``scatter_reduce``, ``index_reduce``, embedding and embedding-bag backward, ``bincount``).
- **pin**: ``pin_memory`` (not allowed inside a compiled region on CUDA).

Example::

    grad = torch.randn_like(x)          # made outside: only the layer's own work is recorded
    with TrafficRecorder() as rec:
        layer(x).backward(grad)
    print(rec.summary().table())
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .flops import attention_flops

aten = torch.ops.aten

_NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
    "_reshape_alias", "set_", "resize_", "_unsafe_view", "view", "as_strided", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream",
    "is_pinned", "_local_scalar_dense_meta",
}
_SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
         "unique_consecutive", "bincount"}
_ATOMIC = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
           "index_reduce", "index_reduce_", "embedding_dense_backward", "_embedding_bag_backward",
           "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward", "bincount", "histc",
           "_index_put_impl_"}
_PIN = {"_pin_memory", "pin_memory"}
_GATHER = {"gather": 0, "index_select": 0, "index": 0, "take": 0, "take_along_dim": 0, "embedding": 0}
# factories whose tensor argument is a template (its dtype, device, maybe shape), never read
_TEMPLATE = {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "empty_like", "zeros_like",
             "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
"""Gathers: the position of the argument they read only where indexed (the source)."""
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "grouped_mm", "_scaled_grouped_mm", "addmv", "mv",
           "dot", "vdot", "_addmm_activation"}
_CONV = {"convolution", "_convolution", "conv2d"}
KINDS = ("gemm", "grouped_gemm", "squad_gemm", "attention", "triton", "memory")
_GROUPED = {"_grouped_mm", "grouped_mm", "_scaled_grouped_mm"}


class HostReadOnMeta(RuntimeError):
    """A host read (``.item()``, ``.tolist()``, ``nonzero``...) on a meta tensor: it is recorded as a sync, but no
    value exists to return. Record such code on real tensors."""


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


@dataclasses.dataclass
class Traffic:
    """The totals of a recording, with the records behind them.

    Attributes:
        records: every launched op in the order it ran.
    """

    records: list[OpRecord]

    @property
    def kernels(self) -> int:
        return len(self.records)

    @property
    def syncs(self) -> int:
        return sum(r.sync for r in self.records)

    @property
    def atomics(self) -> int:
        return sum(r.atomic for r in self.records)

    @property
    def pins(self) -> int:
        return sum(r.pin for r in self.records)

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.records)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.records)

    @property
    def matmul_bytes(self) -> float:
        return sum(r.bytes for r in self.records if r.matmul)

    def largest_atomic_bytes(self) -> float:
        """Bytes written by the largest atomic op (0 if none): a few tiny per-task sums are harmless, an atomic
        scatter of every routed row is not."""
        return max((r.bytes_written for r in self.records if r.atomic), default=0.0)

    def by_op(self) -> list[tuple[str, int, float, float]]:
        """(op, calls, GFLOP, GB) per aten op name, most bytes first."""
        table: dict[str, list[float]] = {}
        for r in self.records:
            row = table.setdefault(r.op, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += r.flops
            row[2] += r.bytes
        rows = [(op, int(c), f / 1e9, b / 1e9) for op, (c, f, b) in table.items()]
        return sorted(rows, key=lambda row: -row[3])

    def totals(self) -> dict:
        """The summary as plain numbers (JSON-ready)."""
        return {"kernels": self.kernels, "host_syncs": self.syncs, "atomics": self.atomics, "pins": self.pins,
                "gflop": self.flops / 1e9, "gbytes": self.bytes / 1e9,
                "largest_atomic_mbytes": self.largest_atomic_bytes() / 1e6}

    def table(self, top: int = 20) -> str:
        """The per-op table as text (``top`` rows, most bytes first)."""
        lines = [f"{'op':<44}{'calls':>6}{'GFLOP':>10}{'GB':>9}"]
        lines += [f"{op:<44}{calls:>6}{gf:>10.2f}{gb:>9.3f}" for op, calls, gf, gb in self.by_op()[:top]]
        t = self.totals()
        lines.append(f"{'total':<44}{t['kernels']:>6}{t['gflop']:>10.2f}{t['gbytes']:>9.3f}  "
                     f"syncs {t['host_syncs']}  atomics {t['atomics']}  pins {t['pins']}")
        return "\n".join(lines)


def _logical_bytes(t: torch.Tensor) -> float:
    """Bytes of the distinct elements a tensor view addresses (an expanded, stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return float(n * t.element_size()) if t.numel() else 0.0


def _tensors(tree) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _distinct_bytes(tensors: Sequence[torch.Tensor | None]) -> float:
    seen: set[int] = set()
    total = 0.0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += _logical_bytes(t)
    return total


def _matmul_flops(name: str, args: Sequence, out: torch.Tensor) -> float:
    """2·m·n·k of a matmul-family op from its operands (grouped forms: every row once against its group's weight)."""
    if name in ("addmm", "_addmm_activation", "baddbmm"):
        a, b = args[1], args[2]
    else:
        a, b = args[0], args[1]
    if name in ("_grouped_mm", "grouped_mm", "_scaled_grouped_mm"):
        if a.dim() == 2 and b.dim() == 3:  # [R, K] x [G, K, N]: each row against one group's weight
            return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
        if a.dim() == 2 and b.dim() == 2:  # [K, R] x [R, N] -> [G, K, N]: each row once
            return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        return 2.0 * out.numel() * a.shape[-1]  # 3D x 3D: batched
    if name in ("dot", "vdot", "mv", "addmv"):
        return 2.0 * a.numel()
    return 2.0 * out.numel() * a.shape[-1]  # mm / bmm: [.., m, k] x [.., k, n]


def _aten_attention_flops(name: str, args: Sequence) -> float:
    """PyTorch's fused attention ops: forwards take (q, k, v, ...), backwards (grad_out, q, k, v, ...)."""
    if "backward" in name:
        return attention_flops(args[1], args[2], 10.0)
    return attention_flops(args[0], args[1], 4.0)


# ------------------------------------------------------------------------------ squad's custom attention ops
# FLOPs of the ops in squad.kernels.library, which the recorder sees as one opaque node each.
def _squad_attention(name: str, args: Sequence, outputs: list[torch.Tensor]) -> float:
    """triton_attention / chunked_attention (q, k, v, ...) -> (out [B, H, M, d], lse, scores): 4·B·H·M²·d, and half
    again when scores are asked past one key tile (the two-phase path recomputes QKᵀ); the backwards
    (grad_out [B, H, M, d], q, k, v, ...): 14·B·H·M²·d — one kernel for dK/dV (QKᵀ, dV, dP, dK) and one for dQ (QKᵀ,
    dP, dQ), no atomics."""
    if "backward" in name:
        rows = args[0]
        return attention_flops(rows, rows, 14.0)
    out, scores = outputs[0], outputs[2]
    flops = attention_flops(out, out, 4.0)
    if scores.numel() and out.shape[2] > _one_tile_keys(out):
        flops *= 1.5
    return flops


def _one_tile_keys(out: torch.Tensor) -> int:
    try:
        from squad.kernels.triton_attention import one_tile_keys
    except ImportError:  # no Triton: the kernels' own rule for d <= 64 in 16-bit
        return 256
    return one_tile_keys(out.shape[-1], out.dtype)


def _kind(name: str) -> str:
    base = name.rstrip("_")
    if base in _GROUPED:
        return "grouped_gemm"
    if base in _MATMUL or name in _CONV or name == "convolution_backward":
        return "gemm"
    if name.startswith(("triton_attention", "chunked_attention")):
        return "triton"
    if "attention" in name:
        return "attention"
    return "memory"


def _is_sync(func, name: str, args: Sequence, kwargs: dict) -> bool:
    if name in _SYNC:
        return True
    if name == "repeat_interleave":  # repeat_interleave.Tensor sizes its output by the repeats' sum
        return func._overloadname == "Tensor" and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # a boolean mask runs nonzero first
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


class TrafficRecorder(TorchDispatchMode):
    """Records every launched aten op's FLOPs, bytes, syncs and atomics (see the module docstring).

    Args:
        cuda_path: record what CUDA runs: squad's routed layers take their CUDA algorithm and SDPA is one fused
            kernel (default True).
    """

    def __init__(self, cuda_path: bool = True):
        super().__init__()
        self.cuda_path = cuda_path
        self.records: list[OpRecord] = []
        self._paused = 0
        self._stack = contextlib.ExitStack()

    _active: list[TrafficRecorder] = []  # the recorders entered, innermost last (`current_recorder`)

    def __enter__(self):
        TrafficRecorder._active.append(self)
        if self.cuda_path:
            from .cuda_path import CudaKernels, force_cuda_path

            self._stack.enter_context(force_cuda_path())
            self._stack.enter_context(CudaKernels(self))
        self._stack.enter_context(_recorded_tolist(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            TrafficRecorder._active.remove(self)
            self._stack.close()

    def summary(self) -> Traffic:
        return Traffic(list(self.records))

    def is_paused(self) -> bool:
        return self._paused > 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside the block are not recorded (what a modelled kernel computes its values with)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def launch(self, op: str, reads: Sequence[torch.Tensor | None], writes: Sequence[torch.Tensor | None],
               flops: float = 0.0, kind: str = "memory", atomic: bool = False) -> OpRecord:
        """Records one kernel that does not run as an aten op here (a Triton launch on ``meta``, the fused SDPA).

        Args:
            op: its name in the tables.
            reads: tensors it reads (each counted once at its logical size).
            writes: tensors it writes.
            flops: its arithmetic.
            kind: one of `KINDS`.
            atomic: whether it accumulates into shared rows.
        """
        if kind not in KINDS:
            raise ValueError(f"TrafficRecorder.launch: kind must be one of {KINDS}, got {kind!r}")
        out = next((t for t in writes if t is not None), None)
        record = OpRecord(op, flops=flops, bytes_read=_distinct_bytes(reads), bytes_written=_distinct_bytes(writes),
                          atomic=atomic, kind=kind, dtype=str(out.dtype).removeprefix("torch.") if out is not None
                          else "")
        if not self._paused:
            self.records.append(record)
        return record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        on_meta = any(t.device.type == "meta" for t in inputs)
        if _is_sync(func, name, args, kwargs):
            record = OpRecord(name, bytes_read=sum(map(_logical_bytes, inputs)), sync=True,
                              atomic=name in _ATOMIC)
            self.records.append(record)
            if name == "bincount" and on_meta:
                return _meta_bincount(args, kwargs, record)
            if on_meta:
                raise HostReadOnMeta(f"host read ({name}) on a meta tensor: record this code on real tensors")
            with self.paused():
                out = func(*args, **kwargs)
            record.bytes_written = sum(map(_logical_bytes, _tensors(out)))
            return out
        with self.paused():  # what an op does inside (a custom op's CPU implementation reading sizes) is its own
            out = func(*args, **kwargs)
        if func.is_view or name in _NO_KERNEL:
            return out
        priced = self._price(func, name, args, kwargs, inputs, out)
        self.records.extend(priced if isinstance(priced, list) else [priced])
        return out

    def _price(self, func, name: str, args, kwargs, inputs: list[torch.Tensor], out) -> OpRecord | list[OpRecord]:
        """The op's record (with a squad op's follow-up kernels after it, a list)."""
        outputs = _tensors(out)
        written: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):  # in-place / out=: the written arguments are the outputs
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += _tensors(kwargs.get(arg.name, args[i] if i < len(args) else None))
        in_place = bool(written) and not any(a.name == "out" for a in func._schema.arguments
                                             if a.alias_info is not None and a.alias_info.is_write)
        written_ids = {id(t) for t in written}
        written = written or outputs
        seen: set[int] = set()
        read = 0.0
        source = args[_GATHER[name]] if name in _GATHER and outputs else None
        for t in inputs:  # an out= buffer is only written; an in-place target is read and written
            if id(t) in seen or (id(t) in written_ids and not in_place) or name in _TEMPLATE:
                continue
            seen.add(id(t))
            if t is source:  # a gather reads one output's worth of its source
                read += _logical_bytes(outputs[0]) * t.element_size() / max(outputs[0].element_size(), 1)
                continue
            read += _logical_bytes(t)
        kind = _kind(name)
        record = OpRecord(name, bytes_read=read, bytes_written=sum(map(_logical_bytes, written)), kind=kind,
                          dtype=str(outputs[0].dtype).removeprefix("torch.") if outputs else "")
        base = name.rstrip("_")  # in-place forms (addmm_) cost what their functional form does
        if func.namespace == "squad" and name in SQUAD_OPS:  # squad's grouped and nested GEMMs: their own prices
            followups = SQUAD_OPS[name](record, args)
            if record.matmul:
                record.kind = "squad_gemm"
            if followups:  # kernels the op launches after its main one (a split reduction's sum)
                return [record, *followups]
        elif base in _MATMUL:
            record.flops = _matmul_flops(base, args, outputs[0] if outputs else written[0])
        elif name in _CONV:
            record.flops = _conv_flops(args, outputs[0])
        elif name == "convolution_backward":
            record.flops = 2.0 * _conv_flops(args[1:], args[0])
        elif kind == "triton":
            record.flops = _squad_attention(name, args, outputs)
        elif kind == "attention":
            record.flops = _aten_attention_flops(name, args)
        record.atomic = name in _ATOMIC or (name in ("index_put", "index_put_") and _accumulates(args, kwargs))
        record.pin = name in _PIN
        return record


def _conv_flops(args: Sequence, out: torch.Tensor) -> float:
    weight = args[1]
    return 2.0 * out.numel() * math.prod(weight.shape[1:])


def _accumulates(args, kwargs) -> bool:
    value = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
    return bool(value)


def _meta_bincount(args: Sequence, kwargs: dict, record: OpRecord) -> torch.Tensor:
    """``bincount`` on meta: the output is [minlength] when the values lie below it (squad clamps expert ids), which
    the recording assumes; without a minlength its size is data and cannot be known."""
    values = args[0]
    weights = kwargs.get("weights", args[1] if len(args) > 1 else None)
    minlength = int(kwargs.get("minlength", args[2] if len(args) > 2 else 0))
    if minlength < 1:
        raise HostReadOnMeta("bincount without minlength on a meta tensor: its length is data")
    dtype = torch.int64 if weights is None else (torch.float64 if weights.dtype != torch.float32 else weights.dtype)
    out = torch.empty(minlength, dtype=dtype, device=values.device)
    record.bytes_written = _logical_bytes(out)
    return out


def current_recorder() -> TrafficRecorder | None:
    """The innermost recorder running now (None outside a recording): what a module that records its own kernels
    (`squad.bench.twins`) launches them into."""
    return TrafficRecorder._active[-1] if TrafficRecorder._active else None


def force_cuda_path() -> contextlib.AbstractContextManager[None]:
    """Inside the block squad's routed layers take the algorithm CUDA tensors take (`squad.bench.cuda_path`)."""
    from .cuda_path import force_cuda_path as force

    return force()


@contextlib.contextmanager
def _recorded_tolist(recorder: TrafficRecorder) -> Iterator[None]:
    """``Tensor.tolist`` reads the device without an aten op: count it as a host sync while recording."""
    original = torch.Tensor.tolist

    def tolist(self):
        if recorder._paused:  # also the re-entry a torch-function mode makes through this patched method
            return original(self)
        recorder.records.append(OpRecord("tolist", bytes_read=_logical_bytes(self), sync=True))
        if self.device.type == "meta":
            raise HostReadOnMeta("host read (tolist) on a meta tensor: record this code on real tensors")
        with recorder.paused():
            return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


def record_dict(r: OpRecord) -> dict:
    """One record as JSON-ready data (`record_from_dict` reads it back)."""
    return dataclasses.asdict(r)


def record_from_dict(d: dict) -> OpRecord:
    """The `OpRecord` that `record_dict` wrote."""
    return OpRecord(**d)


def record(fn: Callable[[], object], cuda_path: bool = True) -> Traffic:
    """Runs ``fn()`` under a `TrafficRecorder` and returns what it launched."""
    with TrafficRecorder(cuda_path=cuda_path) as rec:
        fn()
    return rec.summary()


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
        return _logical_bytes(t)
    return float(rows.numel() * t.shape[1] * t.element_size())


def _price_grouped_mm(record: OpRecord, args: Sequence) -> None:
    from squad.kernels.grouped import mm_config

    a, a_rows, w, rows = args[0], args[1], args[2], args[8]
    g, k, n = w.shape
    record.matmul = True
    record.flops = 2.0 * rows * k * n
    record.bytes_read += _rows_read(a, a_rows) - _logical_bytes(a)
    config = mm_config(k, n, a.dtype)
    tiles_m, tiles_n = _row_tiles(rows, config["BLOCK_M"], g), -(-n // config["BLOCK_N"])
    item = a.element_size()
    record.reloads = _gemm_reloads(rows * k * item, g * k * n * item, rows * n * item, tiles_m, tiles_n, g,
                                   _launch_group(config), _logical_bytes(a))
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
    record.bytes_read += _rows_read(a, a_rows) - _logical_bytes(a) + _rows_read(b, b_rows) - _logical_bytes(b)
    config = wgrad_config(k, n, a.dtype)
    tiles_k, tiles_n = -(-k // config["BLOCK_K"]), -(-n // config["BLOCK_N"])
    a_bytes, b_bytes = rows * k * a.element_size(), rows * n * b.element_size()
    a_distinct, b_distinct = min(a_bytes, _logical_bytes(a)), min(b_bytes, _logical_bytes(b))
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
        record.bytes_read += sum(n * width for n, width in groups) * item - _logical_bytes(a)
    else:
        tile = config["BLOCK_N"]
        record.flops = sum(2.0 * n * k * min(n_out, -(-width // tile) * tile) for n, width in groups)
    if len(args) == 7:  # in place (nested_linear_): only each group's first w features of the residual
        residual = args[5]
        touched = sum(n * width for n, width in groups) * residual.element_size()
        record.bytes_read += touched - _logical_bytes(residual)
        record.bytes_written += touched - _logical_bytes(residual)
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
        record.bytes_read += index.numel() * x.shape[2] * x.element_size() - _logical_bytes(x)


def _price_row_scatter_lerp(record: OpRecord, args: Sequence) -> None:
    """A MoD block's write-back writes the indexed rows of x and never reads x."""
    x, index = args[0], args[1]
    record.bytes_read -= _logical_bytes(x)
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
    out_bytes = _logical_bytes(slots) + m * args[3] * w.shape[2] * item
    record.reloads = _gemm_reloads(m * a.shape[1] * item, _logical_bytes(w), out_bytes, tiles_m, e, e,
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
    rows_bytes = _distinct_bytes([c, slots, gates, a2])
    weights = _distinct_bytes([w, w2])
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
    rows_bytes, b_bytes = _distinct_bytes([c, slots, gates]), _logical_bytes(b)
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
