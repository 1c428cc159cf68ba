"""The training step as a whole (issue 20): images/s, model FLOP utilisation and peak memory of the fused
multi-task step (forward, task losses, auxiliary losses, backward, AdamW), eager and compiled, with and without
activation checkpointing — the ``train_step`` case of tools/bench.py — and what it gives for a whole training run
(`squad.bench.plan`).

MFU = 6 × MACs of the step per image × images / step time, against the device's matmul rate measured in the same
process, timed interleaved with the steps (`MatmulProbe`: bf16 on a GPU, fp32 on the CPU). The MACs of a step
(`step_macs`) count what the fused step must compute: the blocks before the first task-specific block once per image
(shared rows), the rest of the backbone and the head once per task (`squad.profile`'s per-task counts).

On a GPU the case runs the paper widths in bf16 with 12 images; on the CPU a shrunken width (`CPU_WIDTH`) in fp32,
so that it runs in seconds: those rows measure the code path, not a GPU's figures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

import squad
from squad.analysis.flops import profile
from squad.bench.cases import CONFIG_DIR
from squad.bench.memory import peak_bytes, tensor_bytes
from squad.config.model import LossConfig, ModelConfig
from squad.models.vit import SquadOutput, SquadViT
from squad.timing import BenchResult, check, ratio_row, time_interleaved
from squad.train.losses import auxiliary_loss

# The CPU's stand-in for the paper widths: ViT-B's layer plan and experts at D 192, 4 blocks, 64 px (65 tokens).
CPU_WIDTH = ["model.img_size=64", "model.patch_size=8", "model.depth=4", "model.embed_dim=192", "model.num_heads=3"]
QUICK_WIDTH = ["model.img_size=32", "model.patch_size=8", "model.depth=2", "model.embed_dim=64", "model.num_heads=2",
               "model.head_dim=null", "model.moa.head_dim=16", "model.moa.num_experts=6", "model.moa.top_k=3",
               "model.moe.num_experts=4", "model.moe.top_k=2"]
STEP_CONFIGS = ["modsquad_vit_b", "mtl_vit_b"]
GPU_IMAGES = 12


# -------------------------------------------------------------------------------------------------- arithmetic
def step_macs(model: SquadViT, tasks: Sequence[str] | None = None) -> int:
    """MACs per image of one fused pass over ``tasks`` (default: all): the shared blocks once, every task's
    task-specific blocks and head once per task."""
    tasks = list(model.task_names if tasks is None else tasks)
    prof = profile(model, tasks)
    cfg = model.cfg
    first = model.first_task_block()
    shared = 0  # the patch embedding and the blocks before the first task-specific one (dense or A-MoD)
    if first > 0:
        shared = cfg.grid**2 * cfg.in_chans * cfg.patch_size**2 * cfg.embed_dim
        shared += sum(model.blocks[i].macs(cfg.num_tokens) for i in range(first))
    return round(shared + sum(entry["macs"] - shared for entry in prof["tasks"].values()))


class MatmulProbe:
    """A square matmul timed beside the steps, so the device's matmul rate is measured under the conditions the steps
    see (on a shared machine, the same neighbours): bf16 8192² on a GPU, fp32 1024² on the CPU (2048² / 512² with
    ``quick``)."""

    def __init__(self, device: torch.device | str, quick: bool = False):
        device = torch.device(device)
        cuda = device.type == "cuda"
        self.n = (2048 if quick else 8192) if cuda else (512 if quick else 1024)
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.a = torch.randn(self.n, self.n, device=device, dtype=self.dtype)
        self.b = torch.randn(self.n, self.n, device=device, dtype=self.dtype)

    def __call__(self) -> None:
        self.a @ self.b

    def rate(self, seconds: float) -> dict:
        """The rate for one matmul taking ``seconds``: FLOP/s and what was measured."""
        return {"flops": 2 * self.n**3 / seconds, "n": self.n, "dtype": str(self.dtype).removeprefix("torch."),
                "seconds": seconds}


def width_label(cfg: ModelConfig, overrides: Sequence[str]) -> str:
    """``"paper widths"``, or the shrunken model in a few words (D, depth, image size)."""
    if not overrides:
        return "paper widths"
    return f"shrunken: D {cfg.embed_dim}, depth {cfg.depth}, {cfg.img_size} px ({cfg.num_tokens} tokens)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


# ------------------------------------------------------------------------------------------------------- a step
@dataclasses.dataclass
class StepSetup:
    """What a measured step is: a model config, images per step, device and dtype, compile and checkpointing."""

    config: ModelConfig
    loss: LossConfig
    images: int
    device: torch.device
    dtype: torch.dtype
    compiled: bool = False
    checkpointing: str = "none"
    checkpoint_every: int = 2

    @property
    def label(self) -> str:
        ckpt = "" if self.checkpointing == "none" else f"_ckpt_{self.checkpointing}"
        return ("compiled" if self.compiled else "eager") + ckpt


class TrainStep:
    """One training step of a model on fixed random images: forward of every task in one fused pass, a per-task
    loss (mean square of the predictions: its cost is the heads'), the configured auxiliary losses (MI, balance),
    backward, AdamW (lr 1e-4, weight decay 0.05; its state allocated by a first step)."""

    def __init__(self, setup: StepSetup, tasks: Sequence[str] | None = None):
        self.setup = setup
        torch.manual_seed(0)
        self.model = squad.build_model(setup.config).to(setup.device, setup.dtype).train()
        self.model.set_activation_checkpointing(setup.checkpointing, setup.checkpoint_every)
        self.tasks = list(self.model.task_names if tasks is None else tasks)
        size = setup.config.img_size
        g = torch.Generator().manual_seed(1)
        self.images = torch.randn(setup.images, setup.config.in_chans, size, size, generator=g).to(
            setup.device, setup.dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.05)
        self.forward = torch.compile(self.model) if setup.compiled else self.model

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        out = self.forward(self.images, self.tasks)
        loss = sum(p.float().square().mean() for p in out.preds.values())
        aux, _ = auxiliary_loss(out.stats, self.setup.loss, distributed=False)
        (loss + aux.to(loss.device)).backward()
        self.optimizer.step()

    def resident_bytes(self) -> int:
        """Parameters and optimizer state (what stays allocated between steps)."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return tensor_bytes([*self.model.parameters(), *state])

    def grad_bytes(self) -> int:
        """Gradients of every trained parameter (part of what a step allocates on top of the resident bytes)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def peak_bytes(self) -> int | None:
        """Peak memory of a step: resident bytes + the peak the step allocates on top (None for a compiled step on
        the CPU, whose kernels the CPU tracker cannot follow)."""
        if self.setup.compiled and self.setup.device.type != "cuda":
            return None
        return self.resident_bytes() + peak_bytes(self, self.setup.device)


@dataclasses.dataclass
class StepResult:
    """A measured step: seconds (median), images/s, MFU, peak memory (bytes, or None), MACs per image; the resident
    bytes (parameters, optimizer state) and gradient bytes the peak includes."""

    setup: StepSetup
    seconds: float
    images_per_s: float
    mfu: float
    peak_bytes: int | None
    macs_per_image: int
    matmul_flops: float
    resident_bytes: int = 0
    grad_bytes: int = 0

    @property
    def activation_bytes(self) -> int | None:
        """The peak less parameters, optimizer state and gradients: activations and temporaries."""
        return None if self.peak_bytes is None else self.peak_bytes - self.resident_bytes - self.grad_bytes

    def details(self) -> dict:
        s = self.setup
        return {"step_s": self.seconds, "images": s.images, "mfu": self.mfu, "peak_memory_bytes": self.peak_bytes,
                "peak_memory_gib": None if self.peak_bytes is None else self.peak_bytes / 2**30,
                "macs_per_image": self.macs_per_image, "matmul_flops": self.matmul_flops,
                "device": device_name(s.device), "dtype": str(s.dtype).removeprefix("torch."),
                "compiled": s.compiled, "activation_checkpointing": s.checkpointing, "model": s.config.name}


def measure_steps(setups: Sequence[StepSetup], repeats: int = 5, warmup: int = 2,
                  tasks: Sequence[str] | None = None, quick: bool = False) -> tuple[list[StepResult | str], dict]:
    """Times the setups' steps (over ``tasks``, default all) and a `MatmulProbe` interleaved
    (`squad.timing.time_interleaved`, medians).

    Returns:
        (one `StepResult` per setup — or, for a setup whose first step fails (e.g. torch.compile), its error message
        —, the matmul rate the MFUs are against).
    """
    steps: list[TrainStep | str] = []
    for setup in setups:
        try:
            step = TrainStep(setup, tasks)
            step()  # builds the optimizer state; compiles
            steps.append(step)
        except Exception as e:  # noqa: BLE001 - a compile failure is a result of its own
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            steps.append(f"{type(e).__name__}: {first}"[:500])
    ready = [s for s in steps if isinstance(s, TrainStep)]
    probe = MatmulProbe(setups[0].device, quick)
    *step_times, t_probe = time_interleaved([*ready, probe], repeats=repeats, warmup=warmup)
    rate = probe.rate(t_probe)
    times = iter(step_times)
    out: list[StepResult | str] = []
    for step in steps:
        if isinstance(step, str):
            out.append(step)
            continue
        t = next(times)
        s = step.setup
        macs = step_macs(step.model, step.tasks)
        out.append(StepResult(s, t, s.images / t, 6 * macs * s.images / t / rate["flops"], step.peak_bytes(), macs,
                              rate["flops"], step.resident_bytes(), step.grad_bytes()))
    return out, rate


def load_step_config(name: str, overrides: Sequence[str] = ()):
    """A shipped model config (configs/model/NAME.yaml) with overrides: (model config, loss config)."""
    cfg = squad.load_config(CONFIG_DIR / f"{name}.yaml", list(overrides))
    return cfg.model, cfg.loss


# ---------------------------------------------------------------------------------------------------- the case
def bench_train_step(quick: bool = False, checkpointing: bool = True) -> list[BenchResult]:
    """The 13-task training step of modsquad_vit_b and mtl_vit_b with AdamW: images/s, MFU, peak memory; eager and
    compiled, with and without activation checkpointing (compiled rows are left out at --quick sizes: compiling
    takes minutes on a CPU). GPU: paper widths, bf16, 12 images. CPU: `CPU_WIDTH`, fp32, 12 images (--quick: tiny,
    4 images). A row's value is images/s; its details hold MFU and peak memory. Three more rows: the MFU contract
    (modsquad_vit_b, best setup), the mtl_vit_b 13-task step against its 1-task step (one backbone pass) and against
    the same step with every image copied per task (the layout before shared rows). ``checkpointing=False`` leaves
    out the activation-checkpointing setups (`squad.bench.gpucheck`: eager and compiled only)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    width = [] if cuda else (QUICK_WIDTH if quick else CPU_WIDTH)
    images = GPU_IMAGES if cuda or not quick else 4
    rows: list[BenchResult] = []
    variants = [(False, "none"), (False, "blocks")] + ([] if quick else [(True, "none"), (True, "blocks")])
    if not checkpointing:
        variants = [v for v in variants if v[1] == "none"]
    repeats = 3 if quick else (10 if cuda else 5)
    best: dict[str, StepResult] = {}
    for name in STEP_CONFIGS:
        model_cfg, loss_cfg = load_step_config(name, width)
        setups = [StepSetup(model_cfg, loss_cfg, images, device, dtype, compiled, ckpt) for compiled, ckpt in variants]
        results, rate = measure_steps(setups, repeats=repeats, quick=quick)
        for setup, res in zip(setups, results, strict=True):
            case = f"train_step_{name}_{setup.label}"
            if isinstance(res, str):
                rows.append(BenchResult(case, math.nan, "", "error", False,
                                        {"error": f"{setup.label} step failed: {res}", "model": name}))
                continue
            target = ">= 2000" if cuda and name == "mtl_vit_b" and setup.label == "eager" else ""
            rows.append(BenchResult(case, res.images_per_s, target, "img/s", check(res.images_per_s, target),
                                    {**res.details(), "width": width_label(model_cfg, width), "matmul": rate}))
            if name not in best or res.mfu > best[name].mfu:
                best[name] = res
    if "modsquad_vit_b" in best:
        res = best["modsquad_vit_b"]
        target = ">= 0.35" if cuda else ""
        rows.append(BenchResult("train_step_modsquad_vit_b_mfu", res.mfu, target, "MFU", check(res.mfu, target),
                                {**res.details(), "setup": res.setup.label,
                                 "width": width_label(res.setup.config, width)}))
    rows += _one_backbone_pass(width, images, device, dtype, repeats)
    return rows


def copied_rows_forward(model: SquadViT, images: torch.Tensor, tasks: Sequence[str]) -> SquadOutput:
    """The fused pass as it was before shared rows (the baseline of the shared-rows row): every image copied once
    per task before the first block, so the blocks that are the same for every task run once per task."""
    x0 = model.embed(images)
    b = x0.shape[0]
    tidx = model.task_index(tasks)
    rows = torch.arange(b, device=x0.device).repeat(len(tidx))
    task_ids = torch.tensor(tidx, device=x0.device).repeat_interleave(b)
    segments = [(t, i * b, (i + 1) * b) for i, t in enumerate(tidx)]
    tokens, ctx = model.forward_tokens(x0.index_select(0, rows), task_ids, segments)
    names = [model.task_names[t] for t in tidx]
    preds = {name: model.heads[name](tokens[i * b : (i + 1) * b]) for i, name in enumerate(names)}
    return SquadOutput(preds, dict.fromkeys(names, torch.arange(b, device=x0.device)), ctx.stats)


def _one_backbone_pass(width: Sequence[str], images: int, device, dtype, repeats: int) -> list[BenchResult]:
    """mtl_vit_b's 13-task step: over its 1-task step (one backbone pass and 13 heads: below 2, never 13), and the
    step with every image copied per task (`copied_rows_forward`, the layout before shared rows) over it."""
    model_cfg, loss_cfg = load_step_config("mtl_vit_b", width)
    setup = StepSetup(model_cfg, loss_cfg, images, device, dtype)
    all_tasks, one, copied = TrainStep(setup), TrainStep(setup, tasks=model_cfg.task_names[:1]), TrainStep(setup)
    copied.forward = lambda images, tasks: copied_rows_forward(copied.model, images, tasks)
    all_tasks(), one(), copied()
    t_all, t_one, t_copied = time_interleaved([all_tasks, one, copied], repeats=repeats, warmup=1)
    common = {"images": images, "width": width_label(model_cfg, width), "device": device_name(torch.device(device))}
    return [ratio_row("train_step_mtl_vit_b_13_tasks_vs_1_task", t_all, t_one, "<= 2", **common),
            ratio_row("train_step_mtl_vit_b_shared_vs_copied_rows", t_all, t_copied, ">= 5", faster=True,
                      **common)]
