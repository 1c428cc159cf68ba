"""One GPU session's diagnosis of what the first `make gpu-check` (H200, 2026-11-28) found: run from the checkout
root after `source .gpu/on_device.sh`:  python3 .gpu/diag.py PART [PART ...]   (parts: triton layers profile compile)
"""
import itertools
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.getcwd())
OUT = os.environ.get("OUT", "/tmp")
RESULT = {}


def part(fn):
    def run():
        t0 = time.perf_counter()
        print(f"===== {fn.__name__}", flush=True)
        try:
            RESULT[fn.__name__] = fn()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            RESULT[fn.__name__] = {"error": traceback.format_exc()[-1500:]}
        print(f"===== {fn.__name__} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return run


@part
def triton():
    """Which rows / combos of the Triton grouped GEMM differ from the reference on the GPU."""
    from kernels import grouped as G
    from kernels import triton_grouped as T
    from kernels.tiles import mm_config
    from tests.test_grouped_kernels import _args, _problem
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t, ends = _problem(1000, 400, 96, 80, [300, 0, 500], torch.bfloat16, device=dev)
    tc, endsc = {k: v.cpu() for k, v in t.items()}, ends.cpu()
    inv = torch.empty_like(tc["out_rows"])
    inv[tc["out_rows"]] = torch.arange(1000)
    base = mm_config(96, 80, torch.bfloat16)
    combos = [("gate_grad", True, True, True, True), ("gate_grad", True, False, False, False),
              ("gate_grad", True, False, True, True), ("gate_grad", True, True, False, True),
              ("gate_grad", True, True, True, False), ("linear", True, True, True, True),
              ("gelu", True, True, True, True), ("linear", True, False, False, False)]
    rows = []
    for (epi, gather, scatter, bias, scale), (cname, cfg) in itertools.product(
            combos, [("default", base), ("group1", {**base, "GROUP_M": 1}),
                     ("bm64", {**base, "BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 1})]):
        if cname != "default" and (epi, gather, scatter, bias, scale) != combos[0]:
            continue
        aux_gelu = epi == "gate_grad" and scale
        args = _args(t, ends, 1000, epi, gather, scatter, bias, scale, aux_gelu)
        out, extra = T.grouped_mm(*args, config=cfg)
        torch.cuda.synchronize() if dev == "cuda" else None
        ref, rextra = G.grouped_mm_reference(*_args(tc, endsc, 1000, epi, gather, scatter, bias, scale, aux_gelu))
        d = (out.float().cpu() - ref.float()).abs()
        bad = d > 0.06 + 0.03 * ref.float().abs()
        bad_out_rows = bad.any(1).nonzero().flatten()
        sorted_rows = (inv[bad_out_rows] if scatter else bad_out_rows).sort().values.tolist()
        zero_rows = int((out.float().cpu()[bad_out_rows] == 0).all(1).sum()) if len(bad_out_rows) else 0
        r = {"epilogue": epi, "gather": gather, "scatter": scatter, "bias": bias, "scale": scale, "config": cname,
             "bad_elements": int(bad.sum()), "max_abs": float(d.max()), "bad_rows": len(sorted_rows),
             "bad_sorted_rows_first_last": (sorted_rows[:6], sorted_rows[-6:]), "bad_rows_all_zero": zero_rows,
             "bad_cols": bad.any(0).nonzero().flatten().tolist()[:8]}
        if epi == "gate_grad":
            r["extra_max_abs"] = float((extra.float().cpu().sum(1) - rextra.float().sum(1)).abs().max())
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


@part
def layers():
    """MoE MLP / MoA: GPU bf16 and GPU fp32 against CPU fp32 — per-token error and routing flips."""
    from squad.layers.context import ForwardContext
    from tests.test_hot_paths import _gpu_layers
    out = {}
    x = torch.randn(4, 197, 256)
    ids, segments = torch.tensor([0, 1, 1, 2]), [(0, 0, 1), (1, 1, 3), (2, 3, 4)]
    for name in ("moe", "moa"):
        ref_layer = _gpu_layers()[name].float().eval()
        ref = ref_layer(x, ForwardContext(task_ids=ids, num_tasks=3, segments=segments)).detach()
        router = [m for m in ref_layer.modules() if hasattr(m, "top_k") and hasattr(m, "gate")]
        res = {}
        for dtype in (torch.float32, torch.bfloat16):
            layer = _gpu_layers()[name].cuda().to(dtype).eval()
            y = layer(x.cuda().to(dtype), ForwardContext(task_ids=ids.cuda(), num_tasks=3, segments=segments))
            err_tok = ((y.float().cpu() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).flatten()
            r = {"rel_norm": float((y.float().cpu() - ref).norm() / ref.norm()),
                 "token_err_median": float(err_tok.median()), "token_err_p99": float(err_tok.quantile(0.99)),
                 "tokens_over_5pct": float((err_tok > 0.05).float().mean())}
            if router:
                rr = router[0]
                gr = [m for m in layer.modules() if hasattr(m, "top_k") and hasattr(m, "gate")][0]
                with torch.no_grad():
                    a = rr(x, ForwardContext(task_ids=ids, num_tasks=3, segments=segments))
                    b = gr(x.cuda().to(dtype), ForwardContext(task_ids=ids.cuda(), num_tasks=3, segments=segments))
                ea, eb = a.experts.sort(-1).values, b.experts.cpu().sort(-1).values
                r["tokens_routed_differently"] = float((ea != eb).any(-1).float().mean())
                flipped = (ea != eb).any(-1)
                if flipped.any() and not flipped.all():
                    r["token_err_median_same_route"] = float(err_tok[~flipped].median())
                    r["token_err_max_same_route"] = float(err_tok[~flipped].max())
            res[str(dtype)] = r
        print(name, json.dumps(res), flush=True)
        out[name] = res
    return out


@part
def profile():
    """Top CUDA kernels of MoE MLP / MoA fwd+bwd (modsquad_vit_b block, bf16) and MoNE ViT-S inference."""
    from torch.profiler import ProfilerActivity, profile as prof

    from squad.bench.cases import MultiQueryAttention, _build, _gpu_block_inputs
    from squad.layers.mlp import Mlp
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.moe_mlp import MoEMlp
    cfg, x, ctx, shape = _gpu_block_inputs(False, "cuda")
    torch.manual_seed(0)
    mods = {"moe": (MoEMlp(cfg.embed_dim, cfg.moe_hidden(), cfg.moe, shape["tasks"]), True),
            "dense_mlp": (Mlp(cfg.embed_dim, cfg.moe.top_k * cfg.moe_hidden()), False),
            "moa": (MoEAttention(cfg.embed_dim, cfg.moa, shape["tasks"], cfg.qkv_bias), True),
            "mqa": (MultiQueryAttention(cfg.embed_dim, cfg.moa.top_k, cfg.moa.head_dim), False)}
    out = {}
    for name, (m, routed) in mods.items():
        m = m.cuda().to(torch.bfloat16)

        def step():
            y = m(x, ctx()) if routed else m(x)
            y.float().square().mean().backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
        print(name, table, flush=True)
        ev = sorted(p.key_averages(), key=lambda e: -e.device_time_total)
        out[name] = {"total_ms_per_step": sum(e.self_device_time_total for e in ev) / 3e3,
                     "kernels": len([e for e in ev if e.self_device_time_total > 0]),
                     "top": [(e.key[:90], round(e.self_device_time_total / 3e3, 3), e.count // 3) for e in ev[:14]]}
    mone = _build("mone_vit_s", ["model.img_size=224"]).eval().cuda().to(torch.bfloat16)
    mone.set_mone_capacity(0.3)
    dense = _build("mod_vit_s", ["model.img_size=224", "model.plan=[{attn: dense, mlp: dense}]",
                                 "model.task_embed=none", "model.name=vit_s_dense"]).eval().cuda().to(torch.bfloat16)
    images = torch.randn(256, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    for name, model in (("mone_fwd", mone), ("dense_vit_s_fwd", dense)):
        with torch.no_grad():
            for _ in range(2):
                model.forward_features(images, model.task_names[0])
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                model.forward_features(images, model.task_names[0])
                torch.cuda.synchronize()
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
        print(name, table, flush=True)
        ev = sorted(p.key_averages(), key=lambda e: -e.self_device_time_total)
        out[name] = {"total_ms": sum(e.self_device_time_total for e in ev) / 1e3,
                     "kernel_launches": sum(e.count for e in ev if e.self_device_time_total > 0),
                     "top": [(e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count) for e in ev[:14]]}
    return out


@part
def compile():
    """Graph breaks, recompiles and the compiled step's time of a small modsquad model (13 tasks) on the GPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from squad.bench.step import StepSetup, load_step_config, measure_steps
    model_cfg, loss_cfg = load_step_config("modsquad_vit_b", [])
    setups = [StepSetup(model_cfg, loss_cfg, 12, torch.device("cuda"), torch.bfloat16, c, "none") for c in (False, True)]
    counters.clear()
    results, _ = measure_steps(setups, repeats=6, quick=False)
    out = {"graph_breaks": {k: v for k, v in counters["graph_break"].items()},
           "stats": {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "recompiles")},
           "steps": [r if isinstance(r, str) else {"images_per_s": r.images_per_s} for r in results]}
    print(json.dumps(out, indent=1, default=str)[:6000], flush=True)
    return out


if __name__ == "__main__":
    names = sys.argv[1:] or ["triton", "layers", "profile", "compile"]
    for n in names:
        globals()[n]()
    with open(os.path.join(OUT, "diag.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
