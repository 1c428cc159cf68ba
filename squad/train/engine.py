"""The DeepSpeed training loop: one fused multi-task pass per step, uncertainty-weighted task losses, the MI loss
across ranks, periodic validation, TensorBoard logs, checkpoints that resume exactly, and the exported model.

The loop reads step → log → validate → checkpoint (`squad.train.checkpointer.Checkpointer.save`, which also stops
the run at ``train.stop_at`` and on the signals of ``train.save_on_signal``).

Exact resumption: the data order is the sampler's (seed, epoch) permutation with the consumed batches skipped,
augmentation draws come from (seed, epoch, index), and the torch RNG (router noise, task sampling) is reseeded from
(seed, step, slot) every micro-batch, the slot being the micro-batch's place in the global batch — so nothing but the
step counters needs saving beside DeepSpeed's own state, and a run resumed on another number of ranks with the same
global batch (`squad.data.samplers.ResumableSampler`) draws the same noise for the same images.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from squad.analysis.figures import usage_figure
from squad.config.base import to_dict
from squad.config.run import RunConfig, deepspeed_config, precision
from squad.data import build_dataset, build_loader, eval_loader, report, set_epoch
from squad.data.device import decode_batch, is_integer_batch
from squad.data.loaders import loader_workers
from squad.distributed import (
    all_reduce_sum,
    broadcast_object,
    cuda_available,
    init_distributed,
    prepare_environment,
)
from squad.eval.evaluate import evaluate
from squad.io import export_model
from squad.io.files import atomic_write_text, write_failure
from squad.io.weights import read_init_source
from squad.layers.parallel import full_state_dict, shard_model
from squad.models import compile as squad_compile
from squad.models.transfer import initialize_from
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT, build_model
from squad.tasks import get_task
from squad.train.checkpointer import Checkpointer
from squad.train.expert_layout import ExpertLayout, whole_params
from squad.train.expert_shards import ExpertShards, check_layout, expert_parallel_sizes
from squad.train.objective import MultiTaskObjective, nonfinite_stop
from squad.train.optim import lr_lambda, param_groups, warmup_note
from squad.train.run_folder import RunFolder, RunLock, init_file, lock_before_start
from squad.train.shm import ShmSegments
from squad.train.signals import SignalWatch
from squad.train.stops import PeerLost, Preempted, TrainingError, clear_stop_record, write_stop_record
from squad.train.watchdog import PeerWatch

log = logging.getLogger("squad.train")


@dataclasses.dataclass
class LoopState:
    step: int = 0  # optimiser steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed in this epoch, per rank
    nonfinite: int = 0  # consecutive non-finite losses
    world: int = 0  # the ranks and micro-batch size batch_in_epoch counts in (0: written before they were saved)
    batch_per_rank: int = 0

    def rescaled(self, world: int, batch_per_rank: int) -> LoopState:
        """The same data position for a run with ``world`` ranks of ``batch_per_rank`` images: the images consumed in
        the epoch, in this run's micro-batches (rounded up to a whole one: only a resume that changes the global
        batch can leave a remainder)."""
        state = dataclasses.replace(self, world=world, batch_per_rank=batch_per_rank)
        if self.world and (self.world, self.batch_per_rank) != (world, batch_per_rank):
            images = self.batch_in_epoch * self.world * self.batch_per_rank
            state.batch_in_epoch = -(-images // (world * batch_per_rank))
        return state


class Trainer:
    """Runs one training job (`tools/train.py` is a thin wrapper around it; `train` runs one and cleans up).

    Args:
        cfg: the run config.
        run_dir: the run folder (locked while the run lasts).
        resume: ``"auto"`` (the folder's last complete checkpoint, if any), ``"none"``, or a run/checkpoint folder.
        overwrite: delete the outputs of a run already in ``run_dir`` and start over.
        allow_world_size_change: resume on another number of ranks than the checkpoint was written by, with another
            global batch (the same global batch needs no flag).
        init_state: weights for the freshly built model (a state dict of the same model, names and shapes
            checked), loaded before DeepSpeed takes the model; a run that resumes loads its checkpoint over them.
            ``train.init`` does the same from a file.
        lock: the run folder's lock when the caller took it already (`squad.cli.train`, before importing torch).
        signals: the stop signals' watch when the caller installed it already (`squad.cli.train`, when the process
            started); else one is installed here.
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto", *,
                 overwrite: bool = False, allow_world_size_change: bool = False,
                 init_state: Mapping[str, torch.Tensor] | None = None, lock: RunLock | None = None,
                 signals: SignalWatch | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.overwrite = overwrite
        self.allow_world_size_change = allow_world_size_change
        self.init_state = init_state
        prepare_environment()
        if lock is None:
            lock = lock_before_start(self.run_dir)  # a folder in use is refused before the heavy start-up below
        try:
            shm = ShmSegments.from_env()
            shm.record(self.run_dir)  # before DeepSpeed creates them, so a crash at any point leaves a record
            self.rank, self.world, self.device = init_distributed()
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self.folder = RunFolder(self.run_dir, self.rank, self.world, shm, lock)
        self.cuda = cuda_available()
        self.prec = precision(cfg.train, self.cuda)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.prec)
        self.checkpointer = Checkpointer(self.run_dir, self.rank, self.world, cfg.train,
                                         partitioned=cfg.train.zero_stage > 0 or self.prec == "bf16",
                                         config=to_dict(cfg), signals=signals)
        self.signals = self.checkpointer.signals
        self.signals.at_exit(self.folder.release_lock)
        self.signals.install()
        self.watch = PeerWatch(self.rank, self.world, self.run_dir, self.signals, cfg.train.peer_timeout)
        self.signals.at_exit(self.watch.mark_left)
        self.watch.start()
        self.tasks = cfg.train_tasks()
        self.writer = None
        self.log_handler: logging.Handler | None = None

    # ------------------------------------------------------------------------------------------------ set-up
    def _datasets(self):
        d = self.cfg.data
        common = dict(image_size=self.cfg.model.img_size, resize=d.resize, missing=d.missing, seed=self.cfg.train.seed,
                      split_csv=d.split_csv, dataset=d.dataset, task_options=self.cfg.model.task_options)
        train = build_dataset(d.root, self.tasks, d.split, augment=d.augment, **common)
        try:
            val = build_dataset(d.root, self.tasks, d.val_split, augment=False, **common)
        except ValueError as e:  # e.g. no buildings in the validation split
            log.warning("no validation data (%s): validation is skipped", e)
            val = None
        return train, val

    def _setup_logging(self) -> None:
        if self.rank != 0:
            logging.getLogger("squad").setLevel(logging.WARNING)
            return
        handler = logging.FileHandler(self.run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root = logging.getLogger("squad")
        root.addHandler(handler)
        self.log_handler = handler  # removed by `close`, so a second run in this process logs to its own folder
        root.setLevel(logging.INFO)
        if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                   for h in root.handlers):
            console = logging.StreamHandler()
            console.setFormatter(logging.Formatter("[squad] %(message)s"))
            root.addHandler(console)

    def _open_writer(self, resumed_at: int | None) -> None:
        """Rank 0's TensorBoard writer, once the run has started; a resumed run hides the stopped run's events after
        its checkpoint (``purge_step``), since those steps run again."""
        if self.rank != 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        purge = {} if resumed_at is None else {"purge_step": resumed_at + 1}
        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"), **purge)

    def setup(self) -> None:
        import deepspeed

        init = init_file(self.cfg, self.run_dir, self.resume, self.overwrite)  # before the run folder is touched
        check_layout(self.cfg.model, self.world, self.prec)
        source = self.folder.prepare(self.cfg, self.resume, overwrite=self.overwrite,
                                     allow_world_size_change=self.allow_world_size_change)
        if self.rank == 0:  # the folder is this run's now: an earlier stop's record goes, this run's may come
            clear_stop_record(self.run_dir)
            self.signals.on_stop(self.record_stop)
        self._setup_logging()
        for note in self.folder.notes:
            log.warning(note)
        torch.manual_seed(self.cfg.train.seed)
        self.train_set, self.val_set = self._datasets()
        self.checkpointer.data = self.train_set.identity()  # recorded in each tag, compared on resume
        o = self.cfg.optim
        # the loader draws its workers' base seed from its own generator, never from the global RNG that the
        # step reseeds (router noise), so where an epoch starts does not shift the noise
        d = self.cfg.data
        self.workers = loader_workers(d.workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.loader = build_loader(self.train_set, o.batch_per_rank, seed=self.cfg.train.seed,
                                   num_workers=self.workers, rank=self.rank, world=self.world,
                                   grad_accum=o.grad_accum, pin_memory=self.cuda, prefetch=d.prefetch,
                                   device_decode=d.device_decode, block=d.block, buffer=d.shuffle_buffer)
        if self.rank == 0:
            order = (f"blocks of {d.block} samples shuffled {d.shuffle_buffer} at a time" if d.block > 1
                     else "sample by sample")
            log.info("data: %d loader workers per rank (data.workers%s), %s batches, read in %s", self.workers,
                     "" if d.workers is not None else ": from the cores",
                     "integer (decoded on the training device)" if self.train_set.integer_batches else "decoded",
                     order)
        self.batches_per_epoch = len(self.loader)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.root={self.cfg.data.root}: {len(self.train_set)} training images are fewer than "
                             f"one global batch ({o.batch_per_rank} × {o.grad_accum} micro-batches × {self.world} "
                             f"ranks)")
        steps_per_epoch = max(1, self.batches_per_epoch // o.grad_accum)
        self.total_steps = o.steps if o.steps > 0 else max(1, math.ceil(o.epochs * steps_per_epoch))
        warmup = o.warmup_steps or int(o.warmup_epochs * steps_per_epoch)
        note = warmup_note(warmup, self.total_steps, o.lr)
        if note and self.rank == 0:
            log.warning(note)

        model = build_model(self.cfg.model)
        if init is not None:  # before DeepSpeed wraps (and, under bf16, casts) the model
            info = initialize_from(model, read_init_source(init), str(init))
            log.info("initialised from train.init=%s (%s; %d tensors left at their fresh init)", init, info["how"],
                     len(info["fresh"]))
        elif self.cfg.train.init:
            log.info("train.init=%s not loaded: the run resumes from its checkpoint", self.cfg.train.init)
        if self.init_state is not None:  # a run that resumes loads its checkpoint over these
            model.load_state_dict(self.init_state)
        # expert parallelism: each rank keeps its share of the experts, which DeepSpeed never sees (ExpertShards)
        shards = shard_model(model) if expert_parallel_sizes(self.cfg.model) else []
        names = {s.name for s in shards}
        self.checkpointer.expert_shards(names, ExpertLayout(names, lambda: whole_params(
            lambda: MultiTaskObjective(build_model(self.cfg.model), self.tasks, self.cfg))))
        model.set_activation_checkpointing(self.cfg.train.activation_checkpointing, self.cfg.train.checkpoint_every)
        self.objective = MultiTaskObjective(model, self.tasks, self.cfg)
        optimizer = torch.optim.AdamW(param_groups(self.objective, o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                                      eps=o.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, warmup, self.total_steps, o.lr, o.min_lr))
        plan = self.checkpointer.plan_resume(source)  # every rank reads the tag it loads (damaged: passed over)
        ds_cfg = {**deepspeed_config(self.cfg, self.cuda), **self.checkpointer.ds_config()}
        self.engine, _, _, _ = deepspeed.initialize(model=self.objective, optimizer=optimizer,
                                                    lr_scheduler=scheduler, config=ds_cfg)
        if self.world == 1 and self.cfg.train.zero_stage == 0:  # one rank: nothing to reduce (DeepSpeed would
            self.engine.enable_backward_allreduce = False  # flatten, all-reduce and copy back every gradient at every
            # step: ~4 % of a small CPU step). ZeRO's optimizers do their own bookkeeping in that call: kept.
        if self.cfg.train.compile:  # the objective compiled in place: same parameters, names and checkpoints
            self.engine.compile(backend=squad_compile.BACKEND)
        note = squad_compile.tasks_per_image_note(self.cfg.train.tasks_per_image, self.cfg.train.compile)
        if note and self.rank == 0:
            log.warning(note)
        self.experts = ExpertShards(shards, o, self.device, prefix="model.") if shards else None
        if self.experts is not None:
            self.experts.attach(self.engine)
            self.checkpointer.also_save(self.experts.save)  # the shard files, in every tag
            self.checkpointer.also_load(self.experts.load)
        self.checkpointer.attach(self.engine, self.total_steps)  # weights_only reads; failed writes reach every rank
        self.model: SquadViT = self.engine.module.model
        self.usage = ExpertUsage(model.task_names)
        self.state = LoopState(world=self.world, batch_per_rank=o.batch_per_rank)
        client = self.checkpointer.load()
        if client is not None:
            self.state = LoopState(**client["loop"]).rescaled(self.world, o.batch_per_rank)
            if client.get("usage"):  # every rank holds the layers; rank 0 the sums (already over every rank)
                self.usage = ExpertUsage.from_state_dict(client["usage"], zeroed=self.rank != 0)
            log.info("resumed from %s at step %d", plan.tag_dir, self.state.step)
        # the resume has succeeded: from here on the run writes into its folder
        self.folder.record_start(self.cfg, plan.tag_dir if plan else None, self.state.step,
                                 plan.skipped if plan else None)
        if self.rank == 0:
            import json

            atomic_write_text(self.run_dir / "ds_config.json", json.dumps(ds_cfg, indent=2), "the DeepSpeed config")
        self._open_writer(self.state.step if plan else None)
        if plan is not None:
            self._forget_after(self.state.step)
        log.info("run %s: %d ranks on %s (%s), %d tasks, %d images/epoch, %d steps of %d images",
                 self.run_dir, self.world, self.device.type, self.prec, len(self.tasks), len(self.train_set),
                 self.total_steps, o.batch_per_rank * o.grad_accum * self.world)

    def record_stop(self, message: str) -> None:
        """Rank 0: leaves the record of a stop this run resumes from (`squad.train.stops.STOP_RECORD`)."""
        if self.rank == 0:
            write_stop_record(self.run_dir, message)

    def lost_peer(self, error: BaseException) -> PeerLost | None:
        """A collective call that failed because a peer died (gloo's "Connection closed by peer"): the error that
        names it (`PeerWatch.lost_peer`), or None for any other error."""
        import torch.distributed as dist

        from squad.runtime import interrupted

        text = str(error).lower()
        collective = isinstance(error, dist.DistError) or any(w in text for w in ("gloo", "connection", "peer"))
        if self.world == 1 or interrupted() or not collective:
            return None
        self.signals.ignore()  # leaving: the launcher's SIGTERM, which follows a dead rank, asks for nothing more
        found = self.watch.lost_peer()
        if found is None:
            return None
        lost = PeerLost(found[0])
        lost.every_rank = not found[1]  # the lowest rank still alive prints it
        return lost

    def _forget_after(self, step: int) -> None:
        """Rank 0, on resuming at ``step``: drops the ``metrics.jsonl`` rows the stopped run logged after that
        checkpoint, since those steps run again (its TensorBoard events: `_open_writer`)."""
        if self.rank != 0:
            return
        import json

        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file():
            lines = metrics.read_text().splitlines(keepends=True)

            def later(line: str) -> bool:
                try:
                    return json.loads(line)["step"] > step
                except (ValueError, KeyError, TypeError):
                    return False

            kept = [line for line in lines if not later(line)]
            if len(kept) < len(lines):
                atomic_write_text(metrics, "".join(kept))
                log.info("dropped %d rows of %s logged after step %d (those steps run again)", len(lines) - len(kept),
                         metrics.name, step)

    # --------------------------------------------------------------------------------------------- the loop
    def _assignment(self, batch_size: int, step: int, slot: int) -> torch.Tensor | None:
        k = self.cfg.train.tasks_per_image
        if k == 0:
            return None
        g = torch.Generator().manual_seed(hash((self.cfg.train.seed, step, slot, 17)) % (2**62))
        scores = torch.rand(batch_size, len(self.tasks), generator=g)
        top = scores.topk(k, dim=1).indices
        return torch.zeros(batch_size, len(self.tasks), dtype=torch.bool).scatter_(1, top, True)

    def _batches(self):
        """Micro-batches forever, from the saved (epoch, batch) position on."""
        while True:
            set_epoch(self.loader, self.state.epoch, skip_batches=self.state.batch_in_epoch)
            for batch in self.loader:
                self.state.batch_in_epoch += 1
                yield batch
            self.state.epoch += 1
            self.state.batch_in_epoch = 0

    def _next_batch(self, batches):
        """The next micro-batch on the device (an integer batch decoded there, `squad.data.device`), timing how long
        the step waited on the loader and summing the loader's own CPU time for the run log's data line."""
        t0 = time.perf_counter()
        batch = next(batches)
        w = self._window
        if getattr(self, "_workers_started", False):
            w["data_wait"] += time.perf_counter() - t0
        else:  # the first batch waits for the workers to start: said apart in the first data line
            self._workers_started = True
            w["start_wait"] = time.perf_counter() - t0
        w["samples"] += len(batch["id"])
        w["loader_cpu"] += batch.get("cpu_s", 0.0)
        return self._to_device(batch)

    def _to_device(self, batch):
        if is_integer_batch(batch):
            images, targets, masks = decode_batch(batch, self.train_set.pipeline, self.device)
        else:
            images = batch["rgb"].to(self.device, non_blocking=True)
            targets = {t: v.to(self.device, non_blocking=True) for t, v in batch["targets"].items()}
            masks = {t: v.to(self.device, non_blocking=True) for t, v in batch["masks"].items()}
        if self.dtype is not None:
            images = images.to(self.dtype)
        return images, targets, masks

    def train(self) -> Path:
        """Trains to the configured number of steps; returns the path of the exported model (or of the
        checkpoints when the run stops early at ``train.stop_at``).

        Raises:
            Preempted: a signal stopped the run after a checkpoint (`squad.train.checkpointer`).
        """
        self.setup()
        if self.state.step >= self.total_steps:  # resumed from the final checkpoint: a rerun, or killed before export
            return self._finish_again()
        if self.state.step == 0:
            self.validate()
        self.checkpointer.stop_before_training()
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not (self.rank == 0 and
                   self.cfg.train.progress), desc="train", dynamic_ncols=True, mininterval=2.0)
        self._window = self._new_window()
        batches = self._batches()
        while self.state.step < self.total_steps:
            stop = self._step(batches)
            bar.update(1)
            self._log_if_due(bar)
            if self._validation_due():
                self.validate()
            if self.checkpointer.save(self.state.step, self._client_state, stop) == "stop_at":
                bar.close()
                log.info("stopped at step %d (train.stop_at); resume with --resume auto", self.state.step)
                self._report_data()
                return self.run_dir / "checkpoints"
        bar.close()
        final = self.validate()
        self.checkpointer.save_final(self.state.step, self._client_state)
        self._report_data()
        return self.export(final)

    def _step(self, batches) -> bool:
        """One optimiser step over ``grad_accum`` micro-batches (a non-finite loss on any rank skips the micro-batch
        on every rank). Returns whether a signal asked some rank to stop: the flag rides on each micro-batch's
        all-reduced loss check, so every rank agrees at this step boundary without another collective."""
        accum = self.cfg.optim.grad_accum
        stop = False
        micro = 0
        while micro < accum:
            slot = micro * self.world + self.rank  # the micro-batch's place in the global batch (ResumableSampler)
            torch.manual_seed(hash((self.cfg.train.seed, self.state.step, slot)) % (2**62))
            images, targets, masks = self._next_batch(batches)
            assignment = self._assignment(images.shape[0], self.state.step, slot)
            total, losses, weights, parts, stats = self.engine(images, targets, masks, assignment)
            flags = torch.tensor([float(torch.isfinite(total.detach())), float(self.checkpointer.stop_requested())])
            if self.world > 1:  # one rank has nothing to agree with (the all-reduce was ~2 % of a small CPU step)
                flags = all_reduce_sum(flags)
            stop = stop or bool(flags[1] > 0)
            if flags[0] != self.world:
                self._skip_nonfinite(losses)
                continue
            self.state.nonfinite = 0
            self.engine.backward(total)
            if self.experts is not None:
                self.experts.before_step()
            self.engine.step()
            if self.experts is not None:
                self.experts.after_step()
            micro += 1
            self._window["images"] += images.shape[0] * self.world
            self.usage.update(stats)
            self._accumulate(self._window["logs"], total, losses, weights, parts)
        self.state.step += 1
        return stop

    def _skip_nonfinite(self, losses: dict) -> None:
        self.state.nonfinite += 1
        log.warning("step %d: non-finite loss (%s); micro-batch skipped", self.state.step,
                    {t: v.detach().item() for t, v in losses.items()})
        if self.writer:
            self.writer.add_scalar("train/nonfinite_skipped", self.state.nonfinite, self.state.step)
        if self.state.nonfinite >= self.cfg.train.max_nonfinite:
            raise nonfinite_stop(self.state.nonfinite, self.state.step, self.run_dir)

    def _log_if_due(self, bar) -> None:
        if self.state.step % self.cfg.train.log_every == 0 or self.state.step == self.total_steps:
            w = self._window
            dt = time.perf_counter() - w["since"]
            self._log(w["logs"], w["images"] / max(dt, 1e-9), bar)
            if self.rank == 0:
                log.info("%s", self._data_line(w, dt))
            self._window = self._new_window()

    @staticmethod
    def _new_window() -> dict:
        return {"logs": {}, "since": time.perf_counter(), "images": 0, "data_wait": 0.0, "samples": 0,
                "loader_cpu": 0.0}

    def _data_line(self, w: dict, seconds: float) -> str:
        """The run log's data line for one logging window (this rank): what the loader gives and whether the step
        waited on it."""
        wait = w["data_wait"]
        if w["loader_cpu"] > 0:
            per_core = w["samples"] / w["loader_cpu"]
            where = f"{per_core:.0f} per worker core × {self.workers}" if self.workers else "in the training process"
            rate = f"the loader gives {per_core * max(1, self.workers):.0f} samples/s ({where})"
        else:
            rate = f"the loader gave {w['samples'] / max(seconds, 1e-9):.0f} samples/s"
        waited = "the step never waited on data" if wait < 0.01 * seconds else "the step waited on data"
        start = f"; the first batch (the loader starting) took {w['start_wait']:.2f} s" if "start_wait" in w else ""
        return (f"data: {rate}; {waited} ({wait:.2f} s of {seconds:.1f} s, {100 * wait / max(seconds, 1e-9):.1f} %)"
                f"{start}")

    def _validation_due(self) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and self.state.step % every == 0 and self.state.step < self.total_steps

    def _client_state(self) -> dict:
        """squad's state saved beside DeepSpeed's: the loop counters and the expert usage summed over every rank (a
        collective: the checkpointer calls it on every rank)."""
        global_usage = ExpertUsage.from_state_dict(self.usage.state_dict())
        global_usage.all_reduce()
        return {"loop": dataclasses.asdict(self.state), "usage": global_usage.state_dict() if self.rank == 0 else None}

    def _report_data(self) -> None:
        """One line per dataset in train.log and ``data/<split>/<kind>`` TensorBoard scalars: the files it could not
        use, each counted once over workers and ranks (`squad.data.accounting`; a collective: every rank calls it)."""
        for name, ds in (("train", self.train_set), ("val", self.val_set)):
            if ds is None:
                continue
            data = report(ds, name)
            if self.rank == 0:
                log.info("%s", data.line())
                if self.writer:
                    for kind in ("corrupt", "wrong_size", "missing", "unindexed"):
                        self.writer.add_scalar(f"data/{name}/{kind}", getattr(data, kind), self.state.step)

    def _accumulate(self, logs, total, losses, weights, parts) -> None:
        """Adds one micro-batch's losses, task weights and auxiliary terms to the logging window where they were
        computed: one float64 stack per set of names, read on the host by `_log` (no host copy per micro-batch, so
        the next forward is queued while this step's backward and optimizer still run on a GPU)."""
        logs["n"] = logs.get("n", 0) + 1
        values = {"loss/total": total, **{f"loss/{t}": v for t, v in losses.items()},
                  **{f"weight/{t}": w for t, w in weights.items()}, **parts}
        host = {k: float(v) for k, v in values.items() if not torch.is_tensor(v)}
        device = {k: v for k, v in values.items() if torch.is_tensor(v)}
        for k, v in host.items():
            logs[k] = logs.get(k, 0.0) + v
        keys = tuple(device)
        stack = torch.stack([v.detach().to(total.device, torch.float64) for v in device.values()])
        sums = logs.setdefault("device", {})
        sums[keys] = stack if keys not in sums else sums[keys] + stack

    @staticmethod
    def _read_window(logs: dict) -> dict[str, float]:
        """The window's sums on the host (one copy per set of names)."""
        for keys, stack in logs.pop("device", {}).items():
            for k, v in zip(keys, stack.tolist(), strict=True):
                logs[k] = logs.get(k, 0.0) + v
        return logs

    def _log(self, logs: dict, images_per_s: float, bar) -> None:
        n = logs.pop("n", 0)
        if not n:
            return
        logs = self._read_window(logs)
        keys = sorted(logs)
        mean = all_reduce_sum(torch.tensor([logs[k] / n for k in keys], dtype=torch.float64)) / self.world
        values = dict(zip(keys, mean.tolist(), strict=True))
        lr = self.engine.get_lr()[0]
        tokens_per_s = images_per_s * self.cfg.model.num_tokens * (self.cfg.train.tasks_per_image or len(self.tasks))
        if self.rank != 0:
            return
        step = self.state.step
        for k, v in values.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/images_per_s", images_per_s, step)
        self.writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
        mi = sum(v for k, v in values.items() if k.startswith("mi/"))
        bar.set_postfix(loss=f"{values['loss/total']:.4f}", lr=f"{lr:.2e}", refresh=False)
        log.info("step %d/%d loss %.4f mi %.4f lr %.3e %.1f img/s %.0f tok/s", step, self.total_steps,
                 values["loss/total"], mi, lr, images_per_s, tokens_per_s)

    # --------------------------------------------------------------------------------------- eval, saving
    def validate(self) -> dict:
        """Validation metrics of every trained task (logged; also the expert-usage heatmaps)."""
        if self.val_set is None:
            return {}
        loader = eval_loader(self.val_set, self.cfg.optim.batch_per_rank, self.workers)
        results = evaluate(self.model, loader, self.tasks, self.device, self.cfg.data.val_batches, self.dtype)
        if self.rank == 0:
            step = self.state.step
            for t, metrics in results.items():
                for k, v in metrics.items():
                    self.writer.add_scalar(f"val/{t}/{k}", v, step)
            summary = ", ".join(f"{t} {get_task(t).primary_metric}={m[get_task(t).primary_metric]:.4f}"
                                for t, m in results.items() if m)
            log.info("validation at step %d: %s", step, summary or "no sample could be scored (every one was "
                     "unusable: see the data warnings)")
            import json

            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "metrics": results}) + "\n")
            self._log_usage(step)
        return results

    def _log_usage(self, step: int) -> None:
        for layer, share in self.usage.selection_share().items():
            self.writer.add_figure(f"usage/{layer}", usage_figure(share.numpy(), self.usage.tasks, layer), step)

    def _finish_again(self) -> Path:
        """A run resumed from its final checkpoint (run again after it finished, or killed before ``model.pt`` was
        written): nothing is trained, validated, saved or logged again; ``model.pt`` is written if it is missing."""
        path = self.run_dir / "model.pt"
        if broadcast_object(path.is_file() if self.rank == 0 else None):
            log.info("run already finished at step %d: %s exists, nothing to do", self.state.step, path)
            if self.writer:
                self.writer.close()
            return path
        metrics = broadcast_object(self._recorded_metrics(self.state.step) if self.rank == 0 else None)
        if metrics is None:  # the final validation was never recorded
            metrics = self.validate()
        log.info("run finished at step %d but has no %s: writing it", self.state.step, path.name)
        return self.export(metrics)

    def _recorded_metrics(self, step: int) -> dict | None:
        """The validation metrics ``metrics.jsonl`` holds for ``step`` ({} without validation data), or None."""
        if self.val_set is None:
            return {}
        import json

        file = self.run_dir / "metrics.jsonl"
        found = None
        for line in file.read_text().splitlines() if file.is_file() else []:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step") == step:
                found = row.get("metrics")
        return found

    def export(self, final_metrics: dict) -> Path:
        """Writes ``model.pt`` (weights, config, tasks, expert usage summed over ranks).

        A failed write (a full disk) stops the run on every rank with a `TrainingError` naming the file; the final
        checkpoint is complete, so running the same command again writes ``model.pt``.
        """
        self.usage.all_reduce()
        path = self.run_dir / "model.pt"
        error = None
        state = self._whole_state()  # every rank: partitioned weights and expert shards gathered
        if self.rank == 0:
            log_vars = self.objective.weighting.log_vars
            extra = {"step": self.state.step, "metrics": final_metrics, "trained_tasks": self.tasks,
                     "init": self.cfg.train.init,
                     "task_log_vars": log_vars.detach().float().cpu() if log_vars is not None else None}
            try:
                export_model(path, self.model, self.usage, extra, state=state)
                log.info("exported %s", path)
            except (OSError, RuntimeError) as e:  # torch reports a full disk as a RuntimeError
                error = (write_failure("the exported model", path, e) + "; the final checkpoint is complete: "
                         "make room and rerun the same command to write it")
                log.error(error)
            if self.writer:
                self.writer.close()
        error = broadcast_object(error)
        if error:
            raise TrainingError(error)
        return path


    def _whole_state(self) -> dict | None:
        """The single-process model's state dict when the engine's module does not hold it (a collective: every
        rank calls it): ZeRO-3 partitions are gathered one parameter at a time in float32 (DeepSpeed's
        ``safe_get_full_fp32_param``), expert shards whole; None when ``self.model.state_dict()`` is complete."""
        if self.cfg.train.zero_stage != 3 and self.experts is None:
            return None
        state = full_state_dict(self.model)  # expert shards gathered (every rank)
        if self.cfg.train.zero_stage == 3:
            from deepspeed.utils import safe_get_full_fp32_param

            for name, p in self.model.named_parameters():
                state[name] = safe_get_full_fp32_param(p).detach().cpu()
        return state


def train(cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto", *, overwrite: bool = False,
          allow_world_size_change: bool = False, init_state: Mapping[str, torch.Tensor] | None = None,
          lock: RunLock | None = None, signals: SignalWatch | None = None) -> Path:
    """Trains a run and returns the exported model's path.

    Args:
        cfg: the run config.
        run_dir: the run folder (locked while the run lasts).
        resume: ``"auto"`` (the folder's last complete checkpoint, if any), ``"none"``, or a run/checkpoint folder.
        overwrite: delete the outputs of a run already in ``run_dir`` and start over (else such a folder is refused
            unless the run resumes it).
        allow_world_size_change: resume on another number of ranks with another global batch (`Trainer`).
        init_state: weights the fresh model starts from (`Trainer`).
        lock: the run folder's lock, if the caller took it (`Trainer`).
        signals: the stop signals' watch, if the caller installed it (`Trainer`).

    Raises:
        Preempted: a signal (``train.save_on_signal``) stopped the run after a complete checkpoint (exit 75); rank
            0 leaves the stop record (`squad.train.stops.STOP_RECORD`).
        TrainingError: the run cannot go on (exit 3); `PeerLost` when another rank died.
    """
    trainer = Trainer(cfg, run_dir, resume, overwrite=overwrite, allow_world_size_change=allow_world_size_change,
                      init_state=init_state, lock=lock, signals=signals)
    stopped = False
    try:
        return trainer.train()
    except Preempted as e:
        stopped = True  # on its way out, a launcher may signal this rank again: ignored then, not fatal
        trainer.record_stop(str(e))
        raise
    except KeyboardInterrupt:
        stopped = True
        raise
    except Exception as e:
        lost = trainer.lost_peer(e)
        if lost is not None:
            stopped = True
            raise lost from e
        raise
    finally:
        trainer.watch.stop()
        trainer.folder.close()  # the lock first: nothing may stop this rank before it is released
        trainer.checkpointer.close(finished=not stopped)  # a save in progress discarded; the handlers restored
        if trainer.log_handler is not None:
            logging.getLogger("squad").removeHandler(trainer.log_handler)
            trainer.log_handler.close()
