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
  element-wise work it does on CUDA cores (`OpRecord.cuda_core_ops`), each op's by `squad.bench.launches`.
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
from .launches import SQUAD_OPS, OpRecord, distinct_bytes, logical_bytes

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


def _tensors(tree) -> list[torch.Tensor]:
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor)]


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
        record = OpRecord(op, flops=flops, bytes_read=distinct_bytes(reads), bytes_written=distinct_bytes(writes),
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
            record = OpRecord(name, bytes_read=sum(map(logical_bytes, inputs)), sync=True,
                              atomic=name in _ATOMIC)
            self.records.append(record)
            if name == "bincount" and on_meta:
                return _meta_bincount(args, kwargs, record)
            if on_meta:
                raise HostReadOnMeta(f"host read ({name}) on a meta tensor: record this code on real tensors")
            with self.paused():
                out = func(*args, **kwargs)
            record.bytes_written = sum(map(logical_bytes, _tensors(out)))
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
                read += logical_bytes(outputs[0]) * t.element_size() / max(outputs[0].element_size(), 1)
                continue
            read += logical_bytes(t)
        kind = _kind(name)
        record = OpRecord(name, bytes_read=read, bytes_written=sum(map(logical_bytes, written)), kind=kind,
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
    record.bytes_written = logical_bytes(out)
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
        recorder.records.append(OpRecord("tolist", bytes_read=logical_bytes(self), sync=True))
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
