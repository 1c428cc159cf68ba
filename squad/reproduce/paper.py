"""``--scale paper``: the real-Taskonomy run configs of the chosen claims and the exact commands, written, not run.

Each training run of a claim gets a self-contained run config (``configs/<run>.yaml``: the paper's widths from
configs/model/, the schedule and data settings of configs/taskonomy/modsquad_vit_b.yaml — AdamW 2e-4, 100 epochs
with 10 of warm-up, 12 images per GPU, bf16, ZeRO-1) and one ``deepspeed --hostfile`` command in ``commands.sh``;
the post-training steps (extraction, router fine-tuning, A-MoD adaptation, MoNE evaluation per e_c) follow as the
matching squad tools' commands. The data root is ``--data`` or a placeholder: commands.sh passes
``--set data.root=$TASKONOMY`` so it is set in one place.

pascal-table3's runs use the real PASCAL-Context instead: each config is its family's run config
(configs/pascal_context/{stl,mtl,modsquad}_vit_s.yaml: Table 3's ViT-S at 512 px, batch 8, 100 epochs,
``data.dataset: pascal_context``) with the run's heads and seed; their commands pass ``--set data.root=$PASCAL``
(``--pascal-data`` or a placeholder), and the pruned model is extracted per task at θ = 0.01.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import yaml

from squad.reproduce.claims import CLAIMS
from squad.reproduce.runs import FAMILIES, Runner, RunSpec, paper_config_dict
from squad.reproduce.scales import PASCAL_THETA, get_scale, pascal_scale
from squad.reproduce.specs import (
    PASCAL_METHODS,
    Context,
    amod_dense_spec,
    held_out,
    method_spec,
    mone_spec,
    pascal_ctx,
    pascal_spec,
    pretrain_spec,
)

PLACEHOLDER = "/path/to/taskonomy"
PASCAL_PLACEHOLDER = "/path/to/PASCAL_MT"


def _q(p) -> str:
    return shlex.quote(str(p))


def write_paper_plan(claims: Sequence[str], out: str | Path, seeds: int, data: str | None = None,
                     hostfile: str = "hostfile", pascal_data: str | None = None) -> dict:
    """Writes ``configs/*.yaml``, ``commands.sh`` and ``README.md`` into ``out`` for the claims at paper scale.

    Args:
        claims: claim names (`squad.reproduce.claims.CLAIMS`).
        out: the output folder.
        seeds: seeds per run.
        data: the Taskonomy root (default: a placeholder to set in commands.sh).
        hostfile: the DeepSpeed hostfile the commands name.
        pascal_data: the PASCAL-Context root of pascal-table3 (default: a placeholder to set in commands.sh).

    Returns:
        ``{"configs": [paths], "commands": path, "train_commands": [command lines]}``.
    """
    scale = get_scale("paper")
    out = Path(out).resolve()
    root = data or PLACEHOLDER
    proot = pascal_data or PASCAL_PLACEHOLDER
    ctx = Context(scale, list(range(seeds)), Path(root), out, Runner(out, scale, Path(root)),
                  pascal=pascal_scale(scale), pascal_data=Path(proot))
    cfg_dir = out / "configs"
    cfg_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, RunSpec] = {}
    for name in claims:
        for spec in CLAIMS[name].specs(ctx):
            if spec.init is None:  # the A-MoD fine-tunes start from an adapted model: see the post-training notes
                runs.setdefault(spec.name, spec)
    configs, train_lines = [], []
    for spec in runs.values():
        file = cfg_dir / f"{spec.name}.yaml"
        pascal = FAMILIES[spec.family].dataset == "pascal_context"
        var = "PASCAL" if pascal else "TASKONOMY"
        data_cfg = paper_config_dict(spec, scale, proot if pascal else root)
        header = (f"# tools/reproduce.py --scale paper: run {spec.name} ({spec.family}, seed {spec.seed}); paper "
                  f"widths and schedule.\n# data.root is set by commands.sh (--set data.root=${var}).\n")
        file.write_text(header + yaml.safe_dump(data_cfg, sort_keys=False))
        configs.append(file)
        train_lines.append(f"deepspeed --hostfile {_q(hostfile)} tools/train.py --config {_q(file)} "
                           f"--out {_q(out / 'runs' / spec.name)} --set data.root=\"${var}\"")
    post = _post_training(claims, ctx, out)
    script = ["#!/usr/bin/env bash",
              f"# The paper-scale runs of: {', '.join(claims)} ({seeds} seed{'s' if seeds != 1 else ''}).",
              "# Run from the squad checkout; every training command is one multi-node DeepSpeed job (the hostfile",
              "# lists the nodes: 12 images per GPU x 8 GPUs x 15 nodes = the paper's batch of 1440).",
              "set -euo pipefail",
              f"TASKONOMY=${{TASKONOMY:-{root}}}",
              *([f"PASCAL=${{PASCAL:-{proot}}}  # pascal-table3: the PASCAL_MT folder (or its shards)"]
                if "pascal-table3" in claims else []),
              "", "# ---- training runs", *train_lines, "", "# ---- after training", *post, ""]
    commands = out / "commands.sh"
    commands.write_text("\n".join(script))
    commands.chmod(0o755)
    (out / "README.md").write_text(
        "# Paper-scale plan (tools/reproduce.py --scale paper)\n\n"
        f"Claims: {', '.join(claims)}. `configs/` holds one self-contained run config per training run (paper "
        "widths, the schedule of configs/taskonomy/modsquad_vit_b.yaml); `commands.sh` trains them with "
        f"`deepspeed --hostfile {hostfile}` and then runs the post-training steps with squad's tools. Set "
        "`TASKONOMY` to the dataset root (or pass --data when writing the plan).\n\n"
        "The short fine-tune of the A-MoD-adapted models (amod-table3) starts from the adapted weights, which "
        "tools/train.py cannot load; at paper scale the plan scores the adapted models with no training "
        "(tools/adapt_pretrained.py) — the small scale measures the fine-tune in-process.\n\n"
        "router-finetune's commands run tools/finetune_router.py at one lr per mode; the comparison the report makes "
        "(every mode at the same budget, its lr and stopping step chosen on held-out training images) is "
        "`squad.reproduce.finetune.finetune_task`, which the in-process scales run.\n"
        + ("\npascal-table3 trains on the real PASCAL-Context (set `PASCAL` to the PASCAL_MT folder, or pass "
           "--pascal-data): its configs are configs/pascal_context/*_vit_s.yaml (Table 3's ViT-S at 512 px, batch 8, "
           "100 epochs) with each run's heads and seed; the pruned model is every task extracted at θ = "
           f"{PASCAL_THETA:g}.\n" if "pascal-table3" in claims else ""))
    return {"configs": [str(c) for c in configs], "commands": str(commands), "train_commands": train_lines}


def _post_training(claims: Sequence[str], ctx: Context, out: Path) -> list[str]:
    scale = ctx.scale
    lines: list[str] = []
    runs = out / "runs"
    for seed in ctx.seeds:
        if "pruning" in claims:
            run = runs / method_spec(ctx, "modsquad", seed).name
            for task in ctx.tasks:
                for theta in scale.thetas:
                    lines.append(f"python tools/extract.py --checkpoint {_q(run)} --task {task} --theta {theta:g} "
                                 f"--data \"$TASKONOMY\" --out {_q(run / 'extracted' / f'{task}_theta{theta:g}.pt')}")
                lines.append(f"python tools/extract.py --checkpoint {_q(run)} --task {task} --keep-top "
                             f"{scale.keep_top:g} --data \"$TASKONOMY\" "
                             f"--out {_q(run / 'extracted' / f'{task}_top{scale.keep_top:g}.pt')}")
        if "router-finetune" in claims:
            run = runs / pretrain_spec(ctx, seed).name
            for task in held_out(ctx):
                lines.append(f"python tools/finetune_router.py --checkpoint {_q(run)} --task {task} --data "
                             f"\"$TASKONOMY\" --fractions {','.join(f'{f:g}' for f in scale.finetune_fractions)} "
                             f"--mode router,head,full,linear-probe --steps {scale.finetune_steps} --seed {seed} "
                             f"--save-dir {_q(run / 'finetune')} --out {_q(run / 'finetune' / f'{task}.json')}")
        if "amod-table3" in claims:
            run = runs / amod_dense_spec(ctx, seed).name
            for routing in ("attention", "learned"):
                lines.append(f"python tools/adapt_pretrained.py --checkpoint {_q(run)} --capacity "
                             f"{scale.amod_capacity:g} --routing {routing} --data \"$TASKONOMY\" "
                             f"--out {_q(run / f'amod-{routing}.pt')}")
        if "mone-budget" in claims:
            run = runs / mone_spec(ctx, seed, None).name
            for e_c in scale.mone_fixed:
                lines.append(f"python tools/evaluate.py --checkpoint {_q(run)} --data \"$TASKONOMY\" "
                             f"--mone-capacity {e_c:g} --out {_q(run / f'eval_ec{e_c:g}.json')}")
            for e_c in scale.mone_fixed:
                fixed = runs / f"mone-ec{e_c:g}-s{seed}"
                lines.append(f"python tools/evaluate.py --checkpoint {_q(fixed)} --data \"$TASKONOMY\" "
                             f"--mone-capacity {e_c:g} --out {_q(fixed / 'eval.json')}")
        if "pascal-table3" in claims:
            lines += _pascal_post(ctx, out, seed)
        if "modsquad-table2" in claims or "mi-vs-balance" in claims:
            stl = [runs / f"stl-{t}-s{seed}" / "eval.json" for t in ctx.tasks]
            for file in stl:
                lines.append(f"python tools/evaluate.py --checkpoint {_q(file.parent)} --data \"$TASKONOMY\" "
                             f"--split test --out {_q(file)}")
            families = [f for f in ("mtl", "mtl_embed", "m3vit", "moe_mlp", "moe_attn", "modsquad")
                        if "modsquad-table2" in claims]
            families += ["modsquad", "modsquad_balance_all", "modsquad_balance"] if "mi-vs-balance" in claims else []
            for f in dict.fromkeys(families):
                run = runs / method_spec(ctx, f, seed).name
                lines.append(f"python tools/evaluate.py --checkpoint {_q(run)} --data \"$TASKONOMY\" --split test "
                             f"--baseline {' '.join(_q(s) for s in stl)} --out {_q(run / 'eval.json')}")
    return lines


def _pascal_post(ctx: Context, out: Path, seed: int) -> list[str]:
    """pascal-table3 after training: the STL evaluations (the Δm baselines), MTL and Mod-Squad against them, and
    every task extracted from Mod-Squad at θ = 0.01 (the pruned model) with its held-out metrics."""
    pctx = pascal_ctx(ctx)
    runs = out / "runs"
    lines: list[str] = []
    stl = [runs / pascal_spec(pctx, "pascal_stl", seed, t).name / "eval.json" for t in pctx.tasks]
    for file in stl:
        lines.append(f"python tools/evaluate.py --checkpoint {_q(file.parent)} --data \"$PASCAL\" --split val "
                     f"--out {_q(file)}")
    for f in PASCAL_METHODS:
        run = runs / pascal_spec(pctx, f, seed).name
        lines.append(f"python tools/evaluate.py --checkpoint {_q(run)} --data \"$PASCAL\" --split val "
                     f"--baseline {' '.join(_q(s) for s in stl)} --out {_q(run / 'eval.json')}")
    run = runs / pascal_spec(pctx, "pascal_modsquad", seed).name
    for task in pctx.tasks:
        lines.append(f"python tools/extract.py --checkpoint {_q(run)} --task {task} --theta {PASCAL_THETA:g} "
                     f"--data \"$PASCAL\" --out {_q(run / 'extracted' / f'{task}_theta{PASCAL_THETA:g}.pt')}")
    return lines
