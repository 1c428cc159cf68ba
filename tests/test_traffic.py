"""The traffic recorder (squad.bench.traffic): exact FLOP, byte, kernel, sync and atomic counts from op shapes."""

import pytest
import torch

from squad.bench.traffic import HostReadOnMeta, TrafficRecorder, record
from squad.kernels import device


def test_matmul_flops_and_bytes_are_exact():
    a = torch.randn(8, 16)
    b = torch.randn(16, 32)
    t = record(lambda: a @ b)
    assert t.kernels == 1 and t.records[0].op == "mm"
    assert t.flops == 2 * 8 * 16 * 32
    assert t.bytes == 4 * (8 * 16 + 16 * 32 + 8 * 32)


def test_views_launch_nothing_and_expanded_operands_count_once():
    x = torch.randn(4, 6)
    t = record(lambda: (x.t().reshape(6, 4)[1:], x.unsqueeze(0).expand(3, 4, 6) + 1))
    # reshape of a transposed tensor copies (one kernel); the add reads x once (stride-0 dim) and writes 3x
    ops = [r.op for r in t.records]
    assert ops.count("add") == 1
    add = next(r for r in t.records if r.op == "add")
    assert add.bytes_read == 4 * 24 and add.bytes_written == 4 * 72


def test_in_place_reads_and_writes_its_target_and_out_only_writes():
    x = torch.randn(10)
    y = torch.randn(10)
    out = torch.empty(10)
    t = record(lambda: (x.mul_(2), torch.add(x, y, out=out)))
    mul, add = t.records
    assert (mul.bytes_read, mul.bytes_written) == (40, 40)
    assert (add.bytes_read, add.bytes_written) == (80, 40)


def test_syncs_atomics_and_host_reads_on_meta():
    x = torch.randn(6)
    idx = torch.tensor([0, 1, 1])
    t = record(lambda: (x.sum().item(), x.tolist(), torch.zeros(3).index_add_(0, idx, x[:3]), x.nonzero()))
    assert t.syncs == 3
    assert t.atomics == 1
    with pytest.raises(HostReadOnMeta, match="meta"):
        record(lambda: torch.empty(3, device="meta").sum().item())


def test_backward_is_recorded_and_the_cuda_path_is_forced_only_inside():
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)
    seen = []
    with TrafficRecorder() as rec:
        seen.append(device.forced())
        (x @ w).backward(torch.ones(4, 8))
    assert seen == [True] and device.forced() is False
    mms = [r for r in rec.summary().records if r.op == "mm"]
    assert len(mms) == 3  # forward, grad of x, grad of w
    assert rec.summary().flops == 3 * 2 * 4 * 16 * 8
