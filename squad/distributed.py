"""Process-group set-up for the deepspeed launcher, torchrun (also ``accelerate launch --multi_gpu``) and plain
``python`` (one process).

With no GPU, DeepSpeed's CPU accelerator and gloo are selected before DeepSpeed is imported (``DS_ACCELERATOR=cpu``).
A plain ``python`` run gets the rendezvous variables DeepSpeed needs (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) so it never looks for MPI.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from squad import runtime


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extensions_dir() -> Path:
    """The folder of this installation's JIT-built torch extensions (DeepSpeed's CPU communication op).

    torch keys its extension cache (``~/.cache/torch_extensions/py311_cu130/<op>``) by the Python and CUDA versions
    only, but the op's build command holds the include paths of the installation that builds it (its
    ``site-packages/torch/include``, ``deepspeed/ops/csrc``). Two checkouts with their own virtual environments
    sharing that cache rebuild each other's op every time (ninja sees another command: two command hashes in its
    ``.ninja_log``), and every rank of every run waits on the cache's lock meanwhile (60–120 s on 2 cores). So each
    installation keeps its own: ``<venv>/torch_extensions/squad-<digest>`` inside a virtual environment, else a
    folder of the default cache, both named by the installation's paths. ``TORCH_EXTENSIONS_DIR`` set by the user is
    kept.

    The name matters inside the virtual environment too: one copied to another checkout with hard links (``cp -al``,
    as a fast clone does) would otherwise share the build files, ninja log and lock of the original's folder through
    the links, and the two would rebuild each other's op at every start exactly as through the shared cache.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    where = f"{sys.prefix}|{Path(torch.__file__).parent}"
    name = f"squad-{hashlib.sha1(where.encode()).hexdigest()[:12]}"
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "torch_extensions" / name
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return base / name


def use_own_extensions() -> Path:
    """Points ``TORCH_EXTENSIONS_DIR`` at `extensions_dir` (before DeepSpeed builds or loads an op); returns it.

    ``make``'s set-up (tools/prepare_deepspeed.py) builds the op there once, and every run of the same
    installation loads that build instead of rebuilding it.
    """
    path = extensions_dir()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


class _DropMessages(logging.Filter):
    """Drops log records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_cpu_start() -> None:
    """Silences the two lines every CPU start printed and nobody acts on: torch's "No CUDA runtime is found, using
    CUDA_HOME=..." (a machine with a CUDA toolkit and no GPU) and DeepSpeed's "... deepspeed_shm_comm_op built
    successfully" (printed whenever the op is loaded, built or not: `init_distributed` holds it back)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropMessages) for f in logger.filters):
        logger.addFilter(_DropMessages("No CUDA runtime is found"))


def prepare_environment() -> None:
    """Sets the accelerator and rendezvous variables a launcher would have set, and this installation's extension
    folder (`use_own_extensions`). Call before importing deepspeed."""
    quiet_cpu_start()
    use_own_extensions()
    if not cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    check_accelerate_launch()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
            _own_port.add(os.environ["MASTER_PORT"])
    os.environ.setdefault("LOCAL_RANK", "0")


_own_port: set[str] = set()  # ports a one-process run picked itself: moving off one of them needs no message


def check_accelerate_launch() -> None:
    """Refuses the one process ``accelerate launch --num_processes N`` (N > 1) starts when it falls back to its
    simple launcher.

    accelerate runs ``--multi_gpu`` (and ``--use_deepspeed``) launches through torchrun, which sets RANK and
    WORLD_SIZE; without those flags on a machine with fewer than 2 GPUs, and always with ``--cpu`` (whose
    multi-process mode is ``mpirun`` with ``--mpirun_hostfile``), it runs the script ONCE and only sets MASTER_ADDR
    and MASTER_PORT (which it does only for N > 1) beside its ACCELERATE_* variables. Training on would quietly use
    one rank instead of N.

    Raises:
        ValueError: launched that way (the message says which command starts N ranks).
    """
    env = os.environ
    ranked = any(k in env for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    if ranked or "ACCELERATE_MIXED_PRECISION" not in env or "MASTER_PORT" not in env:
        return
    raise ValueError("accelerate launch started this script once although --num_processes asked for more: without "
                     "--multi_gpu on a machine with fewer than 2 GPUs, or with --cpu (its CPU multi-process mode "
                     "needs mpirun and --mpirun_hostfile), accelerate runs one process. Start N ranks with "
                     "`accelerate launch --multi_gpu --num_processes N tools/train.py ...` (torchrun underneath: GPUs, "
                     "or CPUs with gloo), or pass --num_processes 1 for one process")


# On GPUs the group has gloo for CPU tensors beside nccl for CUDA ones: squad all-reduces a few small host tensors
# (each step's finite-loss and stop flags, the logged loss sums, the expert-usage tables at a checkpoint), which a
# group of nccl alone refuses ("No backend type associated with device type cpu"); one GPU per rank never notices,
# since one rank makes no collective.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def process_group_backend(cuda: bool) -> str:
    """The backend string of the process group: `GPU_BACKEND` on GPUs, gloo on CPUs."""
    return GPU_BACKEND if cuda else "gloo"


def init_distributed() -> tuple[int, int, torch.device]:
    """Initialises the process group through DeepSpeed (gloo on CPUs; nccl and gloo on GPUs, `GPU_BACKEND`).

    Returns:
        (rank, world size, this process's device).
    """
    prepare_environment()
    import deepspeed

    cuda = cuda_available()
    if not cuda:
        threads = runtime.cpu_threads_per_rank()
        if threads:
            torch.set_num_threads(threads)
        runtime.tune_cpu_allocator()
    if not dist.is_initialized():
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # DeepSpeed prints "... shm_comm_op built successfully" here
            for attempt in range(3):
                try:
                    deepspeed.init_distributed(dist_backend=process_group_backend(cuda), verbose=False)
                    break
                except dist.DistNetworkError as e:  # a one-rank run's port is taken (rank 0 hosts the store and
                    # no other rank looks for it, so it may listen elsewhere; a run of several ranks may not)
                    if "EADDRINUSE" in str(e) and os.environ.get("WORLD_SIZE") != "1":
                        raise port_in_use() from None
                    if attempt == 2 or os.environ.get("WORLD_SIZE") != "1" or "EADDRINUSE" not in str(e):
                        raise
                    port = os.environ["MASTER_PORT"]
                    os.environ["MASTER_PORT"] = str(free_port())
                    if port not in _own_port:
                        print(f"[squad] MASTER_PORT {port} is in use; this one-rank run listens on "
                              f"{os.environ['MASTER_PORT']} instead", file=sys.stderr)
                    _own_port.add(os.environ["MASTER_PORT"])
        rest = [line for line in printed.getvalue().splitlines() if not line.endswith("built successfully")]
        if rest:
            print("\n".join(rest))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def port_in_use() -> ValueError:
    """The error of a launch whose rendezvous port another process holds (another run started on the default port,
    29500): rank 0 cannot host the store there, and the ranks of several cannot move elsewhere on their own."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "?")
    return ValueError(f"the rendezvous port {addr}:{port} (MASTER_PORT) is in use by another process, e.g. another "
                      f"run started on the launcher's default port: give this launch a free one (deepspeed "
                      f"--master_port N, torchrun --master_port N)")


def on_every_rank(error: BaseException) -> BaseException:
    """Marks an error that every rank raises alike (an outcome rank 0 broadcast): the tools print it once, on rank 0
    (`squad.cli.run`); an error a rank meets alone is printed by that rank. Exception classes that are always raised
    that way say so with a class attribute ``every_rank = True``.

    Returns:
        ``error``.
    """
    error.every_rank = True  # type: ignore[attr-defined]
    return error


def has_process_group() -> bool:
    """True when a process group is initialised, even one with a single rank (a one-process DeepSpeed run).

    Ask this where the group itself matters (rank-sharded samplers, setting one up); ask `is_distributed` where
    the question is whether anything must be summed across ranks.
    """
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """True when a process group with more than one rank is running (the one test for "all-reduce needed")."""
    return has_process_group() and dist.get_world_size() > 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; no autograd)."""
    if is_distributed():
        t = t.clone()
        dist.all_reduce(t)
    return t


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s Python object on every rank."""
    if is_distributed():
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return obj


def shutdown() -> None:
    """Tears the process group down (if one is up) before the interpreter exits.

    A rank that leaves with its gloo group still alive can die in C++ teardown ("terminate called without an
    active exception", SIGABRT) when a peer closes first; the launcher then reports 250 instead of the tool's own
    exit code (e.g. 2 for a run folder under a file). Never raises: it runs on the way out of an error too.
    """
    if not has_process_group():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway; the exit code that matters is the tool's
        pass
    _forget_deepspeed_groups()


def _forget_deepspeed_groups() -> None:
    """Drops DeepSpeed's cached sub-groups of the destroyed process group, so that a later run in the same process
    (a tool called twice, the tests) builds them on its new group instead of failing with "Group ... is not
    registered" in `deepspeed.initialize`."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        cache = getattr(groups, name, None)
        if isinstance(cache, dict):
            cache.clear()


def check_device(name: str) -> torch.device:
    """The `torch.device` a ``--device`` argument names, checked against this machine.

    Raises:
        ValueError: not a device name, CUDA asked for where there is none, or a GPU index that does not exist
            (the message names the value and what this machine has).
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {name}: not a device name (use cpu, cuda or cuda:N; {e})") from None
    if device.type == "cuda":
        if not cuda_available():
            raise ValueError(f"--device {name}: this machine has no CUDA GPU (torch.cuda.is_available() is "
                             f"False); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: squad runs on cpu or cuda, not {device.type}")
    return device
