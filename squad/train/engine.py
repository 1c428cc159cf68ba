"""The DeepSpeed training loop: one fused multi-task pass per step, uncertainty-weighted task losses, the MI loss
across ranks, periodic validation, TensorBoard logs, checkpoints that resume exactly, and the exported model.

Exact resumption: the data order is the sampler's (seed, epoch) permutation with the consumed batches skipped,
augmentation draws come from (seed, epoch, index), and the torch RNG (router noise, task sampling) is reseeded from
(seed, step, rank) every step — so nothing but the step counters needs saving beside DeepSpeed's own state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from squad.analysis.figures import usage_figure
from squad.config.base import ConfigError
from squad.config.run import RunConfig, deepspeed_config, precision
from squad.data import build_dataset, build_loader, eval_loader, report, set_epoch
from squad.distributed import (
    all_reduce_sum,
    broadcast_object,
    cuda_available,
    init_distributed,
    prepare_environment,
)
from squad.eval.evaluate import evaluate
from squad.io import export_model
from squad.io.checkpoints import COMPLETE, find_resume_tag, resume_candidates, tag_for
from squad.io.files import atomic_write_text, write_failure
from squad.io.weights import read_init_source
from squad.models import compile as squad_compile
from squad.models.transfer import initialize_from
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT, build_model
from squad.tasks import get_task
from squad.train import checkpoint as ckpt
from squad.train.objective import MultiTaskObjective, TrainingError, nonfinite_stop
from squad.train.optim import lr_lambda, param_groups, warmup_note
from squad.train.run_folder import RunFolder, ShmSegments, lock_before_start, resume_source

log = logging.getLogger("squad.train")


@dataclasses.dataclass
class LoopState:
    step: int = 0  # optimiser steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed in this epoch
    nonfinite: int = 0  # consecutive non-finite losses


class Trainer:
    """Runs one training job (`tools/train.py` is a thin wrapper around it; `train` runs one and cleans up).

    Args:
        cfg: the run config.
        run_dir: the run folder (locked while the run lasts).
        resume: ``"auto"`` (the folder's last complete checkpoint, if any), ``"none"``, or a run/checkpoint folder.
        overwrite: delete the outputs of a run already in ``run_dir`` and start over.
        allow_world_size_change: resume on another number of ranks than the checkpoint was written by.
        init_state: weights for the freshly built model (a state dict of the same model, names and shapes
            checked), loaded before DeepSpeed takes the model; a run that resumes loads its checkpoint over them.
            ``train.init`` does the same from a file.
    """

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto", *,
                 overwrite: bool = False, allow_world_size_change: bool = False,
                 init_state: Mapping[str, torch.Tensor] | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.overwrite = overwrite
        self.allow_world_size_change = allow_world_size_change
        self.init_state = init_state
        prepare_environment()
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
        self.tasks = cfg.train_tasks()
        self.writer = None
        self.log_handler: logging.Handler | None = None

    # ------------------------------------------------------------------------------------------------ set-up
    def _prepare_run_dir(self) -> None:
        """Rank 0 creates, locks and checks the run folder (`squad.train.run_folder`); every rank learns whether
        that worked (no rank is left waiting)."""
        self.folder.prepare(self.cfg, self.resume, overwrite=self.overwrite,
                            allow_world_size_change=self.allow_world_size_change)

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
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def _init_file(self) -> str | None:
        """``train.init`` when this run starts at step 0, else None: a run that resumes loads its checkpoint, which
        takes precedence (the file need not exist any more then).

        Raises:
            ConfigError: the file is missing (naming the key and the path).
        """
        init = self.cfg.train.init
        if not init:
            return None

        starts_over = self.overwrite and self.resume == "auto"  # --overwrite deletes the folder's checkpoints
        if not starts_over and resume_source(self.run_dir, self.resume) is not None:
            return None
        if not Path(init).exists():
            raise ConfigError(f"train.init: {init} not found (a model file from tools/upcycle.py, a squad model or "
                              f"run folder, or a timm ViT state dict)")
        return init

    def setup(self) -> None:
        import deepspeed

        init = self._init_file()  # checked before the run folder is touched
        self._prepare_run_dir()
        self._setup_logging()
        for note in self.folder.notes:
            log.warning(note)
        torch.manual_seed(self.cfg.train.seed)
        self.train_set, self.val_set = self._datasets()
        o = self.cfg.optim
        # the loader draws its workers' base seed from its own generator, never from the global RNG that the
        # step reseeds (router noise), so where an epoch starts does not shift the noise
        self.loader = build_loader(self.train_set, o.batch_per_rank, seed=self.cfg.train.seed,
                                   num_workers=self.cfg.data.workers, rank=self.rank, world=self.world,
                                   pin_memory=self.cuda)
        self.batches_per_epoch = len(self.loader)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.root={self.cfg.data.root}: {len(self.train_set)} training images are fewer than "
                             f"one batch per rank ({o.batch_per_rank} × {self.world} ranks)")
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
        model.set_activation_checkpointing(self.cfg.train.activation_checkpointing, self.cfg.train.checkpoint_every)
        self.objective = MultiTaskObjective(model, self.tasks, self.cfg)
        optimizer = torch.optim.AdamW(param_groups(self.objective, o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                                      eps=o.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, warmup, self.total_steps, o.lr, o.min_lr))
        ds_cfg = deepspeed_config(self.cfg, self.cuda)
        if self.rank == 0:
            import json

            atomic_write_text(self.run_dir / "ds_config.json", json.dumps(ds_cfg, indent=2), "the DeepSpeed config")
        self.engine, _, _, _ = deepspeed.initialize(model=self.objective, optimizer=optimizer,
                                                    lr_scheduler=scheduler, config=ds_cfg)
        if self.world == 1:  # one rank: nothing to reduce (DeepSpeed would flatten, all-reduce and copy back every
            self.engine.enable_backward_allreduce = False  # gradient at every step: ~4 % of a small CPU step)
        if self.cfg.train.compile:  # the objective compiled in place: same parameters, names and checkpoints
            self.engine.compile(backend=squad_compile.BACKEND)
        self.guard = ckpt.guard_engine(self.engine)  # weights_only reads; failed writes reach every rank
        self.model: SquadViT = self.engine.module.model
        self.usage = ExpertUsage(model.task_names)
        self.state = LoopState()
        self.resumed_from: Path | None = None
        self.skipped_tags: list[Path] = []
        self._maybe_resume()
        self.folder.record_start(self.resumed_from, self.state.step, self.skipped_tags)  # what was loaded
        log.info("run %s: %d ranks on %s (%s), %d tasks, %d images/epoch, %d steps of %d images",
                 self.run_dir, self.world, self.device.type, self.prec, len(self.tasks), len(self.train_set),
                 self.total_steps, o.batch_per_rank * o.grad_accum * self.world)

    def _maybe_resume(self) -> None:
        """Restores the newest complete checkpoint whose every file loads with ``weights_only``
        (`ckpt.select_resume_tag`: a damaged one is skipped with a warning, one that would need arbitrary unpickling
        stops the run)."""
        ckpt_dir = self.run_dir / "checkpoints"
        if self.resume in (None, "none", "no"):
            return
        if self.resume == "auto":
            load_dir, tags = ckpt_dir, resume_candidates(ckpt_dir)
            if not tags:
                return
        else:
            path = Path(self.resume)
            if (path / "checkpoints").is_dir():
                path = path / "checkpoints"
            if (path / COMPLETE).is_file():
                load_dir, tags = path.parent, [path.name]
            else:
                load_dir, tags = path, resume_candidates(path)
            if not tags:
                raise FileNotFoundError(f"--resume {self.resume}: no complete checkpoint there")
        tag = ckpt.select_resume_tag(load_dir, tags, self.rank, self.world, log.warning if self.rank == 0 else None)
        self.skipped_tags = [load_dir / t for t in tags[: tags.index(tag)]]  # damaged, passed over
        _, client = self.engine.load_checkpoint(str(load_dir), tag=tag)
        if client is None:
            raise RuntimeError(f"checkpoint {load_dir / tag} could not be loaded")
        self.state = LoopState(**client["loop"])
        if client.get("usage"):  # every rank holds the layers; rank 0 the sums (already over every rank)
            self.usage = ExpertUsage.from_state_dict(client["usage"], zeroed=self.rank != 0)
        self._forget_after(self.state.step)
        self.resumed_from = load_dir / tag
        log.info("resumed from %s at step %d", load_dir / tag, self.state.step)

    def _forget_after(self, step: int) -> None:
        """Rank 0, on resuming at ``step``: drops what was logged after that checkpoint by the run that stopped
        (``metrics.jsonl`` rows, TensorBoard events), since those steps run again."""
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
        if self.writer is not None:  # TensorBoard hides the stopped run's events from step + 1 on
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self.writer.log_dir
            self.writer.close()
            self.writer = SummaryWriter(log_dir, purge_step=step + 1)

    # --------------------------------------------------------------------------------------------- the loop
    def _assignment(self, batch_size: int, step: int) -> torch.Tensor | None:
        k = self.cfg.train.tasks_per_image
        if k == 0:
            return None
        g = torch.Generator().manual_seed(hash((self.cfg.train.seed, step, self.rank, 17)) % (2**62))
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

    def _to_device(self, batch):
        images = batch["rgb"].to(self.device, non_blocking=True)
        if self.dtype is not None:
            images = images.to(self.dtype)
        targets = {t: v.to(self.device, non_blocking=True) for t, v in batch["targets"].items()}
        masks = {t: v.to(self.device, non_blocking=True) for t, v in batch["masks"].items()}
        return images, targets, masks

    def train(self) -> Path:
        """Trains to the configured number of steps; returns the path of the exported model (or of the
        checkpoints when the run stops early at ``train.stop_at``)."""
        self.setup()
        if self.state.step >= self.total_steps:  # resumed from the final checkpoint: a rerun, or killed before export
            return self._finish_again()
        if self.state.step == 0:
            self.validate()
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not (self.rank == 0 and
                   self.cfg.train.progress), desc="train", dynamic_ncols=True, mininterval=2.0)
        accum = self.cfg.optim.grad_accum
        logs: dict[str, float] = {}
        t_last, images_since = time.perf_counter(), 0
        batches = self._batches()
        while self.state.step < self.total_steps:
            torch.manual_seed(hash((self.cfg.train.seed, self.state.step, self.rank)) % (2**62))
            micro = 0
            while micro < accum:
                batch = next(batches)
                images, targets, masks = self._to_device(batch)
                assignment = self._assignment(images.shape[0], self.state.step)
                total, losses, weights, parts, stats = self.engine(images, targets, masks, assignment)
                finite = bool(torch.isfinite(total)) if self.world == 1 else \
                    all_reduce_sum(torch.tensor([float(torch.isfinite(total))]))[0] == self.world
                if not finite:
                    self.state.nonfinite += 1
                    log.warning("step %d: non-finite loss (%s); micro-batch skipped", self.state.step,
                                {t: float(v) for t, v in losses.items()})
                    if self.writer:
                        self.writer.add_scalar("train/nonfinite_skipped", self.state.nonfinite, self.state.step)
                    if self.state.nonfinite >= self.cfg.train.max_nonfinite:
                        raise nonfinite_stop(self.state.nonfinite, self.state.step, self.run_dir)
                    continue
                self.state.nonfinite = 0
                self.engine.backward(total)
                self.engine.step()
                micro += 1
                images_since += images.shape[0] * self.world
                self.usage.update(stats)
                self._accumulate(logs, total, losses, weights, parts)
            self.state.step += 1
            bar.update(1)
            if self.state.step % self.cfg.train.log_every == 0 or self.state.step == self.total_steps:
                dt = time.perf_counter() - t_last
                self._log(logs, images_since / max(dt, 1e-9), bar)
                logs, t_last, images_since = {}, time.perf_counter(), 0
            every = self.cfg.train.eval_every
            if every and self.state.step % every == 0 and self.state.step < self.total_steps:
                self.validate()
            every = self.cfg.train.ckpt_every
            if every and self.state.step % every == 0 and self.state.step < self.total_steps:
                self.save()
            if self.state.step == self.cfg.train.stop_at and self.state.step < self.total_steps:
                bar.close()
                if not (every and self.state.step % every == 0):
                    self.save()
                log.info("stopped at step %d (train.stop_at); resume with --resume auto", self.state.step)
                self._report_data()
                return self.run_dir / "checkpoints"
        bar.close()
        final = self.validate()
        self.save()
        self._report_data()
        return self.export(final)

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
        logs["n"] = logs.get("n", 0) + 1
        logs["loss/total"] = logs.get("loss/total", 0.0) + float(total.detach())
        for t, v in losses.items():
            logs[f"loss/{t}"] = logs.get(f"loss/{t}", 0.0) + float(v.detach())
        for t, w in weights.items():
            logs[f"weight/{t}"] = logs.get(f"weight/{t}", 0.0) + w
        for k, v in parts.items():
            logs[k] = logs.get(k, 0.0) + float(v.detach())

    def _log(self, logs: dict, images_per_s: float, bar) -> None:
        n = logs.pop("n", 0)
        if not n:
            return
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
        loader = eval_loader(self.val_set, self.cfg.optim.batch_per_rank, self.cfg.data.workers)
        results = evaluate(self.model, loader, self.tasks, self.device, self.cfg.data.val_batches, self.dtype)
        if self.rank == 0:
            step = self.state.step
            for t, metrics in results.items():
                for k, v in metrics.items():
                    self.writer.add_scalar(f"val/{t}/{k}", v, step)
            summary = ", ".join(f"{t} {get_task(t).primary_metric}={m[get_task(t).primary_metric]:.4f}"
                                for t, m in results.items() if m)
            log.info("validation at step %d: %s", step, summary)
            import json

            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "metrics": results}) + "\n")
            self._log_usage(step)
        return results

    def _log_usage(self, step: int) -> None:
        for layer, share in self.usage.selection_share().items():
            self.writer.add_figure(f"usage/{layer}", usage_figure(share.numpy(), self.usage.tasks, layer), step)

    def save(self) -> None:
        """A checkpoint of every rank's state, marked complete only once all of it is on disk.

        A write that fails on any rank (a full disk) stops the run on every rank with a `TrainingError` naming the
        file and the space left; the tag's partial files are removed and the previous checkpoint stays the latest.
        """
        ckpt_dir = self.run_dir / "checkpoints"
        tag = tag_for(self.state.step)
        global_usage = ExpertUsage.from_state_dict(self.usage.state_dict())
        global_usage.all_reduce()
        client = {"loop": dataclasses.asdict(self.state),
                  "usage": global_usage.state_dict() if self.rank == 0 else None}
        what = f"checkpoint {tag}"
        error = None
        if self.rank == 0:  # DeepSpeed's own mkdir failing on rank 0 alone would leave the others in its barrier
            try:
                if (ckpt_dir / tag).exists():  # left by an earlier attempt at this step: replaced whole, never mixed
                    shutil.rmtree(ckpt_dir / tag)
                (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                error = write_failure(what, ckpt_dir / tag, e)
        if not broadcast_object(error):
            self.guard.take()
            self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
            failed = self.guard.take()  # recorded by the guard, so that every rank got through DeepSpeed's barriers
            errors = ckpt.gather_objects(write_failure(what, *failed) if failed else None)
            error = next((e for e in errors if e), None)
            if error is None and self.rank == 0:
                try:
                    ckpt.mark_complete(ckpt_dir, tag, self.state.step, self.cfg.train.keep_checkpoints)
                except OSError as e:
                    error = write_failure(what, ckpt_dir / tag / COMPLETE, e)
        if self.rank == 0:
            if error:
                shutil.rmtree(ckpt_dir / tag, ignore_errors=True)  # never complete; frees what it held
                previous = find_resume_tag(ckpt_dir)
                error += (f"; {what} was not saved (its partial files are removed). The previous checkpoint "
                          f"{ckpt_dir / previous} is intact: make room and rerun the same command to resume from it"
                          if previous else f"; {what} was not saved (its partial files are removed) and the run has "
                          f"no earlier checkpoint")
                log.error(error)
            else:
                log.info("checkpoint %s", ckpt_dir / tag)
        error = broadcast_object(error)
        if error:
            raise TrainingError(error)

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
        if self.rank == 0:
            log_vars = self.objective.weighting.log_vars
            extra = {"step": self.state.step, "metrics": final_metrics, "trained_tasks": self.tasks,
                     "init": self.cfg.train.init,
                     "task_log_vars": log_vars.detach().float().cpu() if log_vars is not None else None}
            try:
                export_model(path, self.model, self.usage, extra)
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


def train(cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto", *, overwrite: bool = False,
          allow_world_size_change: bool = False, init_state: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Trains a run and returns the exported model's path.

    Args:
        cfg: the run config.
        run_dir: the run folder (locked while the run lasts).
        resume: ``"auto"`` (the folder's last complete checkpoint, if any), ``"none"``, or a run/checkpoint folder.
        overwrite: delete the outputs of a run already in ``run_dir`` and start over (else such a folder is refused
            unless the run resumes it).
        allow_world_size_change: resume on another number of ranks than the checkpoint was written by.
        init_state: weights the fresh model starts from (`Trainer`).
    """
    trainer = Trainer(cfg, run_dir, resume, overwrite=overwrite, allow_world_size_change=allow_world_size_change,
                      init_state=init_state)
    try:
        return trainer.train()
    finally:
        trainer.folder.close()
        if trainer.log_handler is not None:
            logging.getLogger("squad").removeHandler(trainer.log_handler)
            trainer.log_handler.close()
