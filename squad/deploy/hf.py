"""A squad model as a Hugging Face-style folder with its model card, and the folder uploaded to the hub.

    squad.save_pretrained(squad.load("runs/demo"), "demo-hf")       # config.json, model.safetensors, README.md
    model = squad.load("demo-hf")                                   # the same model (no pickle anywhere)
    push_to_hub("demo-hf", "org/name")                              # then: squad.load("hf-hub:org/name")

The folder's files are `squad.io.hf_folder`'s (which `squad.load` reads); this module adds what a reader of the hub
page needs: ``README.md``, a model card generated from the model and its run (`model_card`): YAML front matter the hub
reads (``library_name: squad``, tags, ``pipeline_tag``, a licence placeholder), the tasks with their validation
metrics, parameters and MACs (whole model and per task), the routing figures of the expert-usage statistics saved with
the model, and the training command and data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.nn as nn

from squad.analysis.flops import mod_shares, mone_shares, profile
from squad.config.base import to_dict
from squad.io import hf_folder
from squad.io.files import atomic_write_text
from squad.models.inference import inference_settings
from squad.models.single_task import SingleTaskModel
from squad.models.usage import ExpertUsage
from squad.models.vit import SquadViT

__all__ = ["folder_config", "model_card", "push_to_hub", "save_pretrained"]

MIN_SHARE = 0.01  # an expert counts as used by a task when it takes at least this share of the task's selections
# a task kind → the hub's pipeline tag, when every task of the model is of that kind
PIPELINES = {"depth": "depth-estimation", "class": "image-classification", "segment": "image-segmentation"}


def folder_config(model: nn.Module, run: dict | None = None) -> dict:
    """The ``config.json`` of ``model`` (without the format and version `squad.io.hf_folder.write_folder` adds).

    Args:
        model: a `SquadViT` or an extracted `SingleTaskModel`, as `squad.load` returns them (``.meta`` is read
            when present).
        run: what the run that trained it recorded (`run_record`), or None.
    """
    inner = model.model if isinstance(model, SingleTaskModel) else model
    meta = getattr(model, "meta", None) or {}
    config: dict[str, Any] = {
        "library_name": "squad",
        "architecture": type(model).__name__,
        "model": to_dict(inner.cfg),
        "tasks": list(inner.task_names),
        "inference": inference_settings(inner),
    }
    if isinstance(model, SingleTaskModel):
        config["extracted"] = {"task": model.task, "kept": {k: list(v) for k, v in model.kept.items()},
                               "exact": bool(model.exact), "mone_capacity": float(inner.mone_capacity)}
        config["report"] = meta.get("report") or {}
    else:
        config["extra"] = {k: v for k, v in (meta.get("extra") or {}).items()}
    if run:
        config["run"] = run
    return config


def save_pretrained(model: nn.Module, folder: str | Path, *, run: dict | None = None, card: bool = True,
                    max_shard_size: int = hf_folder.MAX_SHARD_SIZE) -> Path:
    """Writes ``model`` as a Hugging Face-style folder that `squad.load` opens (locally or as ``hf-hub:org/name``).

    Args:
        model: a `SquadViT` or extracted `SingleTaskModel` (``squad.load`` of any squad file; ``.usage`` and
            ``.meta`` are saved when present).
        folder: the folder to write (created; an earlier folder's files are replaced).
        run: the training run's record for the card (`run_record`); default: the one a folder's model was loaded
            with, else found from ``model.meta["path"]`` (the run folder beside a ``model.pt`` or checkpoint tag).
        card: write ``README.md`` (`model_card`).
        max_shard_size: bytes per weights file; past it the weights are sharded with the hub's index file.

    Returns:
        ``folder``.
    """
    folder = Path(folder)
    inner = model.model if isinstance(model, SingleTaskModel) else model
    if not isinstance(inner, SquadViT):
        raise ValueError(f"save_pretrained takes a squad model (SquadViT or SingleTaskModel), got "
                         f"{type(model).__name__}")
    if run is None:  # a model loaded from a folder keeps the record it was saved with
        meta = getattr(model, "meta", None) or {}
        run = meta.get("run") or run_record(meta)
    config = folder_config(model, run)
    usage = getattr(model, "usage", None)
    hf_folder.write_folder(folder, config, inner.state_dict(), usage.state_dict() if usage is not None else None,
                           max_shard_size=max_shard_size)
    if card:
        atomic_write_text(folder / "README.md", model_card(model, config), "the model card")
    return folder


def run_record(meta: dict) -> dict:
    """What the card says about training: the command, the data and the steps, from the run folder of the file
    ``meta["path"]`` names (``config.yaml``, ``run_history.jsonl``); {} when there is no run folder."""
    path = Path(meta.get("path") or "")
    if not str(path) or str(path) == ".":
        return {}
    folder = path.parent.parent if meta.get("format") == "deepspeed-checkpoint" else (
        path if path.is_dir() else path.parent)
    record: dict[str, Any] = {}
    cfg_file = folder / "config.yaml"
    if cfg_file.is_file():
        import yaml

        cfg = yaml.safe_load(cfg_file.read_text()) or {}
        data = cfg.get("data") or {}
        optim, train = cfg.get("optim") or {}, cfg.get("train") or {}
        record["data"] = {k: data.get(k) for k in ("dataset", "root", "split", "val_split", "tasks") if k in data}
        record["train"] = {**{k: optim.get(k) for k in ("steps", "epochs", "batch_per_rank", "grad_accum", "lr")
                              if optim.get(k)},
                           **{k: train.get(k) for k in ("precision", "zero_stage", "init") if train.get(k) is not None}}
        record["command"] = f"python tools/train.py --config {cfg_file}"
    history = folder / "run_history.jsonl"
    if history.is_file():
        for line in history.read_text().splitlines()[:1]:
            try:
                first = json.loads(line)
            except ValueError:
                continue
            words = [w for w in str(first.get("command") or "").split(" ") if w and not w.startswith("--local_rank")]
            if words:  # the rank's argv (a launcher's --local_rank dropped): a script path first
                launch = "python" if first.get("world_size", 1) == 1 else f"deepspeed --num_gpus {first['world_size']}"
                record["command"] = " ".join([launch] + words if words[0].endswith(".py") else words)
    return record


# ---------------------------------------------------------------------------------------------------- the card
def model_card(model: nn.Module, config: dict) -> str:
    """``README.md`` of the folder: YAML front matter the hub reads, then the model, its tasks and numbers."""
    inner = model.model if isinstance(model, SingleTaskModel) else model
    cfg = inner.cfg
    tasks = [model.task] if isinstance(model, SingleTaskModel) else list(inner.task_names)
    extra = config.get("extra") or {}
    run = config.get("run") or {}
    kinds = sorted({getattr(m, "kind", None) for m in inner.modules()} - {None})
    heads = {h.name: h for h in cfg.head_configs()}
    front = ["---", "library_name: squad", "license: other  # TODO: the licence the weights are released under",
             f"pipeline_tag: {_pipeline(inner, tasks)}", "tags:", "- squad", "- vision",
             *(["- multi-task"] if len(tasks) > 1 else []),
             *[f"- {t}" for t in _tags(kinds, model)], "---", ""]
    name = cfg.name or "squad model"
    what = (f"the **{model.task}** subnetwork extracted from a multi-task model" if isinstance(model, SingleTaskModel)
            else f"a multi-task model with {len(tasks)} task{'s' if len(tasks) > 1 else ''}")
    lines = [*front, f"# {name}", "",
             f"A squad vision transformer: {what}, ViT with {cfg.depth} blocks of width "
             f"{cfg.embed_dim} ({cfg.num_heads} heads), {cfg.img_size}×{cfg.img_size} images in {cfg.patch_size}×"
             f"{cfg.patch_size} patches. Conditional layers: "
             f"{', '.join(_KIND_NAMES.get(k, k) for k in kinds) or 'none (dense)'}.",
             "", "## Use", "", "```python", "import squad", "",
             "model = squad.load(\"hf-hub:ORG/NAME\")   # or the folder's path; no pickle is run",
             "preds = model(images)" + ("                  # images [B, 3, S, S] → the task's prediction"
                                         if isinstance(model, SingleTaskModel) else
                                         ".preds            # images [B, 3, S, S] → {task: prediction}"),
             "```", ""]
    settings = config.get("inference") or {}
    if settings:
        lines += ["Inference settings saved with it: " + ", ".join(f"{k} = {v}" for k, v in settings.items()) + ".",
                  ""]
    lines += ["## Tasks", "", *_task_table(inner, model, tasks, heads, extra, config), ""]
    lines += _compute(inner, tasks)
    lines += _routing(getattr(model, "usage", None), tasks)
    lines += _training(extra, run, config)
    lines += ["## Licence", "", "TODO: state the licence of the weights and of the data they were trained on "
              "(the front matter's `license: other` is a placeholder).", "",
              f"*Card written by squad {config.get('squad_version') or hf_folder._version()} "
              f"(`squad.save_pretrained`); folder format {hf_folder.FORMAT}.*", ""]
    return "\n".join(lines)


_KIND_NAMES = {"moe": "MoE MLP", "moa": "MoE attention", "mod": "Mixture-of-Depths",
               "mone": "Mixture of Nested Experts"}


def _tags(kinds: list[str], model: nn.Module) -> list[str]:
    tags = {"moe": "mixture-of-experts", "moa": "mixture-of-experts", "mod": "mixture-of-depths",
            "mone": "mixture-of-nested-experts"}
    out = list(dict.fromkeys(tags[k] for k in kinds if k in tags))
    if isinstance(model, SingleTaskModel):
        out.append("extracted")
    return out


def _pipeline(inner: SquadViT, tasks: list[str]) -> str:
    """The hub's pipeline tag: what every task predicts when they agree (depth, segments, classes), else
    image-to-image (dense maps) or image-classification."""
    heads = {h.name: h.kind for h in inner.cfg.head_configs()}
    kinds = {"depth" if t.startswith("depth") else "segment" if t.startswith("segment") else
             "class" if heads.get(t) != "dense" else "dense" for t in tasks}
    if len(kinds) == 1 and next(iter(kinds)) in PIPELINES:
        return PIPELINES[next(iter(kinds))]
    return "image-to-image" if "dense" in kinds or "depth" in kinds or "segment" in kinds else "image-classification"


def _task_table(inner: SquadViT, model: nn.Module, tasks: list[str], heads: dict, extra: dict,
                config: dict) -> list[str]:
    metrics = extra.get("metrics") or {}
    if isinstance(model, SingleTaskModel):
        m = (config.get("report") or {}).get("metrics") or {}
        metrics = {model.task: m.get("extracted")} if m.get("extracted") else {}
    rows = ["| task | head | channels | validation metrics |", "| --- | --- | --- | --- |"]
    for t in tasks:
        h = heads.get(t)
        values = metrics.get(t) if isinstance(metrics.get(t), dict) else {}
        shown = ", ".join(f"{n} {_num(v)}" for n, v in values.items()) or "–"
        rows.append(f"| {t} | {getattr(h, 'kind', '?')} | {getattr(h, 'channels', '?')} | {shown} |")
    if not any(isinstance(v, dict) and v for v in metrics.values()):
        rows += ["", "No validation metrics were saved with this model (a run without validation data)."]
    else:
        rows += ["", "On the validation split at the end of training (errors and losses: lower is better; accuracies "
                 "and δ thresholds, in percent: higher is better)."]
    return rows


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "–" if v is None else str(v)


def _compute(inner: SquadViT, tasks: list[str]) -> list[str]:
    prof = profile(inner, tasks)
    lines = ["## Size and compute", "",
             f"{prof['params']:,} parameters; backbone {_macs(prof['backbone_macs'])} MACs per image "
             f"(routed layers counted at the experts each token activates).", "",
             "| task | active parameters | MACs per image (backbone + head) |", "| --- | --- | --- |"]
    for t, entry in prof["tasks"].items():
        lines.append(f"| {t} | {entry['active_params']:,} | {_macs(entry['macs'])} |")
    return [*lines, ""]


def _macs(n: float) -> str:
    return f"{n / 1e9:,.2f} G" if n >= 1e9 else f"{n / 1e6:,.2f} M"


def _routing(usage: ExpertUsage | None, tasks: list[str]) -> list[str]:
    lines = ["## Routing", ""]
    if usage is None or not usage.counts:
        return [*lines, "No expert-usage statistics were saved with this model.", ""]
    shown = [t for t in tasks if t in usage.tasks]
    lines += ["From the expert-usage statistics of training. MoE layers: experts a task sends at least "
              f"{MIN_SHARE:.0%} of its selections to, of E. MoD blocks: share of a task's tokens the block processed. "
              "MoNE routers: share of a task's tokens at the full-width expert.", "",
              "| layer | kind | " + " | ".join(shown) + " |", "| --- | --- |" + " --- |" * len(shown)]
    share = usage.selection_share()
    mod, mone = mod_shares(usage), mone_shares(usage)
    for layer, kind in usage.kinds.items():
        cells = []
        for t in shown:
            i = usage.tasks.index(t)
            if layer in share:
                row = share[layer][i]
                cells.append(f"{int((row >= MIN_SHARE).sum())}/{row.numel()}" if row.sum() > 0 else "–")
            elif layer in mod:
                v = mod[layer].get(t)
                cells.append("–" if v is None else f"{v:.0%}")
            elif layer in mone:
                v = mone[layer].get(t)
                cells.append("–" if v is None else f"{v[-1]:.0%}")
            else:
                cells.append("–")
        lines.append(f"| {layer} | {_KIND_NAMES.get(kind, kind)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _training(extra: dict, run: dict, config: dict) -> list[str]:
    lines = ["## Training", ""]
    if run.get("command"):
        lines += ["```", run["command"], "```", ""]
    data = run.get("data") or {}
    if data:
        tasks = data.get("tasks")
        lines.append(f"- data: {data.get('dataset', '?')} at `{data.get('root', '?')}` (train split "
                     f"{data.get('split', '?')}, validation split {data.get('val_split', '?')}"
                     + (f", tasks {tasks}" if tasks not in (None, 'all') else "") + ")")
    train = run.get("train") or {}
    if train:
        lines.append("- " + ", ".join(f"{k} {v}" for k, v in train.items() if v is not None))
    if extra.get("step") is not None:
        lines.append(f"- trained {extra['step']} steps" + (f" on {', '.join(extra['trained_tasks'])}"
                                                           if extra.get("trained_tasks") else ""))
    report = config.get("report") or {}
    if config.get("extracted"):
        ext = config["extracted"]
        kept = sum(len(v) for v in ext["kept"].values())
        lines.append(f"- extracted for {ext['task']}: {kept} experts kept over {len(ext['kept'])} layers, "
                     f"{'exact' if ext['exact'] else 'renormalised'} routing"
                     + (f", θ = {report['theta']}" if report.get("theta") is not None else ""))
    if len(lines) == 2:
        lines.append("Not recorded (the model was saved outside a training run).")
    return [*lines, ""]


# ----------------------------------------------------------------------------------------------------- the hub
def push_to_hub(folder: str | Path, repo_id: str, *, revision: str | None = None, private: bool = False,
                commit_message: str | None = None, token: str | None = None) -> str:
    """Uploads a folder `save_pretrained` wrote to the hub repository ``repo_id`` (created if missing), with
    huggingface_hub's API (its login token unless ``token``).

    Returns:
        The commit's URL.

    Raises:
        ValueError: ``folder`` is not a squad model folder.
    """
    from huggingface_hub import HfApi

    folder = Path(folder)
    if not hf_folder.is_folder(folder):
        raise ValueError(f"{folder}: not a squad model folder (save one with squad.save_pretrained first)")
    hf_folder.read_config(folder)  # squad's, in a format this squad writes
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                             commit_message=commit_message or "squad model (squad.save_pretrained)")
    return str(info)
