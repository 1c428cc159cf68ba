"""Routed attention in pure PyTorch: the readable reference and the CPU fast path.

- `explicit_attention`: softmax(Q Kᵀ · scale) V with the whole N×N map, the textbook definition the tests check
  everything else against (and the memory baseline of the benchmark). Never used by the op.
- `attention_forward_chunked` / `attention_backward_chunked`: the same attention computed over chunks of query rows,
  so at most O(N · chunk) scores exist at a time. The forward returns the output, each row's log-sum-exp and the
  A-MoD routing scores (column means of the probabilities) from ONE pass: each chunk's probabilities are formed once
  and feed both P V and the column sums. For ViT-sized N the whole map fits the chunk budget and this is one
  matmul, one softmax, one matmul, one reduction — about the cost of SDPA itself.
- `cpu_flash_backward`: PyTorch's fused CPU flash-attention backward fed with the chunked forward's output and LSE.

`squad.kernels.library` registers these as custom ops (``squad::chunked_attention``) and `squad.kernels.op` picks
them when scores are asked on the "reference" backend; without scores that backend is plain SDPA.

Grouped/multi-query heads: query head h uses key/value head h // (Hq / Hkv), PyTorch's `enable_gqa` convention.
The g = Hq / Hkv query heads of a group attend to the same keys, so they are computed as one head with g·N query
rows — a free view of a contiguous q, no copies of k or v.
"""

from __future__ import annotations

import math

import torch

# Score elements per chunk: 1 Mi fp32 values = 4 MiB per scratch buffer (scores and probabilities); ViT-S maps (B 8,
# H 6, N 197: 1.9 M) take 2 chunks. Measured on 2 cores against SDPA: 256 Ki 1.10, 512 Ki 1.07-1.13, 1 Mi 1.06-1.08,
# 2 Mi 1.13; smaller chunks also mean more, smaller parallel ops, which cost most when the cores are shared.
DEFAULT_CHUNK_ELEMENTS = 1 << 20


def gather_rows(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Selects token rows per batch row: ``x[b, :, token_index[b], :]``.

    Args:
        x: [B, H, N, d].
        token_index: [B, K] int64 in [0, N).

    Returns:
        [B, H, K, d]; differentiable (gradients scatter back to the selected rows).
    """
    b, h, _, d = x.shape
    index = token_index[:, None, :, None].expand(b, h, token_index.shape[1], d)  # (B, H, K, d)
    return torch.gather(x, 2, index)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                       token_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook attention with the full N×N probability map, computed in float32.

    Args:
        q: [B, Hq, N, d]; k, v: [B, Hkv, N, d] with Hkv dividing Hq.
        scale: score scale, default d ** -0.5.
        token_index: optional [B, K] rows to attend among.

    Returns:
        (out [B, Hq, M, d] in q's dtype, scores [B, M] float32) with M = N or K; scores are the mean over heads and
        query rows of the probabilities (column means). Differentiable through the output.
    """
    if token_index is not None:
        q, k, v = gather_rows(q, token_index), gather_rows(k, token_index), gather_rows(v, token_index)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # (B, Hq, M, d)
    vf = v.float().repeat_interleave(group, dim=1)
    probs = torch.softmax(q.float() @ kf.transpose(-1, -2) * scale, dim=-1)  # (B, Hq, M, M)
    out = (probs @ vf).to(q.dtype)
    return out, probs.detach().mean(dim=(1, 2))


def _chunks(batch_heads: int, rows: int, keys: int, chunk_elements: int) -> list[tuple[slice, slice]]:
    """Splits (batch·head, query row) space into blocks whose score maps hold about ``chunk_elements`` values.

    Small maps (ViT-sized N) are taken whole, several heads at a time; large maps row by row blocks of one head.
    Every block is a contiguous slice of a (batch·head, rows, ...) tensor.
    """
    if torch.compiler.is_exporting():  # torch.export (squad.deploy.export): one block keeps the batch size symbolic
        return [(slice(0, batch_heads), slice(0, rows))]
    per_head = rows * keys
    if per_head <= chunk_elements:
        step = chunk_elements // per_head
        return [(slice(i, min(i + step, batch_heads)), slice(0, rows)) for i in range(0, batch_heads, step)]
    step = max(16, chunk_elements // keys)
    return [(slice(i, i + 1), slice(r, min(r + step, rows))) for i in range(batch_heads) for r in range(0, rows, step)]


def attention_forward_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, need_lse: bool = True,
                              chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
                              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Attention output, row log-sum-exp and routing scores in one pass over chunks of query rows.

    Math runs in float32 whatever the input dtype. No autograd (call under `torch.no_grad` or from a Function).

    Args:
        q: [B, Hq, M, d]; k, v: [B, Hkv, M, d].
        scale: score scale.
        need_lse: also return each row's log-sum-exp (needed by the backward).
        chunk_elements: budget of score elements per chunk.

    Returns:
        out [B, Hq, M, d] (q's dtype), lse [B, Hq, M] float32 (natural log) or None, scores [B, M] float32.
    """
    b, hq, m, d = q.shape
    hkv = k.shape[1]
    rows = (hq // hkv) * m
    # (B·Hkv, g·M, d): a group's query heads stacked as rows of one head
    qg = q.reshape(b * hkv, rows, d).float()
    kt = k.reshape(b * hkv, m, d).float().transpose(1, 2)  # (B·Hkv, d, M)
    vg = v.reshape(b * hkv, m, d).float()
    out = torch.empty(b * hkv, rows, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b * hkv, rows, dtype=torch.float32, device=q.device) if need_lse else None
    colsum = torch.empty(b * hkv, m, dtype=torch.float32, device=q.device)
    chunks = _chunks(b * hkv, rows, m, chunk_elements)
    # two scratch buffers sized for the first (largest) chunk, reused by every chunk: no allocation in the loop
    hs0, rs0 = chunks[0]
    s_buf, p_buf = torch.empty(2, (hs0.stop - hs0.start) * (rs0.stop - rs0.start) * m, device=q.device,
                               dtype=torch.float32)
    for hs, rs in chunks:
        shape = (hs.stop - hs.start, rs.stop - rs.start, m)  # (h, c, M)
        s = s_buf[:math.prod(shape)].view(shape).baddbmm_(qg[hs, rs], kt[hs], beta=0.0, alpha=scale)  # S·scale
        p = torch.softmax(s, dim=-1, out=p_buf[:math.prod(shape)].view(shape))
        if lse is not None:
            # the largest probability is exp(max s - lse): lse = max s - log(max p), with max p >= 1/M (no overflow)
            torch.sub(s.amax(dim=-1), p.amax(dim=-1).log_(), out=lse[hs, rs])
        torch.bmm(p, vg[hs], out=out[hs, rs])
        if rs.start == 0:
            torch.sum(p, dim=1, out=colsum[hs])  # (h, M)
        else:
            colsum[hs] += p.sum(dim=1)
    out = out.view(b, hq, m, d).to(q.dtype)
    if lse is not None:
        lse = lse.view(b, hq, m)
    scores = colsum.view(b, hkv, m).sum(dim=1).div_(hq * m)
    return out, lse, scores


def attention_backward_chunked(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, scale: float,
                               chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the attention output, recomputing probabilities chunk by chunk from the saved log-sum-exp.

    With P = exp(S - lse), D_i = Σ_c dO_ic O_ic: dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D), dQ = dS K · scale,
    dK = dSᵀ Q · scale. Memory O(M · chunk).

    Args:
        grad_out, q, out: [B, Hq, M, d]; k, v: [B, Hkv, M, d]; lse: [B, Hq, M] float32.
        scale: score scale used in the forward.
        chunk_elements: budget of score elements per chunk.

    Returns:
        (dq, dk, dv) in the inputs' dtype and shapes.
    """
    b, hq, m, d = q.shape
    hkv = k.shape[1]
    rows = (hq // hkv) * m
    qg = q.reshape(b * hkv, rows, d).float()  # (B·Hkv, g·M, d)
    kg = k.reshape(b * hkv, m, d).float()
    vg = v.reshape(b * hkv, m, d).float()
    dog = grad_out.reshape(b * hkv, rows, d).float()
    delta = (dog * out.reshape(b * hkv, rows, d).float()).sum(dim=-1)  # (B·Hkv, g·M)
    lseg = lse.reshape(b * hkv, rows)
    dq = torch.empty_like(qg)
    dk = torch.zeros_like(kg)
    dv = torch.zeros_like(vg)
    for hs, rs in _chunks(b * hkv, rows, m, chunk_elements):
        qc, doc = qg[hs, rs], dog[hs, rs]
        p = torch.bmm(qc, kg[hs].transpose(1, 2)).mul_(scale).sub_(lseg[hs, rs, None]).exp_()  # (h, c, M)
        dv[hs].baddbmm_(p.transpose(1, 2), doc)
        ds = torch.bmm(doc, vg[hs].transpose(1, 2)).sub_(delta[hs, rs, None]).mul_(p)  # (h, c, M)
        torch.bmm(ds, kg[hs], out=dq[hs, rs]).mul_(scale)
        dk[hs].baddbmm_(ds.transpose(1, 2), qc, alpha=scale)
    return (dq.view(b, hq, m, d).to(q.dtype), dk.view(b, hkv, m, d).to(k.dtype), dv.view(b, hkv, m, d).to(v.dtype))


def cpu_flash_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch's fused CPU flash-attention backward, fed with the chunked forward's output and log-sum-exp.

    Grouped heads use the same (B, Hkv, g·M, d) view as the forward.
    """
    b, hq, m, d = q.shape
    hkv = k.shape[1]
    rows = (hq // hkv) * m
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.reshape(b, hkv, rows, d), q.reshape(b, hkv, rows, d), k, v, out.reshape(b, hkv, rows, d),
        lse.reshape(b, hkv, rows), 0.0, False, scale=scale)
    return dq.reshape(b, hq, m, d), dk, dv
