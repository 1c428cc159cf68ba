"""H100 cost models that price a `squad.bench.traffic` recording in milliseconds — MODELS, not measurements.

- `KernelModel` (what ``tools/bench.py --only traffic`` prices with): each kernel at the rate of what runs it
  (cuBLAS, the library's grouped GEMM, squad's Triton GEMMs, flash, squad's Triton attention), the loads of its
  tiles through an L2 model, a wave term, element-wise work on CUDA cores; every constant a range with its source
  (`CONSTANTS`), every time low / central / high (`time_range`, `ratio_range`).
- `CostModel`, the fitted model below (six constants fitted to what one H100 measured; ``--fit-traffic``).

The fitted model: every recorded kernel costs the longer of its arithmetic and its memory traffic, plus a fixed
launch cost::

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
FITTED_KINDS = {"grouped_gemm": "gemm", "squad_gemm": "gemm"}  # the fitted model prices every GEMM at one rate


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
        kind = FITTED_KINDS.get(r.kind, r.kind)
        compute = r.flops / (rate[kind] * 1e12) if kind in rate else 0.0
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

    kinds = {"gemm": 0, "grouped_gemm": 0, "squad_gemm": 0, "attention": 1, "triton": 2}
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


# ================================================================================================ the kernel model
# What `tools/bench.py --only traffic` prices with: each kernel at the rate of what runs it, its tiles' loads through
# an L2 model, a wave term and CUDA-core work, every constant a range (its source beside it). Not fitted: the fitted
# model above stays for `--fit-traffic`, which reports this model's residuals against MEASURED.md too.


@dataclasses.dataclass(frozen=True)
class Constant:
    """An uncertain constant of `KernelModel`: its central value and the two ends of its range.

    Attributes:
        central: the value the central estimate takes.
        fast: the end of its range that gives the shorter modelled time.
        slow: the end that gives the longer one.
        source: where the values come from.
    """

    central: float
    fast: float
    slow: float
    source: str


CONSTANTS: dict[str, Constant] = {
    "cublas_tflops": Constant(
        667.8, 790.0, 600.0,
        "central: the fit to 16 figures one H100 measured at 84de653, where cuBLAS ran every GEMM "
        "(reports/bench/traffic_fit.json, shared/gpu/MEASURED.md); fast: a dense bf16 8192^3 matmul on the same kind "
        "of machine (MEASURED.md, ~790); slow: -10 %, inside the fit's +-15 % residuals on the GEMM-bound blocks"),
    "grouped_mm_tflops": Constant(
        580.0, 667.8, 500.0,
        "central: aten::_grouped_mm (CUTLASS) on these very shapes, both MoE projections fwd+bwd, 4.5 ms for 3 "
        "iterations of 870 GFLOP (MEASURED.md); fast: the dense cuBLAS rate above; slow: -14 %, one profiled "
        "measurement with no spread and near-balanced groups (a trained router's uneven groups add partial tiles)"),
    "squad_gemm_tflops": Constant(
        367.0, 468.0, 267.0,
        "f = 0.55 (0.4-0.7) of the cuBLAS rate 668 (shared/gpu/ESTIMATED.md): published Triton gather/scatter grouped "
        "GEMMs on H100 reach 0.45-0.75 of cuBLAS (Liger-Kernel's tuned one 501 TFLOP/s forward, 413 fwd+bwd; "
        "ScatterMoE-style kernels ~0.54 of SonicMoE's throughput); 128x128x32 tiles without TMA sit low in it"),
    "flash_tflops": Constant(
        64.1, 80.0, 51.0,
        "central: the fit (flash attention on ViT's 197 tokens leaves tiles mostly empty); range +-25 %, the fit's "
        "residuals on the attention-kernel ratios (-24 ... +42 %, traffic_fit.json)"),
    "triton_attention_tflops": Constant(
        63.2, 79.0, 50.6,
        "central: the fit; range +-25 %, the fit's residuals on the attention-kernel ratios"),
    "cuda_core_tops": Constant(
        33.5, 67.0, 16.7,
        "H100 SXM: 132 SMs x 128 FP32 lanes x 1.98 GHz = 33.5 T instructions/s, the datasheet's 67 TFLOP/s counting "
        "an FMA as two (fast: every op an FMA-able pair); slow: half, the conversions, masks and address arithmetic "
        "issuing on the same pipes"),
    "bandwidth_tbs": Constant(
        2.49, 3.0, 2.2,
        "central: the fit; fast: 0.9 of the H100 SXM's 3.35 TB/s HBM3 peak (what streaming kernels reach); slow: "
        "0.66 of peak, short kernels of tens of MB (ramp-up and tail)"),
    "launch_us": Constant(
        5.16, 2.5, 7.0,
        "central: the fit; fast: ~2.5 us, back-to-back kernels when the GPU sets the pace (CUDA graphs); slow: "
        "MEASURED.md's eager MoE MLP spent 38 ms of CPU against 28 ms of CUDA time, the host setting the pace "
        "(5.16 x 38 / 28)"),
    "scatter_penalty": Constant(
        11.2, 5.0, 25.0,
        "central: the fit; slow: MEASURED.md's embedding_bag ran ~25x slower than its bytes; fast: 5"),
    "l2_mb": Constant(
        50.0, 50.0, 25.0,
        "the H100 SXM's 50 MB L2 (NVIDIA H100 whitepaper); slow: 25 MB, one of its two partitions (an SM's near half)"),
    "l2_retention": Constant(
        0.5, 1.0, 0.0,
        "of a sweep longer than L2, the share C/D of a re-read that still hits: 1 under random replacement, 0 under "
        "LRU (a cyclic sweep past capacity misses every time); NVIDIA does not document its policy: 0.5 central"),
}
"""The kernel model's constants for an H100, each with its range and source (`Constant`)."""

# Another GPU: the constants that differ from the H100's (the rest are the H100's: the same GH100 chip, 132 SMs and
# tensor-core rate; an 8192^3 bf16 matmul ran at 788-798 TFLOP/s on both kinds here).
GPU_CONSTANTS: dict[str, dict[str, Constant]] = {
    "H100": {},
    "H200": {
        "bandwidth_tbs": Constant(
            3.57, 4.3, 3.17,
            "the H100's fitted 2.49 TB/s times 1.43, the ratio of the device-to-device copies the two kinds "
            "measured here (4.3 against 3.0 TB/s, bytes read and written); fast: 0.9 of the H200's 4.8 TB/s HBM3e "
            "peak; slow: 0.66 of it, short kernels"),
        "l2_mb": Constant(
            60.0, 60.0, 30.0,
            "the L2 PyTorch reported on this workplace's H200s (60 MB; 50 MB on its H100s); slow: one partition"),
    },
}


def gpu_model_name(device_name: str | None) -> str:
    """The `GPU_CONSTANTS` key for a CUDA device name (``torch.cuda.get_device_name``): ``H200`` for an H200, else
    ``H100`` (the model's own GPU; other GPUs are priced as one, a caveat the reports state)."""
    return "H200" if device_name and "H200" in device_name.upper() else "H100"


def constants_for(gpu: str = "H100") -> dict[str, Constant]:
    """The kernel model's constants for ``gpu`` (a `GPU_CONSTANTS` key)."""
    if gpu not in GPU_CONSTANTS:
        raise ValueError(f"no cost model for GPU {gpu!r}; known: {', '.join(GPU_CONSTANTS)}")
    return {**CONSTANTS, **GPU_CONSTANTS[gpu]}


SMS = 132  # streaming multiprocessors of an H100 SXM or an H200 (NVIDIA's datasheets)

RATE_OF_KIND = {"gemm": "cublas_tflops", "grouped_gemm": "grouped_mm_tflops", "squad_gemm": "squad_gemm_tflops",
                "attention": "flash_tflops", "triton": "triton_attention_tflops"}


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """An H100 cost model that prices what each recorded kernel does (values of `CONSTANTS`; `at` picks them)::

        t(op) = max(FLOPs / rate(kind) · waves + cuda_core_ops / cuda_core_rate, DRAM bytes / bandwidth) + launch

    - rate(kind): cuBLAS for ``gemm``, the library grouped GEMM (``aten::_grouped_mm``) for ``grouped_gemm``,
      squad's Triton GEMMs for ``squad_gemm``, flash and squad's Triton attention;
    - DRAM bytes: the op's bytes, plus each tile-level re-read (`OpRecord.reloads`) that misses L2: none when the
      bytes touched between two reads fit L2 (D <= C), else 1 - retention · C / D of it;
    - waves: a grid of P equal programs (`OpRecord.programs`) on `SMS` SMs takes ceil(P / SMS) rounds, so it runs
      at P / (ceil(P / SMS) · SMS) of the rate (1 for a grid of whole waves, 0.55 for 144 programs);
    - CUDA-core work (element-wise operations in a GEMM kernel: MoNE's re-normalisation, GELU) adds to the arithmetic;
    - atomic and bag-reducing kernels pay their bytes ``scatter_penalty`` times.
    """

    cublas_tflops: float
    grouped_mm_tflops: float
    squad_gemm_tflops: float
    flash_tflops: float
    triton_attention_tflops: float
    cuda_core_tops: float
    bandwidth_tbs: float
    launch_us: float
    scatter_penalty: float
    l2_mb: float
    l2_retention: float

    @classmethod
    def at(cls, ends: str | Mapping[str, str] = "central", gpu: str = "H100") -> KernelModel:
        """The model of ``gpu`` (`GPU_CONSTANTS`) with every constant at ``ends`` (``"central"``, ``"fast"`` or
        ``"slow"``), or each named one at its own (the rest central)."""
        constants = constants_for(gpu)
        pick = {name: ends for name in constants} if isinstance(ends, str) else dict(ends)
        return cls(**{name: getattr(c, pick.get(name, "central")) for name, c in constants.items()})

    def miss(self, distance: float) -> float:
        """Share of a re-read that misses L2 when ``distance`` bytes are touched between the two reads."""
        capacity = self.l2_mb * 1e6
        return 0.0 if distance <= capacity else 1.0 - self.l2_retention * capacity / distance

    def dram_bytes(self, r: OpRecord) -> float:
        """The op's bytes and every re-read of its tiles that misses L2."""
        return r.bytes + sum(size * extra * self.miss(distance) for size, extra, distance in r.reloads)

    @staticmethod
    def waves(programs: int) -> float:
        """How much longer than its work at the full rate a grid of ``programs`` equal programs takes (>= 1)."""
        if programs <= 0:
            return 1.0
        return math.ceil(programs / SMS) * SMS / programs

    def compute_seconds(self, r: OpRecord) -> float:
        rate = RATE_OF_KIND.get(r.kind)
        tensor = r.flops / (getattr(self, rate) * 1e12) * self.waves(r.programs) if rate else 0.0
        return tensor + r.cuda_core_ops / (self.cuda_core_tops * 1e12)

    def memory_seconds(self, r: OpRecord) -> float:
        memory = self.dram_bytes(r) / (self.bandwidth_tbs * 1e12)
        return memory * self.scatter_penalty if is_scatter(r) else memory

    def op_seconds(self, r: OpRecord) -> float:
        """Modelled seconds of one recorded kernel (launch included)."""
        return max(self.compute_seconds(r), self.memory_seconds(r)) + self.launch_us * 1e-6

    def seconds(self, records: Iterable[OpRecord]) -> float:
        """Modelled seconds of a recording."""
        return sum(self.op_seconds(r) for r in records)

    def breakdown(self, records: Iterable[OpRecord]) -> dict[str, float]:
        """Modelled milliseconds by what bounds each kernel (``compute``, ``memory``, ``scatter``, ``launch``)."""
        out = {"compute": 0.0, "memory": 0.0, "scatter": 0.0, "launch": 0.0}
        for r in records:
            compute, memory = self.compute_seconds(r), self.memory_seconds(r)
            key = "compute" if compute > memory else ("scatter" if is_scatter(r) else "memory")
            out[key] += max(compute, memory) * 1e3
            out["launch"] += self.launch_us * 1e-3
        return out

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The constants in one line, for the tables."""
        return (f"cuBLAS {self.cublas_tflops:.0f}, grouped_mm {self.grouped_mm_tflops:.0f}, squad Triton GEMMs "
                f"{self.squad_gemm_tflops:.0f}, flash {self.flash_tflops:.0f}, Triton attention "
                f"{self.triton_attention_tflops:.0f} TFLOP/s, CUDA cores {self.cuda_core_tops:.1f} Tops/s, "
                f"{self.bandwidth_tbs:.2f} TB/s, L2 {self.l2_mb:.0f} MB (retention {self.l2_retention:.1f}), "
                f"{self.launch_us:.1f} us a kernel, atomics {self.scatter_penalty:.0f}x, {SMS} SMs")


def time_range(records: Sequence[OpRecord], gpu: str = "H100") -> dict[str, float]:
    """Modelled milliseconds of a recording on ``gpu`` at every constant's fast end, centre and slow end (``low``,
    ``central``, ``high``)."""
    return {label: KernelModel.at(end, gpu).seconds(records) * 1e3
            for label, end in (("low", "fast"), ("central", "central"), ("high", "slow"))}


def ratio_range(num: Sequence[OpRecord], den: Sequence[OpRecord], gpu: str = "H100") -> dict[str, float]:
    """The modelled time ratio num / den: ``central`` with every constant central; ``low`` / ``high`` with each
    constant at whichever end of its range lowers / raises the ratio (each end found with the others central: the
    ratio moves one way along each constant's range), so a ratio's range holds every combination of the constants'
    ends, not only the all-fast and all-slow ones."""
    def ratio(model: KernelModel) -> float:
        return model.seconds(num) / model.seconds(den)

    central = ratio(KernelModel.at(gpu=gpu))
    lower, upper = {}, {}
    for name in CONSTANTS:
        fast, slow = ratio(KernelModel.at({name: "fast"}, gpu)), ratio(KernelModel.at({name: "slow"}, gpu))
        lower[name], upper[name] = ("fast", "slow") if fast <= slow else ("slow", "fast")
    low, high = ratio(KernelModel.at(lower, gpu)), ratio(KernelModel.at(upper, gpu))
    return {"low": min(low, central), "central": central, "high": max(high, central)}


def kernel_residual_rows(recordings: Mapping[str, Sequence[OpRecord]],
                         cases: Sequence[Measured] = tuple(MEASURED_CASES)) -> list[dict]:
    """The kernel model against what an H100 measured, case by case: ``measured``, ``low`` / ``modelled`` (central) /
    ``high`` (`time_range`, or `ratio_range` for a ratio), ``error`` (central / measured − 1) and ``inside`` (the
    measured figure within low..high)."""
    rows = []
    for m in cases:
        if m.unit == "ratio":
            r = ratio_range(recordings[m.cases[0]], recordings[m.cases[1]])
        else:
            r = time_range(recordings[m.cases[0]])
        rows.append({"name": m.name, "unit": m.unit, "measured": m.value, "low": r["low"], "modelled": r["central"],
                     "high": r["high"], "error": r["central"] / m.value - 1.0,
                     "inside": r["low"] <= m.value <= r["high"], "source": m.source})
    return rows
