"""The traffic profile of `tools/bench.py` (``--only traffic``): what each routed layer asks of a GPU, against its
dense twin, counted on the CPU (`squad.bench.traffic`, the CUDA path, meta tensors at full size, bf16) and priced
by the H100 kernel model (`squad.bench.costmodel.KernelModel`, a MODEL: each kernel at the rate of what runs it, its
tiles' loads through an L2 model, a wave term, CUDA-core work; low / central / high from its constants' ranges).

Each layer and its twin run on inputs of their own (no gradient accumulates from one into the other), and the twins
are recorded with the fusions a dense layer has (`squad.bench.twins`: cuBLASLt's bias + GELU epilogues both ways, as
the routed kernels fuse bias, GELU and gate).

Layers, at the GPU rows' shapes (DESIGN.md "Traffic contract"):

- ``moe_mlp``: modsquad_vit_b's MoE MLP block (16 experts, top-4, width 768), forward + backward, 12 images × 13 tasks
  × 197 tokens, against the dense MLP of equal active FLOPs (hidden 4·768);
- ``moa``: its MoE attention (24 experts, top-12, head 64), forward + backward, against multi-query attention of
  equal FLOPs (12 query heads, one K/V head);
- ``mod_vit_s`` / ``mone_vit_s`` (e_c 0.3): ``forward_features`` of 256 images at 224 px for one task, no grad,
  against the dense ViT-S;
- ``attention_scores_n197`` / ``_n4096``: routed attention with A-MoD scores, forward, B 8 × H 12 × d 64, against
  SDPA without scores.

``moe_mlp``, ``moa`` and ``mone_vit_s`` run the backend ``auto`` takes (``model.moe.kernel`` / ``model.moa.kernel`` /
``model.mone.kernel``: the library op, or for MoE attention the form the layer's cost model prices lower, until a GPU
has measured); ``moe_mlp_triton``, ``moa_heads``, ``moa_routed`` and ``mone_vit_s_triton`` the other backends beside
them (no targets: the targets are the auto backend's).

Each layer gives three rows: bytes moved over the twin's (targets ≤ 1.6 for MoE MLP and MoE attention, ≤ 0.6 for
MoNE), the modelled H100 time over the twin's, central (a speed-up for MoD and MoNE: targets as the GPU contract's;
low and high in ``details["model_ratio"]``), and host syncs plus atomic ops writing ≥ 1 MB (target 0). Every count
(kernels, syncs, atomics, GFLOP, GB, tile-level GB, DRAM GB, modelled ms low / central / high, for the layer and its
twin) is in the rows' details; `format_traffic` prints them as one table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from squad.timing import BenchResult, check

from . import costmodel
from .traffic import Traffic, record
from .twins import fuse_dense

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
        gpu_case: the ``tools/bench.py --device cuda`` row this predicts (for a layer against a fused twin, the row
            against the compiled twin).
        eager_case: the row of the same layer against its eager twin (bias, GELU and their gradients separate
            passes: slower than the twin priced here, so the measured ratio reads lower); joined too, marked so.
    """

    name: str
    twin: str
    build: Callable[[], tuple[Callable[[], None], Callable[[], None]]]
    bytes_target: str
    time_target: str
    speedup: bool
    gpu_case: str
    eager_case: str = ""


def _fwd_bwd(module: Callable[..., torch.Tensor], x: torch.Tensor, *extra) -> Callable[[], None]:
    grad = torch.randn_like(x)  # made outside the recording: only the layer's own work counts

    def run() -> None:
        module(x, *extra).backward(grad)

    return run


def _blocks(kernel: str = "auto", moa_kernel: str = "auto") -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    from squad.layers.mlp import Mlp
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.moe_mlp import MoEMlp

    from .cases import MultiQueryAttention, _config, _segment_context

    cfg = _config("modsquad_vit_b")
    tasks, images = len(cfg.head_configs()), 12
    torch.manual_seed(0)

    def tokens() -> torch.Tensor:  # each layer and each twin its own input: no gradient accumulates into another's
        return torch.randn(images * tasks, cfg.num_tokens, cfg.embed_dim, dtype=BF16, requires_grad=True)

    with META:
        moe = MoEMlp(cfg.embed_dim, cfg.moe_hidden(), dataclasses.replace(cfg.moe, kernel=kernel), tasks).to(BF16)
        dense = fuse_dense(Mlp(cfg.embed_dim, cfg.moe.top_k * cfg.moe_hidden()).to(BF16))
        moa = MoEAttention(cfg.embed_dim, dataclasses.replace(cfg.moa, kernel=moa_kernel), tasks, cfg.qkv_bias).to(BF16)
        mqa = fuse_dense(MultiQueryAttention(cfg.embed_dim, cfg.moa.top_k, cfg.moa.head_dim).to(BF16))
        inputs = [tokens() for _ in range(4)]
    ctx = _segment_context(images, tasks, META)
    return {"moe_mlp": (_fwd_bwd(lambda x: moe(x, ctx()), inputs[0]), _fwd_bwd(dense, inputs[1])),
            "moa": (_fwd_bwd(lambda x: moa(x, ctx()), inputs[2]), _fwd_bwd(mqa, inputs[3]))}


def _inference(name: str, images: int = 256, size: int = 224, overrides: Sequence[str] = ()
               ) -> tuple[Callable[[], None], Callable[[], None]]:
    from .cases import _build, _dense_vit_s

    with META:
        model = _build(name, [f"model.img_size={size}", *overrides]).to(BF16).eval()
        if name == "mone_vit_s":
            model.set_mone_capacity(0.3)
        dense = fuse_dense(_dense_vit_s(size).to(BF16))
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
          "moe_mlp_fwd_bwd_vs_compiled_dense_gpu", "moe_mlp_fwd_bwd_vs_dense_gpu"),
    Layer("moe_mlp_triton", "dense_mlp", lambda: _blocks("triton")["moe_mlp"], "", "", False, ""),
    Layer("moa", "mqa", lambda: _blocks()["moa"], "<= 1.6", "<= 1.4", False, "moa_fwd_bwd_vs_compiled_mqa_gpu",
          "moa_fwd_bwd_vs_mqa_gpu"),
    Layer("moa_heads", "mqa", lambda: _blocks(moa_kernel="heads")["moa"], "", "", False, ""),
    Layer("moa_routed", "mqa", lambda: _blocks(moa_kernel="routed")["moa"], "", "", False, ""),
    Layer("mod_vit_s", "dense_vit_s", lambda: _inference("mod_vit_s"), "", ">= 1.6", True,
          "mod_vit_s_forward_vs_compiled_dense_gpu", "mod_vit_s_forward_vs_dense_gpu"),
    Layer("mone_vit_s", "dense_vit_s", lambda: _inference("mone_vit_s"), "<= 0.6", ">= 1.7", True,
          "mone_vit_s_forward_vs_compiled_dense_gpu", "mone_vit_s_forward_vs_dense_gpu"),
    Layer("mone_vit_s_triton", "dense_vit_s", lambda: _inference("mone_vit_s", overrides=["model.mone.kernel=triton"]),
          "", "", True, ""),
    Layer("attention_scores_n197", "sdpa", lambda: _attention(197), "", "<= 1.3", False,
          "attention_scores_fwd_n197_vs_sdpa"),
    Layer("attention_scores_n4096", "sdpa", lambda: _attention(4096), "", "<= 1.15", False,
          "attention_scores_fwd_n4096_vs_sdpa"),
]


def _counts(t: Traffic, gpu: str = "H100") -> dict:
    counts = t.totals()
    central = costmodel.KernelModel.at(gpu=gpu)
    counts["large_atomics"] = sum(r.atomic and r.bytes_written >= LARGE_ATOMIC_BYTES for r in t.records)
    counts["tile_gbytes"] = sum(r.tile_bytes for r in t.records) / 1e9
    counts["dram_gbytes"] = sum(central.dram_bytes(r) for r in t.records) / 1e9
    counts["model_ms"] = costmodel.time_range(t.records, gpu)
    counts["model_breakdown_ms"] = central.breakdown(t.records)
    counts["by_kind_ms"] = {kind: central.seconds([r for r in t.records if r.kind == kind]) * 1e3
                            for kind in sorted({r.kind for r in t.records})}
    return counts


def profile_layer(layer: Layer, gpu: str = "H100") -> list[BenchResult]:
    """The three rows of one layer (module docstring), every count in their details, priced by the kernel model of
    ``gpu`` (`costmodel.GPU_CONSTANTS`); the time row's value is the central modelled ratio, its
    ``details["model_ratio"]`` the low / central / high (`costmodel.ratio_range`)."""
    run, twin_run = layer.build()
    mine_t, twin_t = record(run), record(twin_run)
    mine, twin = _counts(mine_t, gpu), _counts(twin_t, gpu)
    ratio = (costmodel.ratio_range(twin_t.records, mine_t.records, gpu) if layer.speedup
             else costmodel.ratio_range(mine_t.records, twin_t.records, gpu))
    details = {"name": layer.name, "layer": mine, "twin": twin, "twin_name": layer.twin, "gpu_case": layer.gpu_case,
               "eager_case": layer.eager_case,
               "dtype": "bfloat16", "path": "cuda (recorded on meta)", "model_ratio": ratio,
               "model": costmodel.KernelModel.at(gpu=gpu).as_dict(), "model_gpu": gpu}
    constants = {name: dataclasses.asdict(c) for name, c in costmodel.constants_for(gpu).items()}  # time row only
    byte_ratio = mine["gbytes"] / twin["gbytes"]
    time_ratio = ratio["central"]
    bad = mine["host_syncs"] + mine["large_atomics"]
    return [
        BenchResult(f"traffic_{layer.name}_bytes_vs_{layer.twin}", byte_ratio, layer.bytes_target, "x bytes",
                    check(byte_ratio, layer.bytes_target), details),
        BenchResult(f"traffic_{layer.name}_model_{'speedup_over' if layer.speedup else 'time_vs'}_{layer.twin}",
                    time_ratio, layer.time_target,
                    f"x faster ({gpu} model)" if layer.speedup else f"x time ({gpu} model)",
                    check(time_ratio, layer.time_target), {**details, "constants": constants}),
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
    "layer": name, "unit": ..., "twin": "as priced" | "eager"}}`` (what `squad.bench.gpucheck` puts beside each
    measured GPU figure); a layer's row against its eager twin (``eager_case``) gets the same figure, marked
    ``"twin": "eager"``: the model prices the fused twin, so that row's measured ratio reads below the model's."""
    out = {}
    for r in rows:
        if not _modelled(r):
            continue
        ratio = r.details["model_ratio"]
        for key, twin in (("gpu_case", "as priced"), ("eager_case", "eager")):
            if r.details.get(key):
                out[r.details[key]] = {"modelled": r.value, "low": ratio["low"], "high": ratio["high"],
                                       "traffic_row": r.case, "unit": r.unit, "twin": twin}
    return out


def format_traffic(rows: Sequence[BenchResult]) -> str:
    """The traffic rows as one wide table: each layer and its twin with kernels, syncs, atomics (all, and those
    writing >= 1 MB), GFLOP, GB (each operand once), tile GB (what the tiles load with no cache), DRAM GB (the tiles'
    loads through the central L2 model) and modelled ms (low / central / high), then the ratios (layer / twin) and
    each target's figure with its range and verdict (MoD and MoNE: the modelled speed-up, twin / layer)."""
    head = (f"{'layer (vs dense twin)':<26}{'kernels':>8}{'syncs':>6}{'atomics':>8}{'big atom':>9}{'GFLOP':>9}"
            f"{'GB':>7}{'tile GB':>8}{'DRAM GB':>8}{'model ms low/central/high':>27}  targets")
    lines = [head, "-" * (len(head) + 40)]
    groups: dict[str, list[BenchResult]] = {}
    for r in rows:
        if "layer" in r.details and "model_ratio" in r.details:
            groups.setdefault(r.details["name"], []).append(r)

    def ms(c: dict) -> str:
        m = c["model_ms"]
        return f"{m['low']:.2f} / {m['central']:.2f} / {m['high']:.2f}"

    for name, group in groups.items():
        layer, twin = group[0].details["layer"], group[0].details["twin"]
        for label, c in ((name, layer), (f"  {group[0].details['twin_name']}", twin)):
            lines.append(f"{label:<26}{c['kernels']:>8}{c['host_syncs']:>6}{c['atomics']:>8}{c['large_atomics']:>9}"
                         f"{c['gflop']:>9.1f}{c['gbytes']:>7.2f}{c['tile_gbytes']:>8.2f}{c['dram_gbytes']:>8.2f}"
                         f"{ms(c):>27}")
        ratio = [layer[k] / twin[k] if twin[k] else float("nan")
                 for k in ("kernels", "gflop", "gbytes", "tile_gbytes", "dram_gbytes")]
        model = group[0].details["model_ratio"]
        verdicts = "; ".join(_verdict(r) for r in group if r.target)
        lines.append(f"{'  ratio':<26}{ratio[0]:>8.2f}{'':>6}{'':>8}{'':>9}{ratio[1]:>9.2f}{ratio[2]:>7.2f}"
                     f"{ratio[3]:>8.2f}{ratio[4]:>8.2f}"
                     f"{model['low']:>11.2f} / {model['central']:.2f} / {model['high']:.2f}  {verdicts}")
    if groups:
        gpu = next(iter(groups.values()))[0].details.get("model_gpu", "H100")
        lines.append(f"model ms = {gpu} kernel model (squad.bench.costmodel.KernelModel; a MODEL, not a measurement), "
                     "central: " + costmodel.KernelModel.at(gpu=gpu).describe())
        lines.append("low / high: every constant at the end of its range that lowers / raises the time (for ratios: "
                     "the ratio); the ranges and their sources are in squad/bench/costmodel.py CONSTANTS")
    return "\n".join(lines)


def _modelled(row: BenchResult) -> bool:
    """A layer's modelled time row (unit ``x time (H100 model)``, ``x faster (H200 model)``, ...)."""
    return row.unit.endswith(" model)") and "model_ratio" in row.details


def _verdict(row: BenchResult) -> str:
    ok = "yes" if row.ok else "NO"
    if _modelled(row):
        r = row.details["model_ratio"]
        return f"{_short(row)} {row.value:.2f} [{r['low']:.2f}-{r['high']:.2f}] (target {row.target}) {ok}"
    return f"{_short(row)} {row.value:.2f} (target {row.target}) {ok}"


def _short(row: BenchResult) -> str:
    if row.unit == "x bytes":
        return "bytes"
    if _modelled(row):
        return "speed-up" if "faster" in row.unit else "time"
    return "syncs+big atomics"
