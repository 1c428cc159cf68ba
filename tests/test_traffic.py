"""The traffic recorder (squad.bench.traffic): exact FLOP, byte, kernel, sync and atomic counts from op shapes."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from squad.bench.launches import nested_mlp_row_ops
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


def test_flash_results_are_laid_out_like_their_operands():
    """CUDA's flash kernels allocate out, dq, dk, dv with ``empty_like`` of their operands (PyTorch's flash API and
    its meta kernels): a query laid out [B, N, H, d] gives an output that reshapes to [B, N, H·d] with no copy."""
    b, n, h, d = 2, 197, 6, 64
    qkv = torch.randn(b, n, 3, h, d, device="meta", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(b, n, h * d, device="meta", dtype=torch.bfloat16)

    def attention(backward: bool):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, N, d] views of [B, N, 3, H, d]
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h * d)
        if backward:
            out.backward(grad)

    with torch.no_grad():
        assert [r.op for r in record(lambda: attention(False)).records] == ["flash_attention_forward"]
    ops = [r.op for r in record(lambda: attention(True)).records]
    assert ops == ["flash_attention_forward", "flash_attention_backward", "stack", "copy_"]  # unbind's backward


def test_a_gather_reads_only_the_rows_it_indexes():
    """``gather``/``index_select`` read one output's worth of their source (a row once per index), not all of it."""
    x = torch.randn(256, 197, 384, device="meta", dtype=torch.bfloat16)
    idx = torch.zeros(256, 25, dtype=torch.long, device="meta")
    t = record(lambda: (x.gather(1, idx.unsqueeze(-1).expand(-1, -1, 384)), x.index_select(1, idx[0])))
    gather, select = t.records
    picked = 256 * 25 * 384 * 2
    assert (gather.bytes_read, gather.bytes_written) == (picked + idx.numel() * 8, picked)
    assert (select.bytes_read, select.bytes_written) == (picked + 25 * 8, picked)


def test_a_factory_reads_nothing_of_its_template():
    """``new_zeros`` / ``zeros_like`` take only their argument's dtype and device (and shape): they write their
    output and read nothing."""
    x = torch.randn(4096, 768, device="meta", dtype=torch.bfloat16)
    t = record(lambda: (x.new_zeros(4096, 8), torch.zeros_like(x)))
    small, like = t.records
    assert (small.bytes_read, small.bytes_written) == (0, 4096 * 8 * 2)
    assert (like.bytes_read, like.bytes_written) == (0, x.numel() * 2)


def test_squads_ops_are_priced_by_what_their_kernels_do():
    """The head-select GEMMs compute every head (2·M·K·E·d) and read each operand once; the row ops read and write
    only the rows they index; the fused MLP's FLOPs are its tiles' (widths rounded up to its K tile and N chunk)."""
    from squad.kernels import heads, nested, rows

    m, dim, e, k, d = 300, 64, 6, 3, 16
    bf = {"device": "meta", "dtype": torch.bfloat16}
    x, w = torch.randn(m, dim, **bf), torch.randn(e, dim, d, **bf)
    slots = torch.zeros(m, e, dtype=torch.int32, device="meta")
    t = record(lambda: heads.head_select_mm(x, w, slots, k, None, None))
    (sel,) = t.records
    assert sel.kind == "squad_gemm" and sel.flops == 2 * m * dim * e * d
    assert (sel.bytes_read, sel.bytes_written) == (2 * (m * dim + e * dim * d) + 4 * m * e, 2 * m * k * d)
    xr, idx, emb = torch.randn(4, 50, dim, **bf), torch.zeros(4, 7, dtype=torch.long, device="meta"), None
    ln, ln_b = torch.randn(dim, **bf), torch.randn(dim, **bf)
    picked = 4 * 7 * dim * 2
    t = record(lambda: (rows.row_norm(xr, idx, emb, ln, ln_b, 1e-6),
                        rows.row_scatter_lerp_(xr, idx, xr[:, :7], xr[:, 7:14], None, None, None)))
    norm, scatter = t.records
    assert (norm.bytes_read, norm.bytes_written) == (picked + idx.numel() * 8 + 2 * dim * 2, 2 * picked)
    assert scatter.bytes_written == picked and scatter.bytes_read == 2 * picked + idx.numel() * 8
    hidden, groups = 96, [40, 100, 24, 64]  # two groups: 40 rows of width 24, 60 of width 64
    z = torch.randn(100, dim, **bf)
    w1, w2, b1 = torch.randn(hidden, dim, **bf), torch.randn(dim, hidden, **bf), torch.randn(hidden, **bf)
    layout = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    t = record(lambda: nested.nested_mlp_(z, ln, ln, 1e-6, w1, b1, w2, ln, layout, groups, None, None))
    (mlp,) = t.records
    cfg = nested.nested_mlp_config(dim, hidden, torch.bfloat16)  # K tile 64, output chunks of 64
    assert (cfg["BLOCK_K"], cfg["BLOCK_W"]) == (64, 64)
    assert mlp.flops == 2 * hidden * (40 * (64 + 64) + 60 * (64 + 64))
    assert mlp.bytes_written == 2 * (40 * 24 + 60 * 64)
    assert mlp.cuda_core_ops == 40 * nested_mlp_row_ops(24, dim, hidden, cfg) + 60 * nested_mlp_row_ops(64, dim, hidden,
                                                                                                         cfg)


def _bf16_meta(*shape):
    return torch.randn(*shape, device="meta", dtype=torch.bfloat16)


def test_what_squads_gemm_tiles_load_is_read_from_their_tile_config(monkeypatch):
    """squad's grouped GEMM launched on (row tiles, N tiles), row tiles first: its gathered input is re-read once per
    N tile past the first, a whole pass apart; a tile config that names a grouped launch order (GROUP_M, an L2
    swizzle) keeps the re-reads a few row tiles apart, which the L2 model turns into fewer DRAM bytes. The library's
    grouped GEMM is its own kind (its own rate)."""
    from squad.bench.costmodel import KernelModel
    from squad.kernels import grouped

    rows, tokens, k, n, g = 65536, 16384, 256, 512, 4
    a, w = _bf16_meta(tokens, k), _bf16_meta(g, k, n)
    a_rows = torch.zeros(rows, dtype=torch.long, device="meta")
    ends = torch.zeros(g, dtype=torch.int32, device="meta")

    def launch():
        (rec,) = record(lambda: grouped.grouped_mm(a, a_rows, w, None, ends, None, None, None, rows, "linear",
                                                   False, False)).records
        return rec

    cfg = {key: v for key, v in grouped.mm_config(k, n, torch.bfloat16).items() if key not in ("GROUP_M", "order")}
    monkeypatch.setattr(grouped, "mm_config", lambda *args: cfg)  # the plain walk: every row tile, one N tile a time
    plain = launch()
    tiles_m, tiles_n = rows // cfg["BLOCK_M"] + g - 1, n // cfg["BLOCK_N"]
    assert plain.kind == "squad_gemm" and plain.programs == tiles_m * tiles_n
    gathered = rows * k * 2  # every routed row, as its tiles read it
    (size, extra, distance), (w_size, w_extra, _) = plain.reloads
    assert (size, extra) == (gathered, tiles_n - 1)
    assert distance == tokens * k * 2 + (g * k * n * 2 + rows * n * 2) / tiles_n  # distinct bytes of one pass
    assert (w_size, w_extra) == (g * k * n * 2, (tiles_m - g) / g)
    assert plain.tile_bytes == plain.bytes + gathered * (tiles_n - 1) + w_size * w_extra

    monkeypatch.setattr(grouped, "mm_config", lambda *args: {**cfg, "GROUP_M": 8, "order": "grouped"})
    swizzled = launch()
    assert swizzled.tile_bytes == plain.tile_bytes and swizzled.reloads[0][2] < distance / 10
    small_l2 = dataclasses.replace(KernelModel.at(), l2_mb=distance / 2e6, l2_retention=0.0)
    assert small_l2.dram_bytes(plain) == plain.bytes + gathered * (tiles_n - 1)  # every re-read a pass apart misses
    assert small_l2.dram_bytes(swizzled) == swizzled.bytes  # a few row tiles apart: all hit
    big_l2 = dataclasses.replace(small_l2, l2_mb=2 * distance / 1e6)
    assert big_l2.dram_bytes(plain) == plain.bytes

    offs, sorted_rows = torch.full((g,), rows, dtype=torch.int32, device="meta"), _bf16_meta(rows, k)
    (library,) = record(lambda: torch._grouped_mm(sorted_rows, w, offs=offs)).records
    assert library.kind == "grouped_gemm" and library.flops == 2 * rows * k * n


def test_head_wgrad_counts_its_programs_its_per_head_reads_and_its_split_sum():
    """MoE attention's weight gradient: one program per (head, N tile, row chunk), b read once per head inside a chunk;
    a small problem is one chunk (heads × N tiles programs, the results written directly); several chunks write
    float32 partials that one more kernel reads and sums into the results (the grid several waves of 132 SMs at
    modsquad_vit_b's 30,732 rows)."""
    from squad.bench.costmodel import SMS
    from squad.kernels import heads

    e, kk, d, n = 24, 12, 64, 768
    tiles_n = n // heads.wgrad_config(64, e, n, d, torch.bfloat16)["BLOCK_N"]
    for m in (1000, 4096, 30732):
        c, b = _bf16_meta(m, kk, d), _bf16_meta(m, n)
        slots = torch.zeros(m, e, dtype=torch.int32, device="meta")
        recs = record(lambda c=c, s=slots, b=b: heads.head_wgrad(c, s, None, b, e, False, True, torch.bfloat16)).records
        splits = heads.wgrad_config(m, e, n, d, torch.bfloat16)["splits"]
        assert recs[0].programs == e * tiles_n * splits and recs[0].reloads[0][:2] == [m * n * 2, e - 1]
        results = (e * d * n + n) * 2
        if m == 1000:
            assert splits == 1 and len(recs) == 1 and recs[0].programs == 144
            assert recs[0].bytes_written == results
        else:
            (partial_sum,) = recs[1:]
            assert splits > 1 and recs[0].bytes_written == partial_sum.bytes_read == splits * (e * d * n + n) * 4
            assert partial_sum.kind == "memory" and partial_sum.bytes_written == results
    assert recs[0].programs >= 4 * SMS
