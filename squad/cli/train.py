"""Train a squad model with DeepSpeed.

    deepspeed --num_gpus 8 tools/train.py --config configs/taskonomy/modsquad_vit_b.yaml --out runs/msq
    deepspeed --hostfile hosts tools/train.py --config ... --out runs/msq        # several nodes
    torchrun --nproc_per_node 2 tools/train.py --config configs/demo.yaml --out runs/demo
    accelerate launch --multi_gpu --num_processes 2 tools/train.py --config configs/demo.yaml --out runs/demo
    python tools/train.py --config configs/demo.yaml --set optim.steps=50        # one process (CPU or GPU)

With no GPU, DeepSpeed's CPU accelerator, gloo and fp32 are selected automatically. ``--resume auto`` (default)
continues the run in --out from its last complete checkpoint. ``--set train.compile=true`` runs the training step
under torch.compile (a key a resume may also change).

``accelerate launch`` starts N > 1 ranks with --multi_gpu (or --use_deepspeed), on GPUs or CPUs: it runs torchrun.
Without it, on a machine with fewer than 2 GPUs or with --cpu, accelerate starts ONE process, which stops with an
error saying so. The engine is DeepSpeed's under every launcher, and the precision is train.precision
(accelerate's --mixed_precision is not read).

The run folder is locked while a run uses it (run.lock names the holder; a second run into it exits 2). A resume
may change only the keys that keep it exact: optim.steps/epochs/min_lr/clip, train.log_every/eval_every/
ckpt_every/keep_checkpoints/stop_at/max_nonfinite/progress/activation_checkpointing/checkpoint_every/save_on_signal/
peer_timeout, data.root/workers/prefetch/device_decode/val_split/val_batches, model.moe.expert_parallel and
model.moa.expert_parallel (recorded in train.log, config.prev.yaml and run_history.jsonl), and
optim.batch_per_rank/grad_accum when the global batch stays the same; any other change is refused — start a new run
for it. A run resumes on any number of ranks that keeps its global batch (batch_per_rank × grad_accum × ranks), for
every ZeRO stage.

SIGTERM, SIGUSR1 and SIGHUP (train.save_on_signal) make every rank checkpoint at the next step boundary and exit 75,
leaving <out>/STOPPED: run the same command again to resume. Before the first training step (start-up, the step-0
validation) they exit 75 at once, with nothing to save. A second signal exits at once (128 + its number). Under the
deepspeed runner, signal the ranks (pkill -USR1 -f "tools/train.py --local_rank"): the runner passes nothing on, and
ranks whose runner is gone stop as on a signal. A peer rank silent for train.peer_timeout seconds (stopped, hung) or
dead ends the run with a line naming it (exit 3). Ctrl-C exits 130.
Arguments, config, paths and the run folder are checked before torch is imported: bad input exits 2 at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from squad.cli import missing_data, rerun_with_passive_omp, run

if TYPE_CHECKING:
    from squad.train.signals import SignalWatch


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``tools/train.py`` / ``squad-train``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="run config YAML (configs/demo.yaml, configs/taskonomy/...)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=1e-4 --set model.depth=6 (repeatable)")
    p.add_argument("--out", default=None, help="run folder (default: runs/<config name>)")
    p.add_argument("--resume", default="auto", help="auto (default), none, or a run/checkpoint folder")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the outputs of the run already in --out (checkpoints, logs, model.pt) and start over; "
                        "without it, --resume none (or another run's checkpoint) into a folder holding a run exits 2")
    p.add_argument("--allow-world-size-change", action="store_true",
                   help="resume on another number of ranks than the checkpoint was written by (the global batch "
                        "changes); without it such a resume exits 2")
    p.add_argument("--hf-out", default=None, metavar="FOLDER",
                   help="also write the final model as a Hugging Face-style folder (model.safetensors, config.json, "
                        "a model card with the run's metrics and command; squad.load opens it)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p


def preflight(args: argparse.Namespace, signals: SignalWatch | None = None):
    """Everything that can refuse the run before torch is imported: the config (keys, types, values), the data
    folder, ``train.init``, the run folder's lock (rank 0) and the resume against the folder (every rank reads it:
    `squad.train.run_folder.assess`). A refusal exits 2 in a fraction of a second. Rank 0 of a launch holds the
    lock before the rendezvous, a fresh folder's too: two runs started into one folder at once are told apart by it,
    not by the port they both asked for.

    Args:
        args: the parsed arguments.
        signals: the tool's `squad.train.signals.SignalWatch`: from here on it watches the config's
            ``train.save_on_signal``, and a stop leaves its record in the locked folder.

    Returns:
        (config, run folder, the lock or None).
    """
    from squad.config.loading import load_config
    from squad.config.run import RunConfig
    from squad.runtime import launch_rank, launch_world
    from squad.train.run_folder import RunLock, assess, init_file, lock_before_start
    from squad.train.stops import clear_stop_record, write_stop_record

    cfg = load_config(args.config, args.set, cls=RunConfig)
    if signals is not None:
        signals.watch(cfg.train.save_on_signal)
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    missing_data(cfg.data.root, cfg.data.dataset)
    init_file(cfg, out, args.resume, args.overwrite)
    lock = lock_before_start(out)
    try:
        assess(out, cfg, args.resume, launch_world() or 1, overwrite=args.overwrite,
               allow_world_size_change=args.allow_world_size_change)
        if lock is None and not launch_rank():  # a fresh folder (or a plain run): locked before the rendezvous too
            if out.exists() and not out.is_dir():
                raise NotADirectoryError(f"--out {out} is a file, not a folder (the run folder)")
            try:
                out.mkdir(parents=True, exist_ok=True)
                lock = RunLock.acquire(out, {"world_size": launch_world()} if launch_world() else None)
            except OSError as e:
                raise PermissionError(f"run folder {out} is not writable: {e.strerror or e}") from e
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if lock is not None:
        clear_stop_record(out)
        if signals is not None:
            signals.at_exit(lock.release)
            signals.on_stop(lambda message: write_stop_record(out, message))
    return cfg, out, lock


def _train(argv: list[str] | None) -> int:
    from squad.runtime import launch_rank
    from squad.train.signals import DEFAULT_SIGNALS, SignalWatch

    signals = SignalWatch(DEFAULT_SIGNALS, announce=not launch_rank())  # a stop from the first moment: exit 75
    signals.install()
    args = build_parser().parse_args(argv)
    try:
        if args.hf_out:
            from squad.io.files import check_writable

            check_writable(Path(args.hf_out), "--hf-out", folder=True)  # refused before training, not after
        cfg, out, lock = preflight(args, signals)  # nothing heavy imported yet
    except BaseException:
        signals.restore()  # a refused run leaves the process as it found it (a tool called in-process)
        raise

    from squad.distributed import prepare_environment

    prepare_environment()  # before deepspeed is imported anywhere
    from squad.train.engine import train

    path = train(cfg, out, args.resume, overwrite=args.overwrite,
                 allow_world_size_change=args.allow_world_size_change, lock=lock, signals=signals)

    if not launch_rank():  # once per launch, not once per rank (None: one plain process)
        print(f"model: {path}")
        if args.hf_out:
            import squad
            from squad.deploy.hf import save_pretrained

            save_pretrained(squad.load(path), args.hf_out)
            print(f"folder: {args.hf_out} (model.safetensors, config.json, README.md; squad.load opens it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Trains the run a config describes; exit 2 on bad input, 3 when training stops (`squad.cli.run`)."""
    return run(_train, argv)


def console() -> int:
    """The ``squad-train`` console script: `main` with ``OMP_WAIT_POLICY=PASSIVE`` in effect."""
    rerun_with_passive_omp(__name__)
    return main()


if __name__ == "__main__":
    sys.exit(main())
