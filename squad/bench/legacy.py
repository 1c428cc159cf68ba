"""Records what an H100 measured at 84de653 (``shared/gpu/MEASURED.md``), on that commit's own code: the cases the
H100 cost model (`squad.bench.costmodel`) is fitted to.

Run as a script, not imported: ``python legacy.py --bench BENCH_DIR --out FILE`` with ``PYTHONPATH`` set to a
checkout of the old commit (`squad.bench.calibrate` prepares one and runs this). ``squad`` is then the OLD package;
the recorder is the current tree's (``BENCH_DIR`` = its ``squad/bench``, loaded under another package name).
Every case is recorded on the meta device at full size in bf16, as the GPU ran it:

- the old code branches on ``tensor.is_cuda`` (it has no forced-device switch): ``torch.Tensor.is_cuda`` reads True
  while recording, so its routed layers take their CUDA branches and every attention its Triton kernels;
- a Triton launch cannot run on meta tensors: the old kernels (``_fwd_kernel``, ``_scores_kernel``,
  ``_bwd_dkdv_kernel``, ``_bwd_dq_kernel``) are recorded instead of launched (`squad.bench.cuda_path.TritonLaunches`:
  their operands' bytes, 4 / 2 / 8 / 6 · B·H·M²·d FLOPs), while the PyTorch code around them runs and is recorded;
- host reads: the old MoE dispatch's ``bincount`` (a sync on CUDA) returns its ``minlength`` vector on meta;
  nothing else on these paths reads the device.

The cases replay ``shared/gpu/probe.py`` (sections moe, moa, modmone) and the routed-attention GPU rows of the old
``tools/bench.py``: the same modules, shapes, loss (``y.float().square().mean()``) and inputs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator

import torch

BF16 = torch.bfloat16
META = torch.device("meta")
PACKAGE = "squad_bench_current"


def load_current(bench_dir: str):
    """The current tree's ``squad/bench`` as package `PACKAGE` (``squad`` here is the old package): its traffic and
    cuda_path modules."""
    spec = importlib.util.spec_from_file_location(PACKAGE, f"{bench_dir}/__init__.py",
                                                  submodule_search_locations=[bench_dir])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.traffic"), importlib.import_module(f"{PACKAGE}.cuda_path")


def old_kernels(cuda_path) -> dict:
    """The Triton kernels of 84de653: the forward, a separate key-major score pass, the two backward kernels."""
    kernel = cuda_path.Kernel
    return {"_fwd_kernel": kernel(4.0, (4, 5), 4), "_scores_kernel": kernel(2.0, (4,), 3),
            "_bwd_dkdv_kernel": kernel(8.0, (7, 8), 3), "_bwd_dq_kernel": kernel(6.0, (7,), 3)}


@contextlib.contextmanager
def cuda_branches(recorder, cuda_path) -> Iterator[None]:
    """The old code's CUDA branches on meta tensors: ``is_cuda`` reads True, Triton launches are recorded."""
    from squad.kernels import triton_attention as tk

    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        with cuda_path.recorded_launches(tk, recorder, old_kernels(cuda_path)):
            yield
    finally:
        del torch.Tensor.is_cuda  # back to the C property of torch._C.TensorBase


# ------------------------------------------------------------------------------------------------- the cases
def _loss_backward(y: torch.Tensor) -> None:
    y.float().square().mean().backward()


def _task_ctx(rows: int, num_tasks: int):
    from squad.layers.context import ForwardContext

    per = rows // num_tasks
    ids = (torch.arange(rows, device=META) // per).clamp(max=num_tasks - 1)
    segs = [(t, t * per, (t + 1) * per if t < num_tasks - 1 else rows) for t in range(num_tasks)]
    return ForwardContext(task_ids=ids, num_tasks=num_tasks, segments=segs)


def block_cases() -> dict[str, Callable[[], None]]:
    """probe.py moe / moa: modsquad_vit_b's MoE MLP and MoE attention and their dense twins, fwd+bwd."""
    from squad.bench.cases import MultiQueryAttention, _router_config
    from squad.config.model import MoAConfig, MoEConfig
    from squad.layers.mlp import Mlp
    from squad.layers.moe_attention import MoEAttention
    from squad.layers.moe_mlp import MoEMlp

    d, tasks, rows, tokens = 768, 13, 12 * 13, 197
    with META:
        moe = MoEMlp(d, d, MoEConfig(num_experts=16, top_k=4, router=_router_config()), num_tasks=tasks).to(BF16)
        dense = Mlp(d, 4 * d).to(BF16)
        moa = MoEAttention(d, MoAConfig(num_experts=24, top_k=12, head_dim=64, router=_router_config()),
                           num_tasks=tasks).to(BF16)
        mqa = MultiQueryAttention(d, 12, 64).to(BF16)
        x = torch.randn(rows, tokens, d, dtype=BF16, requires_grad=True)
    return {"moe_mlp": lambda: _loss_backward(moe(x, _task_ctx(rows, tasks))),
            "dense_mlp": lambda: _loss_backward(dense(x)),
            "moa": lambda: _loss_backward(moa(x, _task_ctx(rows, tasks))),
            "mqa": lambda: _loss_backward(mqa(x))}


def model_cases(images: int = 256) -> dict[str, Callable[[], None]]:
    """probe.py modmone: ``model(x)`` of dense ViT-S, MoD ViT-S and MoNE ViT-S (e_c 0.3), every task, no grad."""
    import squad
    from squad.bench.cases import _dense_vit_s

    with META:
        dense = _dense_vit_s(224).to(BF16).eval()
        mod = squad.create_model("mod_vit_s", img_size=224).to(BF16).eval()
        mone = squad.create_model("mone_vit_s", img_size=224).to(BF16).eval()
        mone.set_mone_capacity(0.3)
        x = torch.randn(images, 3, 224, 224, dtype=BF16)

    def infer(model) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                model(x)
        return run

    return {"dense_vit_s": infer(dense), "mod_vit_s": infer(mod), "mone_vit_s": infer(mone)}


def attention_cases(tokens: tuple[int, ...] = (197, 1024, 4096), batch: int = 8, heads: int = 12,
                    head_dim: int = 64) -> dict[str, Callable[[], None]]:
    """The old routed-attention GPU rows: SDPA, the Triton kernel without scores (fwd, fwd+bwd) and with A-MoD
    scores (fwd), B 8, H 12, d 64, gradients by ``torch.autograd.grad``."""
    import torch.nn.functional as F

    from squad.kernels import routed_attention

    cases: dict[str, Callable[[], None]] = {}
    for n in tokens:
        with META:
            q, k, v = (torch.randn(batch, heads, n, head_dim, dtype=BF16, requires_grad=True) for _ in range(3))
            grad = torch.randn(batch, heads, n, head_dim, dtype=BF16)
        fns = {"sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
               "triton": lambda q=q, k=k, v=v: routed_attention(q, k, v, backend="triton"),
               "scores": lambda q=q, k=k, v=v: routed_attention(q, k, v, return_scores=True, backend="triton")[0]}
        for name, fn in fns.items():
            cases[f"attention_{name}_fwd_n{n}"] = lambda fn=fn: _no_grad(fn)
            if name != "scores":
                cases[f"attention_{name}_fwd_bwd_n{n}"] = (
                    lambda fn=fn, q=q, k=k, v=v, grad=grad: torch.autograd.grad(fn(), (q, k, v), grad))
    return cases


def _no_grad(fn: Callable[[], object]) -> None:
    with torch.no_grad():
        fn()


def main(argv: list[str] | None = None) -> int:
    """Records every case and writes ``{case: [record, ...]}`` as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="the current tree's squad/bench folder")
    p.add_argument("--out", required=True, help="where to write the records (JSON)")
    args = p.parse_args(argv)
    traffic, cuda_path = load_current(args.bench)
    cases = {**block_cases(), **model_cases(), **attention_cases()}
    out = {}
    for name, fn in cases.items():
        with traffic.TrafficRecorder() as rec, cuda_branches(rec, cuda_path):
            fn()
        out[name] = [traffic.record_dict(r) for r in rec.records]
        print(f"{name}: {rec.summary().totals()}", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
