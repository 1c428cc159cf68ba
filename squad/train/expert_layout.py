"""Moving a checkpoint's experts between DeepSpeed's state and squad's shard files, for a run that resumes with
another set of expert-parallel layers.

Where a layer's experts live in a tag depends on its ``expert_parallel`` P when it was saved: at P = 1 inside
DeepSpeed's files (module weights, and the optimizer's state), at P > 1 in squad's shard files
(``expert_shards_rank*.pt``, by global expert: `squad.train.expert_shards`). Shard files load at any P > 1 and any
number of ranks as they are; a layer whose P crosses 1 (a run saved at EP 2 resumed at EP 1, or the other way)
needs the tag rewritten (`convert`): its experts' weights and Adam moments move from one side to the other, and
DeepSpeed's optimizer state is re-indexed for the parameters the resuming run gives it. The parameter order of both
layouts is the order of the whole (unsharded) objective's parameters, grouped as `squad.train.optim` groups them.

At ZeRO stage 0 the optimizer state is whole in the model-states file and is re-indexed there (`convert`); a tag of
a partitioned optimizer (ZeRO 1/2/3, bf16) becomes DeepSpeed's universal checkpoint first, whose per-parameter
folders the experts join or leave (`convert_universal`).
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from squad.io.checkpoints import MODEL_STATES, load_checkpoint_file
from squad.io.expert_files import SHARD_FILE, SHARD_FORMAT, SHARD_GLOB, assemble, read_pieces
from squad.io.files import atomic_torch_save
from squad.train.checkpointer import Conversion, Topology, Universal
from squad.train.optim import group_key, group_name


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter of the whole objective: its name in the engine's module, its dimensions, and its
    first dimension (the number of experts of an expert weight)."""

    name: str
    dim: int
    experts: int = 0


def _groups(params: list[ParamInfo], outside: set[str]) -> list[tuple[str, list[str]]]:
    """(group name, parameter names) of DeepSpeed's optimizer when ``outside`` are shards, in its order."""
    groups: dict[tuple[bool, bool], list[str]] = {}
    for p in params:
        if p.name not in outside:
            groups.setdefault(group_key(p.name, p.dim), []).append(p.name)
    return [(group_name(k), names) for k, names in sorted(groups.items())]


def convert(tag_dir: str | Path, out_dir: str | Path, params: list[ParamInfo], saved: set[str], now: set[str],
            prefix: str = "model.") -> None:
    """Writes ``tag_dir`` rewritten for a run whose shards are ``now`` into ``out_dir``.

    Args:
        tag_dir: the tag to convert.
        out_dir: the converted tag's folder (created).
        params: every trainable parameter of the whole objective, in its order.
        saved: the model-relative names the tag keeps in shard files (`squad.io.expert_files.shard_names`).
        now: the model-relative names the resuming run keeps as shards.
        prefix: the model's name inside the engine's module.

    Raises:
        ValueError: the tag's optimizer state is partitioned (ZeRO 1/2), or its optimizer groups are not those of
            ``params`` (another model).
    """
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    states = load_checkpoint_file(tag_dir / MODEL_STATES)
    opt = states.get("optimizer")
    if not (isinstance(opt, dict) and "param_groups" in opt):
        raise ValueError(f"{tag_dir}: its optimizer state is partitioned by rank (ZeRO 1/2 or bf16); moving experts "
                         f"between DeepSpeed and shard files needs it whole (ZeRO stage 0)")
    info = {p.name: p for p in params}
    old_groups = _groups(params, {prefix + n for n in saved})
    if [(g["name"], len(g["params"])) for g in opt["param_groups"]] != [(n, len(v)) for n, v in old_groups]:
        raise ValueError(f"{tag_dir}: its optimizer groups {[g['name'] for g in opt['param_groups']]} are not this "
                         f"model's (expected {[n for n, _ in old_groups]})")
    old_state = {}  # name -> the optimizer's state of that parameter
    for g, (_, names) in zip(opt["param_groups"], old_groups, strict=True):
        for idx, name in zip(g["params"], names, strict=True):
            old_state[name] = opt["state"].get(idx)
    pieces = read_pieces(tag_dir)
    module = dict(states["module"])
    shards: dict[str, dict] = {}
    for name in sorted(saved | now):
        full = prefix + name
        if name in saved and name not in now:  # into DeepSpeed: whole weights and moments from the pieces
            weight, moments = assemble(pieces[name], range(info[full].experts), tag_dir, name)
            module[full] = weight.to(_module_dtype(module))
            old_state[full] = None if moments is None else {"step": torch.tensor(moments[2]), "exp_avg": moments[0],
                                                              "exp_avg_sq": moments[1]}
        elif name in now and name not in saved:  # out of DeepSpeed: into a shard file
            st = old_state.get(full) or {}
            shards[name] = {"first": 0, "num_experts": module[full].shape[0], "weight": module.pop(full).float(),
                            "exp_avg": st.get("exp_avg"), "exp_avg_sq": st.get("exp_avg_sq"),
                            "step": float(st["step"]) if "step" in st else 0.0}
        elif name in now:  # stays a shard
            weight, moments = assemble(pieces[name], range(info[full].experts), tag_dir, name)
            shards[name] = {"first": 0, "num_experts": weight.shape[0], "weight": weight,
                            "exp_avg": moments[0] if moments else None, "exp_avg_sq": moments[1] if moments else None,
                            "step": moments[2] if moments else 0.0}
    new_groups = _groups(params, {prefix + n for n in now})
    by_name = {g["name"]: g for g in opt["param_groups"]}
    groups, state, idx = [], {}, 0
    for gname, names in new_groups:
        like = by_name.get(gname) or _sibling(opt["param_groups"], gname)
        group = {k: v for k, v in like.items() if k != "params"}
        group.update(name=gname, params=list(range(idx, idx + len(names))))
        for name in names:
            if old_state.get(name) is not None:
                state[idx] = old_state[name]
            idx += 1
        groups.append(group)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in tag_dir.iterdir():  # everything else of the tag as it is (the optimizer is whole in MODEL_STATES)
        if f.is_file() and f.name != MODEL_STATES and not f.match(SHARD_GLOB):
            shutil.copy2(f, out_dir / f.name)
    states = {**states, "module": module, "optimizer": {"state": state, "param_groups": groups}}
    _regroup_schedule(states, opt["param_groups"], [n for n, _ in new_groups])
    atomic_torch_save(states, out_dir / MODEL_STATES, "the converted model states")
    if shards:
        atomic_torch_save({"format": SHARD_FORMAT, "shards": shards}, out_dir / SHARD_FILE.format(0),
                          "the converted expert shards")


def _regroup(values: dict, old_groups: list[dict], new_names: list[str]) -> dict:
    """``values`` with every per-group list (one entry per group of ``old_groups``) rearranged for the groups
    ``new_names``: a group the tag lacks takes the entry of a group that decays alike (`_sibling`)."""
    old = [g["name"] for g in old_groups]
    pick = [old.index(n) if n in old else old.index(_sibling(old_groups, n)["name"]) for n in new_names]
    return {k: [dict(v[i]) if isinstance(v[i], dict) else v[i] for i in pick]
            if isinstance(v, list) and len(v) == len(old) else v for k, v in values.items()}


def _regroup_schedule(states: dict, old_groups: list[dict], new_names: list[str]) -> None:
    """The learning-rate schedule's per-group lists (``base_lrs``, ``_last_lr``) follow the new groups."""
    if isinstance(states.get("lr_scheduler"), dict):
        states["lr_scheduler"] = _regroup(states["lr_scheduler"], old_groups, new_names)


def _whole_module(states: dict) -> bool:
    """Whether a model-states file holds the module's weights (ZeRO-3's hold empty partitions)."""
    return any(t.numel() for t in states["module"].values() if torch.is_tensor(t) and t.is_floating_point())


def _module_dtype(module: dict) -> torch.dtype:
    return next((t.dtype for t in module.values() if t.is_floating_point()), torch.float32)


def _sibling(groups: list[dict], name: str) -> dict:
    """The hyperparameters of a group the tag does not have: a group that decays (or not) alike."""
    no_decay = name.endswith("no_decay")
    return next((g for g in groups if g["name"].endswith("no_decay") == no_decay), groups[0])


def whole_params(objective_factory) -> list[ParamInfo]:
    """Every trainable parameter of the whole objective, in order: ``objective_factory()`` builds it (on the meta
    device: nothing is allocated)."""
    with torch.device("meta"):
        objective = objective_factory()
    return [ParamInfo(n, p.dim(), p.shape[0] if p.dim() else 0) for n, p in objective.named_parameters()
            if p.requires_grad]


def convert_universal(tag_dir: Path, out_dir: Path, params: list[ParamInfo], saved: set[str], now: set[str],
                      prefix: str = "model.") -> None:
    """`convert` for a tag of a partitioned optimizer (ZeRO 1/2/3, bf16): DeepSpeed's universal checkpoint first
    (`squad.train.checkpointer.Universal`: every parameter's fp32 weights and Adam moments whole, in
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``), then the experts moved between its folders and shard files,
    and its optimizer groups (``zero/optimizer_state.pt``, which DeepSpeed pairs with the run's groups by position)
    made those of the resuming run. The converted tag loads with ``checkpoint.load_universal`` on any number of
    ranks."""
    Universal().convert(tag_dir, out_dir)
    zero = out_dir / "zero"
    info = {p.name: p for p in params}
    pieces = read_pieces(tag_dir)
    shards: dict[str, dict] = {}
    for name in sorted(saved | now):
        folder = zero / (prefix + name)
        if name in saved:  # whole from the shard files
            weight, moments = assemble(pieces.get(name, []), range(info[prefix + name].experts), tag_dir, name)
        else:  # whole from the universal folder
            parts = {k: load_checkpoint_file(folder / f"{k}.pt") for k in ("fp32", "exp_avg", "exp_avg_sq", "step")
                     if (folder / f"{k}.pt").is_file()}
            weight = parts["fp32"]["param"]
            moments = (parts["exp_avg"]["param"], parts["exp_avg_sq"]["param"], float(parts.get("step", 0))) \
                if "exp_avg" in parts else None
            shutil.rmtree(folder)
        if name in now:
            shards[name] = {"first": 0, "num_experts": weight.shape[0], "weight": weight.float(),
                            "exp_avg": moments[0] if moments else None, "exp_avg_sq": moments[1] if moments else None,
                            "step": moments[2] if moments else 0.0}
            continue
        folder.mkdir(parents=True, exist_ok=True)  # into DeepSpeed: a universal parameter folder
        torch.save({"cat_dim": 0, "param": weight.float()}, folder / "fp32.pt")
        if moments is not None:
            torch.save({"cat_dim": 0, "param": moments[0]}, folder / "exp_avg.pt")
            torch.save({"cat_dim": 0, "param": moments[1]}, folder / "exp_avg_sq.pt")
            torch.save(torch.tensor(moments[2]), folder / "step.pt")
    new_names = [n for n, _ in _groups(params, {prefix + n for n in now})]
    optim = load_checkpoint_file(zero / "optimizer_state.pt")
    old_groups = [dict(g) for g in optim["param_groups"]]
    for file in out_dir.glob("*model_states.pt"):  # DeepSpeed loads the module strictly: the same weights as the run
        states = load_checkpoint_file(file)
        module = {k: v for k, v in states["module"].items() if k.removeprefix(prefix) not in now}
        for name in saved - now:
            module[prefix + name] = torch.zeros(0) if not _whole_module(states) else \
                assemble(pieces[name], range(info[prefix + name].experts), tag_dir, name)[0].to(_module_dtype(module))
        states = {**states, "module": module}
        _regroup_schedule(states, old_groups, new_names)
        atomic_torch_save(states, file, "the converted model states")
    optim = _regroup(optim, old_groups, new_names)  # param groups, paddings, partition counts
    for group, name in zip(optim["param_groups"], new_names, strict=True):
        group["name"] = name
    torch.save(optim, zero / "optimizer_state.pt")
    if shards:
        atomic_torch_save({"format": SHARD_FORMAT, "shards": shards}, out_dir / SHARD_FILE.format(0),
                          "the converted expert shards")


class ExpertLayout(Conversion):
    """The checkpointer's conversion for a run whose set of sharded expert weights differs from the tag's (a layer's
    expert_parallel crossed 1): `convert` (ZeRO stage 0) or `convert_universal` (a partitioned optimizer), into
    ``.convert/<tag>``.

    Args:
        now: the expert weights this run keeps as shards (single-process names).
        params: builds the whole objective's `ParamInfo` list (called only when a tag is converted).
    """

    name = "expert layout"

    def __init__(self, now: set[str], params: Callable[[], list[ParamInfo]]):
        self.now = set(now)
        self.params = params
        self.partitioned = False  # of the tag `needed` last said yes to

    def needed(self, saved: Topology, now: Topology) -> bool:
        self.partitioned = saved.partitioned
        return set(saved.expert_shards) != self.now

    def ds_config(self) -> dict:
        return Universal().ds_config() if self.partitioned else {}

    def convert(self, tag_dir: Path, out_dir: Path) -> None:
        saved = Topology.of_tag(tag_dir)
        old = set(saved.expert_shards) if saved is not None else set()
        if saved is not None and saved.partitioned:
            convert_universal(tag_dir, out_dir, self.params(), old, self.now)
        else:
            convert(tag_dir, out_dir, self.params(), old, self.now)

    def after_load(self, engine, tag_dir: Path) -> None:
        if self.partitioned:
            Universal().after_load(engine, tag_dir)
