"""The training objective: `MultiTaskObjective`, the module DeepSpeed wraps (one fused forward over the step's tasks,
each task's masked loss, their learned weighting and the routers' auxiliary losses), and `TrainingError`, how a run
that cannot go on stops (`nonfinite_stop`: too many non-finite losses in a row, with what to try).
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from squad.config.run import RunConfig
from squad.io.checkpoints import find_resume_tag
from squad.models.vit import SquadViT
from squad.train.losses import TaskWeighting, auxiliary_loss
from squad.train.stops import TrainingError


def nonfinite_stop(count: int, step: int, run_dir: Path) -> TrainingError:
    """The error that stops a run after ``count`` non-finite losses in a row, saying what can be done about it.

    A resume must keep the config keys that exact resumption depends on (`squad.train.run_folder.RESUMABLE_KEYS`
    lists those that may change), so a lower ``optim.lr`` means a new run; a resume may tighten ``optim.clip`` or
    raise ``train.max_nonfinite``.

    Args:
        count: the non-finite losses in a row.
        step: the optimiser step the run stopped at.
        run_dir: the run folder (its last complete checkpoint is named, if it has one).
    """
    tag = find_resume_tag(Path(run_dir) / "checkpoints")
    resume = (f"resume this run from its last checkpoint ({tag}, --resume auto) with a lower optim.clip, or with "
              f"a higher train.max_nonfinite if only a few batches are bad" if tag else
              "this run has no checkpoint to resume")
    return TrainingError(
        f"{count} non-finite losses in a row at step {step}: stopping. Options: start a new run with a lower "
        f"optim.lr (another --out, or --resume none --overwrite to replace this one; optim.lr cannot change on "
        f"resume); {resume}; check the data for broken images or targets")


class MultiTaskObjective(nn.Module):
    """The module DeepSpeed wraps: the model, its task losses and their learned weights."""

    def __init__(self, model: SquadViT, tasks: list[str], cfg: RunConfig):
        super().__init__()
        self.model = model
        self.tasks = list(tasks)
        self.loss_cfg = cfg.loss
        self.weighting = TaskWeighting(self.tasks, cfg.loss.weighting, cfg.loss.clamp)
        self._specs = {t: model.get_task(t) for t in self.tasks}  # as the model configures them (task_options)

    def forward(self, images, targets, masks, assignment=None):
        out = self.model(images, self.tasks, assignment)
        losses = {}
        for t, pred in out.preds.items():
            idx = out.image_index[t]
            task = self._specs[t]
            target = task.target(targets[t].index_select(0, idx))
            losses[t] = task.loss(pred.float(), target, masks[t].index_select(0, idx))
        weighted, weights = self.weighting(losses)
        aux, parts = auxiliary_loss(out.stats, self.loss_cfg)
        return weighted + aux.to(weighted.device), losses, weights, parts, out.stats
