"""The gate products of the grouped_mm MoE MLP and the patch embedding, each form timed on one GPU (bf16, CUDA events,
median of 50): what `squad.layers.experts.permuted` and `squad.models.vit.PatchConv` replaced and what they took.

Run from the checkout root on a GPU machine (~20 s):  python3 reports/bench/gpu_check_h200/diag/combine_forms.py
Shapes: modsquad_vit_b's MoE MLP block (M = 12 × 13 × 197 = 30,732 tokens, k 4, D 768); ViT-S's patch embedding
(256 images at 224 px, p 16, D 384). Prints one line per form and writes $OUT/combine_forms.json when OUT is set.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from squad.layers.experts.permuted import _tile_diagonal, _tile_gates, token_tile  # noqa: E402
from squad.models.vit import PatchConv  # noqa: E402


def ms(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    dev, bf = "cuda", torch.bfloat16
    m, k, d = 12 * 13 * 197, 4, 768
    t = token_tile(m, k)
    yk = torch.randn(m, k, d, device=dev, dtype=bf)  # y gathered into (token, slot) order
    g = torch.rand(m, k, device=dev, dtype=bf)
    grad = torch.randn(m, d, device=dev, dtype=bf)
    tiles = _tile_gates(g, t)
    yt = yk.view(m // t, t * k, d)
    gt = grad.view(m // t, t, d)
    forms = {
        # combine: out[m] = Σ_j g[m, j] yk[m, j]
        "combine_gemv (before)": lambda: torch.bmm(g.unsqueeze(1), yk),
        f"combine_tiles T={t} (after)": lambda: torch.bmm(tiles, yt),
        "combine_mul_sum": lambda: (yk * g.unsqueeze(2)).sum(1),
        "tile_gates (after, its setup)": lambda: _tile_gates(g, t),
        # gate gradient: <grad[m], yk[m, j]>
        "gate_grad_gemv (before)": lambda: torch.bmm(yk, grad.unsqueeze(2)),
        f"gate_grad_tiles T={t} (after)": lambda: _tile_diagonal(torch.bmm(gt, yt.transpose(1, 2)), k),
        "gate_grad_mul_sum": lambda: (yk * grad.unsqueeze(1)).sum(2),
        # the rows' gradient g ⊙ grad in (token, slot) order
        "dy_broadcast_mul (before)": lambda: grad.unsqueeze(1) * g.unsqueeze(2),
        f"dy_tiles T={t} (after)": lambda: torch.bmm(tiles.transpose(1, 2), gt),
        # the slot sum of the input gradient (unchanged), for scale
        "slot_sum (unchanged)": lambda: yk.sum(1),
    }
    conv = PatchConv(3, 384, kernel_size=16, stride=16).to(dev, bf)
    images = torch.randn(256, 3, 224, 224, device=dev, dtype=bf)
    forms["patch_embed_cudnn_conv (before)"] = lambda: F.conv2d(images, conv.weight, conv.bias, stride=16)
    forms["patch_embed_gemm (after)"] = lambda: conv(images)
    with torch.no_grad():
        out = {name: ms(fn) for name, fn in forms.items()}
        err = (conv(images).float() - F.conv2d(images, conv.weight, conv.bias, stride=16).float()).abs().max().item()
    for name, v in out.items():
        print(f"{name:<40}{v:8.3f} ms")
    print(f"patch embedding: max |GEMM - conv| = {err:.3g} (bf16)")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tile_tokens": t, "ms": out,
              "patch_embed_max_abs_diff": err}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "combine_forms.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
