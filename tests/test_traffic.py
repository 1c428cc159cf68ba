"""The traffic recorder (squad.bench.traffic): exact FLOP, byte, kernel, sync and atomic counts from op shapes."""

import pytest
import torch
import torch.nn.functional as F

from squad.bench.traffic import HostReadOnMeta, TrafficRecorder, record
from squad.layers import experts


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
        seen.append(experts.FORCE_SYNC_FREE)
        (x @ w).backward(torch.ones(4, 8))
    assert seen == [True] and experts.FORCE_SYNC_FREE is False
    mms = [r for r in rec.summary().records if r.op == "mm"]
    assert len(mms) == 3  # forward, grad of x, grad of w
    assert rec.summary().flops == 3 * 2 * 4 * 16 * 8


def test_repeat_interleave_bincount_and_boolean_masks_sync():
    x = torch.randn(4, 3)
    reps = torch.tensor([1, 2, 0, 1])
    mask = torch.tensor([True, False, True, False])
    t = record(lambda: (x.repeat_interleave(reps, dim=0), torch.repeat_interleave(x, reps, dim=0, output_size=4),
                        torch.bincount(reps, minlength=5), x[mask]))
    assert [r.op for r in t.records if r.sync] == ["repeat_interleave", "bincount", "index"]
    assert [r.op for r in t.records if r.atomic] == ["bincount"]
    counts = torch.empty(7, dtype=torch.long, device="meta")
    with TrafficRecorder() as rec:  # on meta: bincount's length is its minlength, recorded as a sync
        assert torch.bincount(counts, minlength=5).shape == (5,)
    assert rec.summary().syncs == 1


def test_sdpa_is_one_fused_kernel_each_way_on_meta():
    b, h, n, d = 2, 12, 197, 64
    q = torch.randn(b, h, n, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(b, 1, n, d, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    grad = torch.randn(b, h, n, d, device="meta", dtype=torch.bfloat16)
    t = record(lambda: F.scaled_dot_product_attention(q, *kv, enable_gqa=True).backward(grad))
    fwd, bwd = t.records
    assert (fwd.op, bwd.op, fwd.kind) == ("flash_attention_forward", "flash_attention_backward", "attention")
    pairs = b * h * n * n * d
    assert (fwd.flops, bwd.flops) == (4 * pairs, 10 * pairs)
    q_bytes, kv_bytes, lse_bytes = b * h * n * d * 2, b * n * d * 2, b * h * n * 4
    assert (fwd.bytes_read, fwd.bytes_written) == (q_bytes + 2 * kv_bytes, q_bytes + lse_bytes)
    assert bwd.bytes_written == q_bytes + 2 * kv_bytes  # dq, dk, dv at their own shapes (one K/V head)
    assert q.grad.shape == q.shape and kv[0].grad.shape == kv[0].shape


def test_the_recorder_leaves_values_alone_on_real_tensors():
    q, k, v = (torch.randn(2, 3, 10, 8, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 10, 8)
    out = F.scaled_dot_product_attention(q, k, v)
    expected = torch.autograd.grad(out, (q, k, v), grad)
    with TrafficRecorder():
        again = F.scaled_dot_product_attention(q, k, v)
        grads = torch.autograd.grad(again, (q, k, v), grad)
    torch.testing.assert_close(again, out)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_triton_attention_on_meta_records_each_launch_and_the_work_around_it():
    from squad.kernels import routed_attention

    b, h, n, d = 1, 2, 300, 64  # past one key tile: the two-phase forward recomputes QKᵀ for the scores
    q, k, v = (torch.randn(b, h, n, d, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, n, d, device="meta", dtype=torch.bfloat16)
    with TrafficRecorder() as rec:
        out, scores = routed_attention(q, k, v, return_scores=True, backend="triton")
        out.backward(grad)
    kernels = {r.op: r for r in rec.summary().records if r.kind == "triton"}
    pairs = b * h * n * n * d
    assert kernels["triton_fwd_kernel"].flops == 1.5 * 4 * pairs
    assert kernels["triton_bwd_dkdv_kernel"].flops == 8 * pairs and kernels["triton_bwd_dq_kernel"].flops == 6 * pairs
    assert scores.shape == (b, n) and q.grad.shape == q.shape
    ops = [r.op for r in rec.summary().records]
    assert "sum" in ops and "mul" in ops  # the score partials' sum, the backward's row dot products


def test_host_reads_inside_one_launched_op_are_not_the_paths_syncs():
    """A custom op is one kernel: its CPU implementation reading sizes to the host is not a sync of the path."""
    @torch.library.custom_op("squad_test::reads_sizes", mutates_args=())
    def reads_sizes(x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        return x * len(sizes.tolist())

    x, sizes = torch.randn(4), torch.tensor([1, 3])
    t = record(lambda: (reads_sizes(x, sizes), sizes.tolist()))
    assert [r.op for r in t.records] == ["reads_sizes", "tolist"] and t.syncs == 1
