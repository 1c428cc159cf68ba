"""Plain test helpers: tiny model and run configs, tiny models, and how a tool runs as a subprocess (environment,
launcher).

Fixtures (the session's tiny synthetic dataset, the tool loader) live in tests/conftest.py.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import yaml

import squad
from squad.config.model import SquadConfig
from squad.distributed import free_port
from squad.layers.routing import TaskLinear
from tests.toolserver import ToolServer, with_group

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEEPSPEED = str(Path(sys.executable).parent / "deepspeed")
RANK_LAUNCHER = str(ROOT / "tests" / "rank_launcher.py")  # `launcher`: ranks forked from a preloaded interpreter
MODEL_CONFIGS = sorted(p for p in (ROOT / "configs" / "model").glob("*.yaml") if not p.name.startswith("_"))

# Shrinks any paper config to a size that runs in milliseconds on the CPU, keeping its layer plan and kinds.
TINY = [
    "model.img_size=32",
    "model.patch_size=8",
    "model.embed_dim=64",
    "model.num_heads=4",
    "model.depth=4",
    "model.moa.head_dim=16",
    "model.moa.num_experts=6",
    "model.moa.top_k=3",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.mod.capacity=0.5",
]

# The plan of `tiny_model`: MoE attention + MoE MLP, then a MoD block with a MoE MLP.
TINY_PLAN = [{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "moe", "mod": "learned"}]


def tiny_config(path: Path | str, extra: list[str] | None = None) -> SquadConfig:
    """A paper config at test widths (dense attention head width reset to D / heads)."""
    cfg = squad.load_config(path, TINY + ["model.head_dim=null"] + (extra or []))
    return cfg


def tiny_model_cfg(**model) -> squad.ModelConfig:
    """A tiny ModelConfig from keyword fields (two heads by default)."""
    data = {
        "img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4,
        "heads": [{"name": "a", "kind": "dense", "channels": 2}, {"name": "b", "kind": "class", "channels": 5}],
    }
    data.update(model)
    return squad.model_config(data)


def tiny_model(heads, plan=None, seed: int = 0, **model) -> squad.SquadViT:
    """A tiny SquadViT whose routers have random (not zero) weights, so tokens spread over the experts."""
    data = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
            "plan": plan or TINY_PLAN,
            "moa": {"num_experts": 6, "top_k": 2, "head_dim": 8, "router": {"noise": False}},
            "moe": {"num_experts": 6, "top_k": 2, "router": {"noise": True}},
            "mod": {"capacity": 0.5}, "heads": list(heads)}
    data.update(model)
    torch.manual_seed(seed)
    m = squad.build_model(squad.model_config(data))
    randomize_routers(m, seed)
    return m.eval()


@torch.no_grad()
def randomize_routers(model: torch.nn.Module, seed: int = 0, std: float = 0.5) -> None:
    """Random gate weights for every per-task bank (noise banks stay at zero)."""
    g = torch.Generator().manual_seed(seed)
    for name, m in model.named_modules():
        if isinstance(m, TaskLinear) and not name.endswith(".noise"):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)


@torch.no_grad()
def routed_inference_model(name: str) -> squad.SquadViT:
    """Paper config ``name`` at test widths in eval mode, every per-task bank drawn N(0, 0.5) (the global generator,
    seeded 0 before the build) and MoNE's α at 0.3, so routing and the router's gate both reach the outputs."""
    from squad.layers.mone import MoNEBlock

    torch.manual_seed(0)
    model = squad.build_model(tiny_config(ROOT / "configs" / "model" / f"{name}.yaml").model).eval()
    for m in model.modules():
        if isinstance(m, MoNEBlock):
            m.alpha.fill_(0.3)
        elif isinstance(m, TaskLinear):
            m._parameters["weight"].normal_(0, 0.5)
    return model


def compile_triton_for_gpu(fn, types: dict[str, str], constexprs: dict, options: dict, sm: int):
    """Lowers the Triton kernel body ``fn`` to a cubin for an sm_``sm`` GPU, no GPU needed (the interpreter alone
    proves no compile). ``types``: Triton type of each pointer or float argument by name (others are i32)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    names = list(inspect.signature(fn).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = ASTSource(JITFunction(fn), signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", sm, 32), options=options)


def assert_compiles_for_gpu(fn, types: dict[str, str], constexprs: dict, options: dict, sm: int) -> None:
    """`compile_triton_for_gpu` gives a cubin whose shared memory fits an sm_86 block (99 KiB)."""
    compiled = compile_triton_for_gpu(fn, types, constexprs, options, sm)
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.shared <= 99 * 1024, compiled.metadata.shared


def logged_losses(run_dir: Path) -> dict[int, float]:
    """The total training loss a run logged to TensorBoard, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss/total")}


def tool_env(**extra: str) -> dict[str, str]:
    """The environment of a tool run as a subprocess: CPU DeepSpeed, one thread, no launcher variables inherited."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_command(argv: list[str], cwd: Path | str = ROOT, env: dict[str, str] | None = None, timeout: float = 300,
                code_any_imports: bool = False) -> subprocess.CompletedProcess:
    """Runs a command as ``subprocess.run(argv, capture_output=True, text=True)`` would, in its own session (killed
    whole past ``timeout``: subprocess.TimeoutExpired).

    A plain ``python tools/<name>.py ...`` in the tool environment (``env`` defaults to `tool_env`) is forked from
    this test worker's preloaded interpreter (`tests.toolserver`) instead of starting a new one: the same run
    without 3-4 s of imports each time. So is ``python -c CODE`` with ``code_any_imports`` (code that does not
    check which modules an interpreter has imported).
    """
    env = tool_env() if env is None else env
    server = _tool_server(argv, env, code_any_imports)
    if server is not None:
        rc, out, err = server.run(argv, cwd, env, timeout)
        if rc == "timeout":
            raise subprocess.TimeoutExpired(argv, timeout, out, err)
        return subprocess.CompletedProcess(argv, rc, out, err)
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


_SERVER: list[ToolServer] = []


def _tool_server(argv: list[str], env: dict[str, str], code: bool) -> ToolServer | None:
    """The worker's tool server when ``argv`` is a forkable run (`run_command`), else None."""
    script = argv[1] if len(argv) > 1 else ""
    tool = script.endswith(".py") and Path(script).parent.name == "tools" or script == RANK_LAUNCHER
    if argv[0] not in (PY, "python") or not (tool or (code and script == "-c" and len(argv) > 2)) \
            or os.environ.get("SQUAD_TEST_FORK") == "0":
        return None
    if not _SERVER:
        _SERVER.append(ToolServer(PY, tool_env()))
        atexit.register(_SERVER[0].close)
    return _SERVER[0] if _SERVER[0].compatible(env) else None



def launcher(ranks: int = 1, deepspeed: bool = False) -> list[str]:
    """The command prefix that runs a tool on ``ranks`` ranks: plain python, or ``ranks`` ranks on a free port forked
    from one preloaded interpreter (`tests.rank_launcher`: what ``deepspeed --num_gpus N`` gives each rank, without
    its runner's, launcher's and every rank's own imports), or with ``deepspeed`` the real launcher (for the tests of
    what goes through it: signals, a peer stopped or killed)."""
    if ranks == 1:
        return [PY]
    program = [DEEPSPEED] if deepspeed else [PY, RANK_LAUNCHER]
    return [*program, "--num_gpus", str(ranks), "--master_port", str(free_port())]


def write_run_config(path: Path, data_root: Path, heads: list[str], **sections: dict) -> Path:
    """Writes the tests' tiny run config (MoE attention + MoE MLP, then a learned MoD block; depth 2 at 32 px).

    Args:
        path: the YAML file to write.
        data_root: ``data.root``.
        heads: ``model.heads``.
        sections: keys per section (``optim={"steps": 4}``) that replace the defaults' keys of that section.
    """
    cfg = {
        "model": {
            "img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2,
            "plan": [{"attn": "moa", "mlp": "moe"}, {"attn": "dense", "mlp": "dense", "mod": "learned"}],
            "moa": {"num_experts": 4, "top_k": 2, "head_dim": 16, "router": {"noise": False}},
            "moe": {"num_experts": 4, "top_k": 2, "router": {"noise": True}},
            "mod": {"capacity": 0.5},
            "heads": list(heads),
        },
        "loss": {"w_mi": 0.01, "weighting": "equal"},
        "data": {"root": str(data_root), "workers": 0, "augment": False},
        "optim": {"lr": 5e-3, "warmup_steps": 2, "steps": 60, "batch_per_rank": 4, "weight_decay": 0.0},
        "train": {"seed": 0, "log_every": 5, "eval_every": 0, "ckpt_every": 30, "progress": False},
    }
    for section, keys in sections.items():
        cfg[section].update(keys)
    path.write_text(yaml.safe_dump(cfg))
    return path
