"""The library side of tools/finetune_router.py: a table of modes × training-set sizes → the new task's metric.

    result = finetune_table("runs/no_scene", "class_scene", "data/synthetic", modes=["router", "head"],
                            fractions=[0.01, 0.05], out="runs/no_scene/finetune_scene.json")
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from squad.checkpoint import export_model
from squad.data import build_dataset
from squad.evaluation import eval_loader, evaluate
from squad.finetune import MODES, FinetuneConfig, class_labels, finetune_once, subset_indices, with_new_task
from squad.loading import load_full_model
from squad.model import SquadViT
from squad.surgery import select_tasks
from squad.tasks import get_task

log = logging.getLogger(__name__)


def base_without(model: SquadViT, task: str, trained: Sequence[str] | None, replace: bool) -> tuple[SquadViT, str]:
    """The model to add ``task`` to, and a note on what was done.

    A model that has a head for ``task`` is only accepted if that head was never trained (the run's
    ``trained_tasks`` lack it) or ``replace`` is set; the task's head and router rows are then removed first.
    """
    if task not in model.task_names:
        return model, "new task"
    untrained = trained is not None and task not in trained
    if not (untrained or replace):
        raise ValueError(f"the model was trained with {task}; router fine-tuning learns a task the model has not "
                         f"seen (train without it, e.g. --set data.tasks=[...]) or pass replace=True (--replace) to "
                         f"drop its head and router rows and learn them again")
    others = [t for t in model.task_names if t != task]
    if not others:
        raise ValueError(f"{task} is the model's only task; nothing would remain to fine-tune from")
    note = "untrained head of the checkpoint replaced" if untrained else "trained head and routers dropped (--replace)"
    return select_tasks(model, others), note


def finetune_table(checkpoint: str | Path, task: str, data: str | Path, modes: Sequence[str] = ("router",),
                   fractions: Sequence[float] | None = None, shots: Sequence[int] | None = None,
                   cfg: FinetuneConfig | None = None, train_split: str = "train", eval_split: str = "val",
                   replace: bool = False, save_dir: str | Path | None = None, out: str | Path | None = None) -> dict:
    """Fine-tunes ``task`` onto a trained model in every mode and subset size, and scores each run.

    Args:
        checkpoint: run folder or ``model.pt`` of a model trained without ``task``.
        task: the new task (name or alias from `squad.tasks`).
        data: dataset root holding the task's data.
        modes: any of router, head, full, linear-probe.
        fractions: training-set shares in (0, 1] (deterministic nested subsets).
        shots: instead, images per class (class tasks).
        cfg: optimisation settings.
        train_split: split the subsets are drawn from.
        eval_split: split the metric is measured on.
        replace: allow a task the model was trained with (its head and router rows are dropped first).
        save_dir: also save each fine-tuned model there (``{task}_{mode}_{size}.pt``, an ordinary model.pt).
        out: write the result JSON there.

    Returns:
        ``{"task", "metric", "untrained", "runs": [...], "table": {mode: {size: metric}}, ...}``.
    """
    cfg = cfg or FinetuneConfig()
    cfg.check()
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"unknown mode {bad[0] if bad else None!r}; modes: {', '.join(MODES)}")
    if (fractions is None) == (shots is None):
        raise ValueError("give fractions or shots (not both)")
    spec = get_task(task)  # unknown names fail here, listing the valid ones
    name = spec.name
    sizes = [("fraction", float(f)) for f in fractions] if fractions is not None else [("shots", int(s)) for s in shots]
    for kind, v in sizes:  # validate before any work
        if (kind == "fraction" and not 0.0 < v <= 1.0) or (kind == "shots" and v < 1):
            raise ValueError(f"{kind} must be {'in (0, 1]' if kind == 'fraction' else '>= 1'}, got {v}")
    if "linear-probe" in modes and spec.head_kind != "class":
        raise ValueError(f"mode linear-probe needs a class task; {name} is {spec.head_kind}")
    full, _, meta = load_full_model(checkpoint, with_usage=False)
    trained = (meta.get("extra") or {}).get("trained_tasks")
    base, note = base_without(full, name, trained, replace)
    base.to(cfg.device).eval()
    size = base.cfg.img_size
    train_set = build_dataset(data, [name], train_split, image_size=size, augment=False)
    eval_set = build_dataset(data, [name], eval_split, image_size=size, augment=False)
    loader = eval_loader(eval_set, cfg.batch_size, cfg.workers)
    labels = class_labels(train_set, name) if shots is not None else None
    untrained = evaluate(with_new_task(base, name, cfg.init, cfg.seed).to(cfg.device), loader, [name], cfg.device,
                         cfg.eval_batches)[name]
    result = {"task": name, "checkpoint": meta["path"], "base_tasks": base.task_names, "note": note,
              "metric": spec.primary_metric, "lower_is_better": spec.lower_is_better, "train_split": train_split,
              "train_images_total": len(train_set), "eval_split": eval_split, "eval_images": len(eval_set),
              "config": vars(cfg).copy(), "untrained": untrained, "runs": [], "table": {}}
    for kind, value in sizes:
        idx = subset_indices(len(train_set), **{kind: value}, labels=labels, seed=cfg.seed)
        label = f"{value:g}" if kind == "fraction" else f"{value}-shot"
        for mode in modes:
            log.info("fine-tuning %s: mode %s, %s %s (%d images)", name, mode, kind, value, len(idx))
            row, model = finetune_once(base, name, mode, train_set, idx, loader, cfg)
            row.update({kind: value, "size": label, "primary": row["metrics"].get(spec.primary_metric)})
            result["runs"].append(row)
            result["table"].setdefault(mode, {})[label] = row["primary"]
            if save_dir is not None and model is not None:
                model.merge_added_tasks()
                path = Path(save_dir) / f"{name}_{mode}_{label}.pt"
                path.parent.mkdir(parents=True, exist_ok=True)
                export_model(path, model, None, {"finetuned_task": name, "mode": mode, kind: value,
                                                 "trained_tasks": [*base.task_names, name]})
                row["saved"] = str(path)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_table(result: dict) -> str:
    """Modes × sizes → the primary metric, with the untrained head for reference."""
    sizes = list(dict.fromkeys(r["size"] for r in result["runs"]))
    arrow = "lower is better" if result["lower_is_better"] else "higher is better"
    lines = [f"{result['task']}: {result['metric']} on {result['eval_split']} ({result['eval_images']} images; "
             f"{arrow}); untrained head {result['untrained'].get(result['metric'], float('nan')):.4f}",
             f"{'mode':<14}" + "".join(f"{s:>12}" for s in sizes)]
    for mode, row in result["table"].items():
        lines.append(f"{mode:<14}" + "".join(f"{row.get(s, float('nan')):>12.4f}" for s in sizes))
    counts = {r["size"]: r["train_images"] for r in result["runs"]}
    lines.append(f"{'images':<14}" + "".join(f"{counts[s]:>12}" for s in sizes))
    return "\n".join(lines)
