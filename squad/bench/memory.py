"""Peak memory of a piece of work, on any device: CUDA's allocator statistics on a GPU, and on the CPU (which keeps
none) the tensors themselves, followed op by op.

`LiveTensorBytes` is a dispatch mode that sees every tensor an operator returns (forward, backward and optimizer
ops alike), keeps a weak reference to its storage, and after each op sums the storages still alive: the peak of
that sum is the peak memory the work allocated, exact at the granularity of tensor storages (allocator slack and
fragmentation are not counted). Tensors that existed before (parameters, optimizer state from earlier steps) are
not counted; `tensor_bytes` adds them up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages created inside the mode that are still alive, and their peak.

    Use as a context manager: ``with LiveTensorBytes() as m: work()``; then ``m.peak`` (bytes) and ``m.current``
    (bytes still alive at the end, e.g. what autograd keeps for the backward pass after a forward).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[torch.device, int], tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = (t.device, storage.data_ptr())
                known = self._live.get(key)
                if known is None or known[0].expired():  # new, or a freed storage's address reused
                    self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.current = sum(n for _, n in self._live.values())
        self.peak = max(self.peak, self.current)
        return out


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (e.g. parameters and optimizer state)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def peak_bytes(work: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated while ``work()`` runs, above what was allocated before it.

    On CUDA: the allocator's peak (``torch.cuda.max_memory_allocated``) minus what was allocated at the start. On
    the CPU: `LiveTensorBytes` (the work runs slower under it: time it separately).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with LiveTensorBytes() as mode:
        work()
    return mode.peak
