"""A small H100 cost model that prices a `squad.bench.traffic` recording in milliseconds — a MODEL, not a measurement.

Every recorded kernel costs the longer of its arithmetic and its memory traffic, plus a fixed launch cost::

    t(op) = max(FLOPs / rate(kind), bytes / bandwidth) + launch          gemm, attention, triton
    t(op) = bytes / bandwidth + launch                                   memory (element-wise, copies, gathers)
    t(op) = bytes · scatter_penalty / bandwidth + launch                 scatter (atomic ops and embedding_bag)

Six constants: one FLOP rate each for cuBLAS GEMMs, PyTorch's fused (flash) attention and squad's Triton attention
kernels; one memory bandwidth; one launch cost (the per-kernel gap a GPU leaves between short kernels, and the
host's share when launches outpace the device); one penalty for kernels that accumulate into shared rows (atomics)
or reduce a bag of rows per thread (``embedding_bag``, which 84de653's MoE dispatch used, and which the H100
profile of ``shared/gpu/MEASURED.md`` found ~25× slower than its bytes). Host syncs are counted, not priced.

The constants are fitted (`fit`) to what one H100 measured at 84de653 (`MEASURED_CASES`: the MoE MLP and MoE
attention blocks and their dense twins, MoD / MoNE / dense ViT-S inference, the routed-attention ratios), each case
recorded on that commit's own code by `squad.bench.calibrate` (``tools/bench.py --fit-traffic``). `FITTED` holds
the result that ``reports/bench/traffic_fit.json`` records, with every case's residual. Treat a modelled time as an
estimate good to the residuals of the fit (tens of percent); bytes and kernels are exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from .traffic import OpRecord

SCATTER_OPS = ("_embedding_bag", "embedding_bag")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The constants of the model (module docstring).

    Attributes:
        gemm_tflops: FLOP rate of matmuls and convolutions (TFLOP/s).
        attention_tflops: FLOP rate of PyTorch's fused attention (flash), forward and backward (TFLOP/s).
        triton_tflops: FLOP rate of squad's Triton attention kernels (TFLOP/s).
        bandwidth_tbs: memory bandwidth every kernel's bytes are priced at (TB/s).
        launch_us: fixed cost of every kernel (µs).
        scatter_penalty: how many times the bandwidth cost an atomic or bag-reducing kernel pays.
    """

    gemm_tflops: float
    attention_tflops: float
    triton_tflops: float
    bandwidth_tbs: float
    launch_us: float
    scatter_penalty: float

    def op_seconds(self, r: OpRecord) -> float:
        """Modelled seconds of one recorded kernel (launch included)."""
        memory = r.bytes / (self.bandwidth_tbs * 1e12)
        if is_scatter(r):
            memory *= self.scatter_penalty
        rate = {"gemm": self.gemm_tflops, "attention": self.attention_tflops, "triton": self.triton_tflops}
        compute = r.flops / (rate[r.kind] * 1e12) if r.kind in rate else 0.0
        return max(compute, memory) + self.launch_us * 1e-6

    def seconds(self, records: Iterable[OpRecord]) -> float:
        """Modelled seconds of a recording."""
        return sum(self.op_seconds(r) for r in records)

    def breakdown(self, records: Iterable[OpRecord]) -> dict[str, float]:
        """Modelled milliseconds by what bounds each kernel: ``compute``, ``memory``, ``scatter`` and ``launch``."""
        out = {"compute": 0.0, "memory": 0.0, "scatter": 0.0, "launch": 0.0}
        for r in records:
            launch = self.launch_us * 1e-3
            body = self.op_seconds(r) * 1e3 - launch
            memory = r.bytes / (self.bandwidth_tbs * 1e9)
            key = "scatter" if is_scatter(r) else ("memory" if body <= memory * (1 + 1e-9) else "compute")
            out[key] += body
            out["launch"] += launch
        return out

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The constants in one line, for the tables."""
        return (f"H100 model: GEMM {self.gemm_tflops:.0f} TFLOP/s, flash attention {self.attention_tflops:.0f} "
                f"TFLOP/s, Triton attention {self.triton_tflops:.0f} TFLOP/s, {self.bandwidth_tbs:.2f} TB/s, "
                f"{self.launch_us:.1f} µs per kernel, atomics/embedding_bag {self.scatter_penalty:.1f}× their bytes")


def is_scatter(r: OpRecord) -> bool:
    """Atomic accumulation, or a reduction of bags of rows (``embedding_bag``)."""
    return r.atomic or r.op.startswith(SCATTER_OPS)


# The fit of `squad.bench.calibrate` (tools/bench.py --fit-traffic) at 84de653's recordings: see
# reports/bench/traffic_fit.json for the residuals. Refit when the recorder's counting changes.
FITTED = CostModel(gemm_tflops=667.8, attention_tflops=64.1, triton_tflops=63.2, bandwidth_tbs=2.49, launch_us=5.16,
                   scatter_penalty=11.2)

# ------------------------------------------------------------------------------------------------ calibration
# What the H100 measured at 84de653 (shared/gpu/MEASURED.md), as recorded cases (squad.bench.legacy) → figure.
# "ms": a median time of one recorded case; "ratio": the time of the first case over the second.


@dataclasses.dataclass(frozen=True)
class Measured:
    """One measured figure the model is fitted to.

    Attributes:
        name: the figure's name in the calibration table.
        cases: the recorded case (``ms``) or the two whose time ratio was measured (``ratio``).
        value: milliseconds or the ratio.
        unit: ``"ms"`` or ``"ratio"``.
        source: where MEASURED.md states it.
    """

    name: str
    cases: tuple[str, ...]
    value: float
    unit: str
    source: str


def _attention_rows() -> list[Measured]:
    src = "MEASURED.md: Triton attention rows, B 8, H 12, d 64, vs SDPA"
    triton_fwd = {197: 1.33, 1024: 1.18, 4096: 0.94}
    triton_fwd_bwd = {197: 1.78, 1024: 1.33, 4096: 0.93}
    scores_fwd = {197: 2.20, 1024: 1.68, 4096: 1.59}
    rows = []
    for n in (197, 1024, 4096):
        rows += [Measured(f"triton_fwd_vs_sdpa_n{n}", (f"attention_triton_fwd_n{n}", f"attention_sdpa_fwd_n{n}"),
                          triton_fwd[n], "ratio", src),
                 Measured(f"triton_fwd_bwd_vs_sdpa_n{n}",
                          (f"attention_triton_fwd_bwd_n{n}", f"attention_sdpa_fwd_bwd_n{n}"), triton_fwd_bwd[n],
                          "ratio", src),
                 Measured(f"scores_fwd_vs_sdpa_n{n}", (f"attention_scores_fwd_n{n}", f"attention_sdpa_fwd_n{n}"),
                          scores_fwd[n], "ratio", src)]
    return rows


MEASURED_CASES: list[Measured] = [
    Measured("moe_mlp_fwd_bwd", ("moe_mlp",), 11.2, "ms", "MEASURED.md: MoE MLP fwd+bwd, 12 img × 13 tasks"),
    Measured("dense_mlp_fwd_bwd", ("dense_mlp",), 2.34, "ms", "MEASURED.md: dense MLP of equal active FLOPs"),
    Measured("moa_fwd_bwd", ("moa",), 12.1, "ms", "MEASURED.md: MoE attention fwd+bwd"),
    Measured("mqa_fwd_bwd", ("mqa",), 2.19, "ms", "MEASURED.md: multi-query attention of equal FLOPs"),
    Measured("mone_vit_s_256", ("mone_vit_s",), 139.0, "ms", "MEASURED.md: MoNE ViT-S e_c 0.3, 256 images"),
    Measured("mod_vit_s_256", ("mod_vit_s",), 91.0, "ms", "MEASURED.md: MoD ViT-S, 256 images"),
    Measured("dense_vit_s_256", ("dense_vit_s",), 130.0, "ms", "MEASURED.md: dense ViT-S, 256 images"),
    *_attention_rows(),
]


def predict(model: CostModel, measured: Measured, recordings: Mapping[str, Sequence[OpRecord]]) -> float:
    """The model's figure for one measured case (milliseconds or a ratio)."""
    times = [model.seconds(recordings[c]) for c in measured.cases]
    return times[0] * 1e3 if measured.unit == "ms" else times[0] / times[1]


FIT_BOUNDS = {"gemm_tflops": (100.0, 990.0), "attention_tflops": (50.0, 990.0), "triton_tflops": (20.0, 990.0),
              "bandwidth_tbs": (0.5, 3.35), "launch_us": (0.5, 40.0), "scatter_penalty": (1.0, 200.0)}


FIT_GRID = 3  # values per constant in the coarse search that picks the starting points (3**6 models)
FIT_REFINED = 6  # the best models of that search refined by least squares


def _case_arrays(records: Sequence[OpRecord]):
    """(FLOPs, bytes × scatter multiplier flag, kind index, scatter flags) of a recording, as numpy arrays."""
    import numpy as np

    kinds = {"gemm": 0, "attention": 1, "triton": 2}
    flops = np.array([r.flops for r in records], dtype=float)
    nbytes = np.array([r.bytes for r in records], dtype=float)
    kind = np.array([kinds.get(r.kind, 3) for r in records], dtype=int)
    scatter = np.array([is_scatter(r) for r in records], dtype=bool)
    return flops, nbytes, kind, scatter


def fit(recordings: Mapping[str, Sequence[OpRecord]], cases: Sequence[Measured] = tuple(MEASURED_CASES)
        ) -> CostModel:
    """The constants that minimise the squared log-ratios of modelled to measured figures over ``cases``.

    Bounds (`FIT_BOUNDS`) keep every constant physical: no rate above the H100's dense bf16 peak (990 TFLOP/s), no
    bandwidth above its 3.35 TB/s. Each kernel's cost is the larger of two terms, so the error has kinks and local
    optima: a coarse search over a grid of every constant's range (log-spaced, `FIT_GRID` values each) picks the
    `FIT_REFINED` best starting points, each is refined by least squares, and the best result wins. Deterministic.
    """
    import itertools

    import numpy as np
    from scipy.optimize import least_squares

    names = list(FIT_BOUNDS)
    lo = np.log([FIT_BOUNDS[n][0] for n in names])
    hi = np.log([FIT_BOUNDS[n][1] for n in names])
    arrays = {c: _case_arrays(recordings[c]) for m in cases for c in m.cases}

    def seconds(case: str, x) -> float:
        gemm, attention, triton, bandwidth, launch, penalty = np.exp(x)
        flops, nbytes, kind, scatter = arrays[case]
        rate = np.array([gemm, attention, triton, np.inf])[kind] * 1e12
        memory = nbytes * np.where(scatter, penalty, 1.0) / (bandwidth * 1e12)
        return float(np.maximum(flops / rate, memory).sum() + len(flops) * launch * 1e-6)

    def residuals(x):
        out = []
        for m in cases:
            t = [seconds(c, x) for c in m.cases]
            value = t[0] * 1e3 if m.unit == "ms" else t[0] / t[1]
            out.append(math.log(value / m.value))
        return np.array(out)

    axes = [np.linspace(a + (b - a) / (2 * FIT_GRID), b - (b - a) / (2 * FIT_GRID), FIT_GRID) for a, b in zip(lo, hi,
                                                                                                             strict=True)]
    grid = sorted(itertools.product(*axes), key=lambda x: float(np.square(residuals(np.array(x))).sum()))
    best = None
    for x0 in grid[:FIT_REFINED]:
        found = least_squares(residuals, np.array(x0), bounds=(lo, hi), diff_step=1e-6, ftol=1e-12, xtol=1e-12,
                              gtol=1e-12)
        if best is None or found.cost < best.cost:
            best = found
    return CostModel(**{n: float(v) for n, v in zip(names, np.exp(best.x), strict=True)})


def residual_rows(model: CostModel, recordings: Mapping[str, Sequence[OpRecord]],
                  cases: Sequence[Measured] = tuple(MEASURED_CASES)) -> list[dict]:
    """Measured against modelled, case by case: ``name``, ``unit``, ``measured``, ``modelled``, ``error`` (modelled
    / measured − 1)."""
    rows = []
    for m in cases:
        value = predict(model, m, recordings)
        rows.append({"name": m.name, "unit": m.unit, "measured": m.value, "modelled": value,
                     "error": value / m.value - 1.0, "source": m.source})
    return rows
