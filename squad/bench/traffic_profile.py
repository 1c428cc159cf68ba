"""The traffic profile of `tools/bench.py` (``--only traffic``): what each routed layer asks of a GPU, against its
dense twin, counted on the CPU (`squad.bench.traffic`, the CUDA path, meta tensors at full size, bf16) and priced
by the H100 cost model (`squad.bench.costmodel`, a MODEL fitted to what an H100 measured).

Layers, at the GPU rows' shapes (DESIGN.md "Traffic contract"):

- ``moe_mlp``: modsquad_vit_b's MoE MLP block (16 experts, top-4, width 768), forward + backward, 12 images × 13 tasks
  × 197 tokens, against the dense MLP of equal active FLOPs (hidden 4·768);
- ``moa``: its MoE attention (24 experts, top-12, head 64), forward + backward, against multi-query attention of
  equal FLOPs (12 query heads, one K/V head);
- ``mod_vit_s`` / ``mone_vit_s`` (e_c 0.3): ``forward_features`` of 256 images at 224 px for one task, no grad,
  against the dense ViT-S;
- ``attention_scores_n197`` / ``_n4096``: routed attention with A-MoD scores, forward, B 8 × H 12 × d 64, against
  SDPA without scores.

Each layer gives three rows: bytes moved over the twin's (targets ≤ 1.6 for MoE MLP and MoE attention, ≤ 0.6 for
MoNE), the modelled H100 time over the twin's (a speed-up for MoD and MoNE: targets as the GPU contract's), and host
syncs plus atomic ops writing ≥ 1 MB (target 0). Every count (kernels, syncs, atomics, GFLOP, GB, modelled ms, for
the layer and its twin) is in the rows' details; `format_traffic` prints them as one table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from squad.timing import BenchResult, check

from . import costmodel
from .traffic import Traffic, record

BF16 = torch.bfloat16
META = torch.device("meta")
LARGE_ATOMIC_BYTES = 1e6  # an atomic op writing this much is a scatter of routed rows, not a per-task sum


@dataclasses.dataclass(frozen=True)
class Layer:
    """One routed layer of the profile.

    Attributes:
        name: row prefix.
        twin: the dense twin's name.
        build: returns (layer run, twin run) on meta tensors; each call runs one recorded unit.
        bytes_target: target on bytes / twin's bytes ("" for none).
        time_target: target on the modelled time ratio (or speed-up with ``speedup``).
        speedup: report twin time / layer time.
        gpu_case: the ``tools/bench.py --device cuda`` row this predicts.
    """

    name: str
    twin: str
    build: Callable[[], tuple[Callable[[], None], Callable[[], None]]]
    bytes_target: str
    time_target: str
    speedup: bool
    gpu_case: str


def _fwd_bwd(module: Callable[..., torch.Tensor], x: torch.Tensor, *extra) -> Callable[[], None]:
    grad = torch.randn_like(x)  # made outside the recording: only the layer's own work counts

    def run() -> None:
        module(x, *extra).backward(grad)

    return run


def _blocks() -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    from squad.layers.mlp import Mlp
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.moe_mlp import MoEMlp

    from .cases import MultiQueryAttention, _config, _segment_context

    cfg = _config("modsquad_vit_b")
    tasks, images = len(cfg.head_configs()), 12
    torch.manual_seed(0)
    with META:
        x = torch.randn(images * tasks, cfg.num_tokens, cfg.embed_dim, dtype=BF16, requires_grad=True)
        moe = MoEMlp(cfg.embed_dim, cfg.moe_hidden(), cfg.moe, tasks).to(BF16)
        dense = Mlp(cfg.embed_dim, cfg.moe.top_k * cfg.moe_hidden()).to(BF16)
        moa = MoEAttention(cfg.embed_dim, cfg.moa, tasks, cfg.qkv_bias).to(BF16)
        mqa = MultiQueryAttention(cfg.embed_dim, cfg.moa.top_k, cfg.moa.head_dim).to(BF16)
    ctx = _segment_context(images, tasks, META)
    return {"moe_mlp": (_fwd_bwd(lambda x: moe(x, ctx()), x), _fwd_bwd(dense, x)),
            "moa": (_fwd_bwd(lambda x: moa(x, ctx()), x), _fwd_bwd(mqa, x))}


def _inference(name: str, images: int = 256, size: int = 224) -> tuple[Callable[[], None], Callable[[], None]]:
    from .cases import _build, _dense_vit_s

    with META:
        model = _build(name, [f"model.img_size={size}"]).to(BF16).eval()
        if name == "mone_vit_s":
            model.set_mone_capacity(0.3)
        dense = _dense_vit_s(size).to(BF16)
        x = torch.randn(images, 3, size, size, dtype=BF16)
    task = model.task_names[0]

    def run(m) -> Callable[[], None]:
        def fwd() -> None:
            with torch.no_grad():
                m.forward_features(x, task)
        return fwd

    return run(model), run(dense)


def _attention(tokens: int, batch: int = 8, heads: int = 12, head_dim: int = 64):
    import torch.nn.functional as F

    from squad.kernels import routed_attention

    with META:
        q, k, v = (torch.randn(batch, heads, tokens, head_dim, dtype=BF16) for _ in range(3))

    def scores() -> None:
        with torch.no_grad():
            routed_attention(q, k, v, return_scores=True, backend="triton")

    def sdpa() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    return scores, sdpa


LAYERS = [
    Layer("moe_mlp", "dense_mlp", lambda: _blocks()["moe_mlp"], "<= 1.6", "<= 1.3", False,
          "moe_mlp_fwd_bwd_vs_dense_gpu"),
    Layer("moa", "mqa", lambda: _blocks()["moa"], "<= 1.6", "<= 1.4", False, "moa_fwd_bwd_vs_mqa_gpu"),
    Layer("mod_vit_s", "dense_vit_s", lambda: _inference("mod_vit_s"), "", ">= 1.6", True,
          "mod_vit_s_forward_vs_dense_gpu"),
    Layer("mone_vit_s", "dense_vit_s", lambda: _inference("mone_vit_s"), "<= 0.6", ">= 1.7", True,
          "mone_vit_s_forward_vs_dense_gpu"),
    Layer("attention_scores_n197", "sdpa", lambda: _attention(197), "", "<= 1.3", False,
          "attention_scores_fwd_n197_vs_sdpa"),
    Layer("attention_scores_n4096", "sdpa", lambda: _attention(4096), "", "<= 1.15", False,
          "attention_scores_fwd_n4096_vs_sdpa"),
]


def _counts(t: Traffic, model: costmodel.CostModel) -> dict:
    counts = t.totals()
    counts["large_atomics"] = sum(r.atomic and r.bytes_written >= LARGE_ATOMIC_BYTES for r in t.records)
    counts["model_ms"] = model.seconds(t.records) * 1e3
    counts["model_breakdown_ms"] = model.breakdown(t.records)
    return counts


def profile_layer(layer: Layer, model: costmodel.CostModel = costmodel.FITTED) -> list[BenchResult]:
    """The three rows of one layer (module docstring), every count in their details."""
    run, twin_run = layer.build()
    mine, twin = _counts(record(run), model), _counts(record(twin_run), model)
    details = {"name": layer.name, "layer": mine, "twin": twin, "twin_name": layer.twin, "gpu_case": layer.gpu_case,
               "dtype": "bfloat16", "path": "cuda (recorded on meta)", "model": model.as_dict()}
    byte_ratio = mine["gbytes"] / twin["gbytes"]
    time_ratio = (twin["model_ms"] / mine["model_ms"]) if layer.speedup else (mine["model_ms"] / twin["model_ms"])
    bad = mine["host_syncs"] + mine["large_atomics"]
    return [
        BenchResult(f"traffic_{layer.name}_bytes_vs_{layer.twin}", byte_ratio, layer.bytes_target, "x bytes",
                    check(byte_ratio, layer.bytes_target), details),
        BenchResult(f"traffic_{layer.name}_model_{'speedup_over' if layer.speedup else 'time_vs'}_{layer.twin}",
                    time_ratio, layer.time_target,
                    "x faster (H100 model)" if layer.speedup else "x time (H100 model)",
                    check(time_ratio, layer.time_target), details),
        BenchResult(f"traffic_{layer.name}_syncs_and_large_atomics", float(bad), "<= 0", "count", bad == 0, details),
    ]


def bench_traffic(quick: bool = False) -> list[BenchResult]:
    """Every layer's rows (the counts are exact and cheap: ``quick`` changes nothing) and, where git can reach
    84de653, the cost model's calibration rows (`squad.bench.calibrate.calibration_rows`)."""
    del quick
    rows = [row for layer in LAYERS for row in profile_layer(layer)]
    from .calibrate import calibration_rows

    return rows + calibration_rows()


def predictions(rows: Sequence[BenchResult]) -> dict[str, dict]:
    """The modelled figure of every GPU bench row the traffic rows predict: ``{gpu case: {"modelled": ratio,
    "layer": name, "unit": ...}}`` (what `squad.bench.gpucheck` puts beside each measured GPU figure)."""
    out = {}
    for r in rows:
        gpu = r.details.get("gpu_case")
        if gpu and "(H100 model)" in r.unit:
            out[gpu] = {"modelled": r.value, "traffic_row": r.case, "unit": r.unit}
    return out


def format_traffic(rows: Sequence[BenchResult]) -> str:
    """The traffic rows as one wide table: each layer and its twin with kernels, syncs, atomics (all, and those
    writing ≥ 1 MB), GFLOP, GB and modelled ms, then the ratios (layer / twin) and each target's figure and verdict
    (MoD and MoNE: the modelled speed-up, twin / layer)."""
    head = (f"{'layer (vs dense twin)':<26}{'kernels':>8}{'syncs':>6}{'atomics':>8}{'big atom':>9}{'GFLOP':>9}"
            f"{'GB':>7}{'model ms':>10}  targets")
    lines = [head, "-" * (len(head) + 40)]
    groups: dict[str, list[BenchResult]] = {}
    for r in rows:
        if "layer" in r.details and "name" in r.details:
            groups.setdefault(r.details["name"], []).append(r)
    for name, group in groups.items():
        layer, twin = group[0].details["layer"], group[0].details["twin"]
        for label, c in ((name, layer), (f"  {group[0].details['twin_name']}", twin)):
            lines.append(f"{label:<26}{c['kernels']:>8}{c['host_syncs']:>6}{c['atomics']:>8}{c['large_atomics']:>9}"
                         f"{c['gflop']:>9.1f}{c['gbytes']:>7.2f}{c['model_ms']:>10.2f}")
        ratio = [layer[k] / twin[k] if twin[k] else float("nan") for k in ("kernels", "gflop", "gbytes", "model_ms")]
        verdicts = "; ".join(f"{_short(r)} {r.value:.2f} (target {r.target}) {'yes' if r.ok else 'NO'}"
                             for r in group if r.target)
        lines.append(f"{'  ratio':<26}{ratio[0]:>8.2f}{'':>6}{'':>8}{'':>9}{ratio[1]:>9.2f}{ratio[2]:>7.2f}"
                     f"{ratio[3]:>10.2f}  {verdicts}")
    model = next((g[0].details["model"] for g in groups.values()), None)  # other cases' "model" is a config name
    if model is not None:
        lines.append("model ms = " + costmodel.CostModel(**model).describe() + " (a MODEL, not a measurement)")
    return "\n".join(lines)


def _short(row: BenchResult) -> str:
    if row.unit == "x bytes":
        return "bytes"
    if "(H100 model)" in row.unit:
        return "speed-up" if "faster" in row.unit else "time"
    return "syncs+big atomics"
