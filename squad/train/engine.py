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
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from squad.analysis.usage import ExpertUsage
from squad.config.base import write_yaml
from squad.config.run import RunConfig, deepspeed_config, precision
from squad.data import build_dataset, collate
from squad.data.samplers import ResumableSampler
from squad.eval.evaluate import eval_loader, evaluate
from squad.io import export_model
from squad.models.vit import SquadViT, build_model
from squad.tasks import get_task
from squad.train import checkpoint as ckpt
from squad.train.distributed import all_reduce_sum, barrier, broadcast_object, cuda_available, init_distributed
from squad.train.objective import MultiTaskObjective, TrainingError
from squad.train.optim import lr_lambda, param_groups

log = logging.getLogger("squad.train")


@dataclasses.dataclass
class LoopState:
    step: int = 0  # optimiser steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches consumed in this epoch
    nonfinite: int = 0  # consecutive non-finite losses


class Trainer:
    """Runs one training job (`tools/train.py` is a thin wrapper around it)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto"):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.rank, self.world, self.device = init_distributed()
        self.cuda = cuda_available()
        self.prec = precision(cfg.train, self.cuda)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.prec)
        self.tasks = cfg.train_tasks()
        self.writer = None

    # ------------------------------------------------------------------------------------------------ set-up
    def _prepare_run_dir(self) -> None:
        """Rank 0 creates the run folder; every rank learns whether that worked (no rank is left waiting)."""
        error = None
        if self.rank == 0:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                probe = self.run_dir / ".write_test"
                probe.write_text("ok")
                probe.unlink()
                write_yaml(self.cfg, self.run_dir / "config.yaml")
            except OSError as e:
                error = f"run folder {self.run_dir} is not writable: {e.strerror or e}"
        error = broadcast_object(error)
        if error:
            raise PermissionError(error)

    def _datasets(self):
        d = self.cfg.data
        common = dict(image_size=self.cfg.model.img_size, resize=d.resize, missing=d.missing, seed=self.cfg.train.seed,
                      split_csv=d.split_csv)
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
        root.setLevel(logging.INFO)
        if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                   for h in root.handlers):
            console = logging.StreamHandler()
            console.setFormatter(logging.Formatter("[squad] %(message)s"))
            root.addHandler(console)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def setup(self) -> None:
        import deepspeed

        self._prepare_run_dir()
        self._setup_logging()
        torch.manual_seed(self.cfg.train.seed)
        self.train_set, self.val_set = self._datasets()
        o = self.cfg.optim
        self.sampler = ResumableSampler(self.train_set, num_replicas=self.world, rank=self.rank, shuffle=True,
                                        seed=self.cfg.train.seed, drop_last=True)
        # the loader draws its workers' base seed from its own generator, never from the global RNG that the
        # step reseeds (router noise), so where an epoch starts does not shift the noise
        self.loader = DataLoader(self.train_set, batch_size=o.batch_per_rank, sampler=self.sampler,
                                 num_workers=self.cfg.data.workers, collate_fn=collate, drop_last=True,
                                 pin_memory=self.cuda, generator=torch.Generator().manual_seed(self.cfg.train.seed))
        self.batches_per_epoch = len(self.loader)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.root={self.cfg.data.root}: {len(self.train_set)} training images are fewer than "
                             f"one batch per rank ({o.batch_per_rank} × {self.world} ranks)")
        steps_per_epoch = max(1, self.batches_per_epoch // o.grad_accum)
        self.total_steps = o.steps if o.steps > 0 else max(1, math.ceil(o.epochs * steps_per_epoch))
        warmup = o.warmup_steps or int(o.warmup_epochs * steps_per_epoch)

        model = build_model(self.cfg.model)
        self.objective = MultiTaskObjective(model, self.tasks, self.cfg)
        optimizer = torch.optim.AdamW(param_groups(self.objective, o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                                      eps=o.eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_lambda(s, warmup, self.total_steps, o.lr, o.min_lr))
        ds_cfg = deepspeed_config(self.cfg, self.cuda)
        if self.rank == 0:
            import json

            (self.run_dir / "ds_config.json").write_text(json.dumps(ds_cfg, indent=2))
        self.engine, _, _, _ = deepspeed.initialize(model=self.objective, optimizer=optimizer,
                                                    lr_scheduler=scheduler, config=ds_cfg)
        self.model: SquadViT = self.engine.module.model
        self.usage = ExpertUsage(model.task_names)
        self.state = LoopState()
        self._maybe_resume()
        log.info("run %s: %d ranks on %s (%s), %d tasks, %d images/epoch, %d steps of %d images",
                 self.run_dir, self.world, self.device.type, self.prec, len(self.tasks), len(self.train_set),
                 self.total_steps, o.batch_per_rank * o.grad_accum * self.world)

    def _maybe_resume(self) -> None:
        ckpt_dir = self.run_dir / "checkpoints"
        if self.resume in (None, "none", "no"):
            return
        if self.resume == "auto":
            tag = ckpt.find_resume_tag(ckpt_dir)
            if tag is None:
                return
            load_dir = ckpt_dir
        else:
            path = Path(self.resume)
            if (path / "checkpoints").is_dir():
                path = path / "checkpoints"
            if (path / ckpt.COMPLETE).is_file():
                load_dir, tag = path.parent, path.name
            else:
                load_dir, tag = path, ckpt.find_resume_tag(path)
            if tag is None:
                raise FileNotFoundError(f"--resume {self.resume}: no complete checkpoint there")
        _, client = self.engine.load_checkpoint(str(load_dir), tag=tag)
        if client is None:
            raise RuntimeError(f"checkpoint {load_dir / tag} could not be loaded")
        self.state = LoopState(**client["loop"])
        if self.rank == 0 and client.get("usage"):
            self.usage = ExpertUsage.from_state_dict(client["usage"])
        log.info("resumed from %s at step %d", load_dir / tag, self.state.step)

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
            self.sampler.set_epoch(self.state.epoch)
            self.train_set.set_epoch(self.state.epoch)
            self.sampler.skip = self.state.batch_in_epoch * self.cfg.optim.batch_per_rank
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
                finite = all_reduce_sum(torch.tensor([float(torch.isfinite(total))]))[0] == self.world
                if not finite:
                    self.state.nonfinite += 1
                    log.warning("step %d: non-finite loss (%s); micro-batch skipped", self.state.step,
                                {t: float(v) for t, v in losses.items()})
                    if self.writer:
                        self.writer.add_scalar("train/nonfinite_skipped", self.state.nonfinite, self.state.step)
                    if self.state.nonfinite >= self.cfg.train.max_nonfinite:
                        raise TrainingError(f"{self.state.nonfinite} non-finite losses in a row at step "
                                           f"{self.state.step}: stopping (lower optim.lr, check the data, or raise "
                                           f"train.max_nonfinite)")
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
                return self.run_dir / "checkpoints"
        bar.close()
        final = self.validate()
        self.save()
        return self.export(final)

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
        from squad.analysis.figures import usage_figure

        for layer, share in self.usage.selection_share().items():
            self.writer.add_figure(f"usage/{layer}", usage_figure(share.numpy(), self.usage.tasks, layer), step)

    def save(self) -> None:
        """A checkpoint of every rank's state, marked complete only once all of it is on disk."""
        ckpt_dir = self.run_dir / "checkpoints"
        tag = ckpt.tag_for(self.state.step)
        global_usage = ExpertUsage.from_state_dict(self.usage.state_dict())
        global_usage.all_reduce()
        client = {"loop": dataclasses.asdict(self.state),
                  "usage": global_usage.state_dict() if self.rank == 0 else None}
        self.engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
        barrier()
        if self.rank == 0:
            ckpt.mark_complete(ckpt_dir, tag, self.state.step, self.cfg.train.keep_checkpoints)
            log.info("checkpoint %s", ckpt_dir / tag)
        barrier()

    def export(self, final_metrics: dict) -> Path:
        """Writes ``model.pt`` (weights, config, tasks, expert usage summed over ranks)."""
        self.usage.all_reduce()
        path = self.run_dir / "model.pt"
        if self.rank == 0:
            log_vars = self.objective.weighting.log_vars
            extra = {"step": self.state.step, "metrics": final_metrics, "trained_tasks": self.tasks,
                     "task_log_vars": log_vars.detach().float().cpu() if log_vars is not None else None}
            export_model(path, self.model, self.usage, extra)
            log.info("exported %s", path)
            if self.writer:
                self.writer.close()
        barrier()
        return path


def train(cfg: RunConfig, run_dir: str | Path, resume: str | None = "auto") -> Path:
    """Trains a run and returns the exported model's path."""
    return Trainer(cfg, run_dir, resume).train()
