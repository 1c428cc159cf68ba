"""tools/reproduce.py: every claim end to end at tiny scale (the report's structure, never its verdicts), resuming,
the paper-scale plan, bad input, and the verdict rule on made-up numbers."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

import squad
from squad.config.run import RunConfig
from squad.reproduce.claims import CLAIMS
from squad.reproduce.verdicts import VERDICTS, compare, verdict
from tests.helpers import PY, ROOT, tool_env

TOOL = str(ROOT / "tools" / "reproduce.py")
PNG = b"\x89PNG\r\n\x1a\n"


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    res = subprocess.run([PY, TOOL, *args], cwd=ROOT, env=tool_env(), capture_output=True, text=True, timeout=900)
    return res, time.perf_counter() - t0


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """Every claim at tiny scale, once for this module (the tool renders and packs its own tiny data)."""
    out = tmp_path_factory.mktemp("reproduce") / "tiny"
    res, seconds = _run("all", "--scale", "tiny", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, res.stdout, seconds


def _sections(report: str) -> dict[str, str]:
    parts = re.split(r"^## ", report, flags=re.M)[1:]
    return {p.splitlines()[0].strip(): p for p in parts}


def test_tiny_report_has_a_section_and_a_verdict_per_claim(tiny_report):
    out, stdout, _ = tiny_report
    sections = _sections((out / "report.md").read_text())
    assert "How a verdict is decided" in sections and "Verdicts" in sections
    for name in CLAIMS:
        assert name in sections, f"no section for {name}"
        body = sections[name]
        found = re.findall(r"^Verdict: \*\*(.+?)\*\*$", body, flags=re.M)
        assert len(found) == 1 and found[0] in VERDICTS, (name, found)
        assert "| comparison |" in body  # the comparisons behind the verdict
        assert re.search(r"!\[.*\]\(figures/.+\.png\)", body), f"{name}: no figure linked"
    assert "python tools/reproduce.py all --scale tiny" in (out / "report.md").read_text()  # the command


def test_tiny_results_json_and_figures(tiny_report):
    out, _, _ = tiny_report
    results = json.loads((out / "results.json").read_text())  # strict JSON: NaN is written as null
    for key in ("command", "scale", "scale_settings", "seeds", "data", "rule", "verdicts", "claims", "seconds",
                "runs"):
        assert key in results, key
    assert results["scale"] == "tiny" and results["seeds"] == [0]
    assert set(results["verdicts"]) == set(CLAIMS) == set(results["claims"])
    for name, claim in results["claims"].items():
        assert claim["verdict"] in VERDICTS and claim["verdict"] == results["verdicts"][name]
        assert claim["comparisons"] and all(c["status"] in ("holds", "reversed", "within noise", "one seed")
                                            for c in claim["comparisons"])
        assert claim["figures"], name
        for fig in claim["figures"]:
            assert (out / fig).read_bytes()[:8] == PNG, fig
    table2 = results["claims"]["modsquad-table2"]["methods"]
    assert set(table2) == {"stl", "mtl", "m3vit", "moe_mlp", "moe_attn", "modsquad"}
    for m in table2.values():  # the cost side is measured, not assumed
        assert m["params"] > 0 and m["macs"] > 0 and m["step_s"] > 0


def test_tiny_pascal_table3_section(tiny_report):
    """pascal-table3: its own PASCAL-Context data, STL / MTL / Mod-Squad / pruned with Δm per seed, parameters full
    vs pruned, MACs, step times, the comparisons behind the verdict, a figure (the verdict itself is not checked)."""
    out, _, _ = tiny_report
    results = json.loads((out / "results.json").read_text())
    assert (out / "data" / "pascal_shards" / "shards.json").is_file()
    assert json.loads((out / "data" / "pascal" / "synthetic.json").read_text())["dataset"] == "pascal_context"
    assert results["data"]["pascal"]["root"] == str(out / "data" / "pascal_shards")
    claim = results["claims"]["pascal-table3"]
    tasks = ["semseg", "human_parts", "saliency", "normals", "edge"]
    assert claim["tasks"] == tasks
    methods = claim["methods"]
    assert set(methods) == {"stl", "pascal_mtl", "pascal_modsquad", "pruned", "pruned_top"}
    for key, m in methods.items():
        assert len(m["dm"]) == 1 and len(m["per_task"]) == 1 and set(m["metrics"][0]) == set(tasks), key
        assert m["params"] > 0 and m["macs"] > 0, key
    assert methods["stl"]["dm"] == [0.0]
    for key in ("stl", "pascal_mtl", "pascal_modsquad"):  # the cost side is measured for every trained method
        assert methods[key]["step_s"] > 0, key
    full = methods["pascal_modsquad"]["params"]
    assert methods["pruned"]["params"] < full  # one task's subnetwork against the 5-task model
    assert methods["pruned"]["ratio"][0] == pytest.approx(methods["pruned"]["params"] / full, rel=1e-6)
    assert methods["stl"]["params"] == pytest.approx(5 * methods["stl"]["params_each"])
    labels = [c["label"] for c in claim["comparisons"]]
    assert labels[0] == "Δm(Mod-Squad) > Δm(MTL)" and "θ=0.01" in labels[1] and "≤ 0.60" in labels[2]
    sections = _sections((out / "report.md").read_text())
    body = sections["pascal-table3"]
    for label in ("STL (one model per task)", "| MTL |", "| Mod-Squad |", "Mod-Squad pruned (θ=0.01)", "odsf ↑",
                  "angle_mean ↓", "![pascal-table3](figures/pascal-table3_dm.png)"):
        assert label in body, label
    for task in tasks:  # the pruned model: every task extracted at θ = 0.01, an ordinary extracted file
        model = squad.load(out / "runs" / "pascal-modsquad-s0" / "extracted" / f"{task}_theta0.01.pt")
        assert model.meta["format"] == "squad.extracted/1"
    cfg = squad.load(out / "runs" / "pascal-modsquad-s0").cfg
    assert cfg.task_names == tasks and cfg.img_size == 32


def test_every_run_is_an_ordinary_run_folder(tiny_report):
    out, stdout, _ = tiny_report
    runs = sorted(p for p in (out / "runs").iterdir() if p.is_dir())
    # 4 STL + 5 methods + balance + pretrain without the class tasks + 2 A-MoD + 3 MoNE; pascal-table3: 5 STL, MTL,
    # Mod-Squad
    assert len(runs) == 16 + 7
    for run in runs:
        model = squad.load(run)
        assert model.meta["format"] == "squad.model/1", run
        assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    progress = re.findall(r"^\[reproduce\] run (\d+)/23 (\S+): trained", stdout, flags=re.M)
    assert sorted(int(i) for i, _ in progress) == list(range(1, 24))  # one progress line per run
    assert {name for _, name in progress} == {r.name for r in runs}
    extracted = list((out / "runs" / "modsquad-s0" / "extracted").glob("*.pt"))
    assert len(extracted) == 4 * 5  # 4 tasks × (4 θ + keep-top)
    assert squad.load(extracted[0]).meta["format"] == "squad.extracted/1"
    mone = squad.load(out / "runs" / "mone-sampled-s0")
    assert mone.cfg.mone.sample_capacity == [0.2, 0.4, 0.6, 0.8, 1.0]
    amod = squad.load(out / "runs" / "amod-attention-finetune-s0")
    assert [b.mod for b in amod.cfg.blocks()] == [None, "attention"]


def test_a_second_invocation_skips_finished_runs(tiny_report):
    out, _, first = tiny_report
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/model.pt")}
    res, seconds = _run("all", "--scale", "tiny", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "23 runs (23 done already)" in res.stdout
    assert len(re.findall(r"^\[reproduce\] run \d+/23 \S+: done already, skipped$", res.stdout, flags=re.M)) == 23
    assert ": trained" not in res.stdout
    assert stamps == {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/model.pt")}
    assert seconds < first, (seconds, first)
    assert set(json.loads((out / "results.json").read_text())["verdicts"]) == set(CLAIMS)
    # a budget that differs from the folder's runs is refused, naming the run
    res, _ = _run("modsquad-table2", "--scale", "tiny", "--out", str(out), "--steps", "5")
    assert res.returncode == 2 and "trained for 3 steps" in res.stderr, res.stderr[-2000:]


def test_paper_scale_writes_configs_and_deepspeed_commands(tmp_path, load_tool, capsys):
    out = tmp_path / "paper"
    assert load_tool("tools/reproduce.py").main(["all", "--scale", "paper", "--out", str(out)]) == 0
    every = sorted((out / "configs").glob("*.yaml"))
    configs = [f for f in every if not f.name.startswith("pascal-")]
    assert len(configs) == 13 + 5 + 1 + 1 + 6  # STL, Table 2's methods, balance, pretrain, MoNE sampled + 5 fixed
    commands = (out / "commands.sh").read_text()
    pascal = [f for f in every if f.name.startswith("pascal-")]
    assert sorted(f.stem for f in pascal) == sorted([*(f"pascal-stl-{t}-s0" for t in ("semseg", "human_parts",
                                                                                        "saliency", "normals",
                                                                                        "edge")),
                                                     "pascal-mtl-s0", "pascal-modsquad-s0"])
    for file in pascal:  # Table 3's ViT-S on the real PASCAL-Context (configs/pascal_context/*.yaml)
        cfg = squad.load_config(file, cls=RunConfig)
        assert cfg.data.dataset == "pascal_context" and cfg.model.img_size == 512 and cfg.model.embed_dim == 384
        assert cfg.optim.epochs == 100 and cfg.optim.batch_per_rank == 8, file.name
        assert f"deepspeed --hostfile hostfile tools/train.py --config {file} --out {out / 'runs' / file.stem} " \
               f"--set data.root=\"$PASCAL\"" in commands, file.name
    assert squad.load_config(out / "configs" / "pascal-stl-normals-s0.yaml", cls=RunConfig).model.task_names == \
        ["normals"]
    msq = squad.load_config(out / "configs" / "pascal-modsquad-s0.yaml", cls=RunConfig)
    assert len(msq.model.task_names) == 5 and msq.model.moa.num_experts == 15 and msq.model.moa.top_k == 6
    assert "--task edge --theta 0.01" in commands and "PASCAL=${PASCAL:-/path/to/PASCAL_MT}" in commands
    for file in configs:
        cfg = squad.load_config(file, cls=RunConfig)
        assert cfg.model.img_size == 224 and cfg.optim.epochs == 100 and cfg.optim.batch_per_rank == 12
        width = 384 if file.name.startswith("mone") else 768  # MoNE's paper model is a ViT-S
        assert cfg.model.embed_dim == width, file.name
        assert f"deepspeed --hostfile hostfile tools/train.py --config {file} --out {out / 'runs' / file.stem}" \
            in commands, file.name
    assert squad.load_config(out / "configs" / "stl-normal-s0.yaml", cls=RunConfig).model.task_names == ["normal"]
    pretrain = squad.load_config(out / "configs" / "modsquad-without-object-scene-s0.yaml", cls=RunConfig)
    assert "class_object" not in pretrain.train_tasks() and len(pretrain.train_tasks()) == 11
    assert "tools/extract.py" in commands and "tools/finetune_router.py" in commands
    assert not (out / "runs").exists()  # nothing ran


def test_unknown_claim_exits_2_listing_the_claims(tmp_path, load_tool, capsys):
    assert load_tool("tools/reproduce.py").main(["table9", "--scale", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "table9" in err and all(name in err for name in CLAIMS)
    assert not any(tmp_path.iterdir())


def test_verdict_rule_on_made_up_numbers():
    assert compare("a > b", [3.0, 3.2], [1.0, 1.1])["status"] == "holds"
    assert compare("a > b", [1.0, 1.1], [3.0, 3.2])["status"] == "reversed"
    assert compare("a > b", [2.0, 1.0], [1.0, 2.0])["status"] == "within noise"  # signs disagree
    assert compare("a > b", [1.2, 5.0], [1.0, 1.0])["status"] == "within noise"  # spread larger than the mean gap
    assert compare("a > b", [3.0], [1.0])["status"] == "one seed"
    assert compare("a ≥ b", [1.0, 1.2], [1.1, 1.05], "not_worse")["status"] == "holds"  # within noise counts
    assert compare("a ≥ b", [1.0, 1.0], [1.1, 1.05], "not_worse")["status"] == "reversed"  # worse on every seed
    assert compare("a ≥ b − 2", [0.0, 0.1], [1.0, 1.0], "not_worse", 2.0)["status"] == "holds"
    assert compare("a ≥ b", [0.0, 0.1], [5.0, 5.0], "not_worse")["status"] == "reversed"
    assert compare("a ≤ 0.6", [0.5, 0.55], [0.6, 0.6], "at_most")["status"] == "holds"
    assert compare("a ≤ 0.6", [0.5, 0.7], [0.6, 0.6], "at_most")["status"] == "within noise"
    holds = compare("x", [2.0, 2.1], [0.0, 0.0])
    noise = compare("y", [2.0, -1.0], [0.0, 0.0])
    back = compare("z", [-2.0, -2.1], [0.0, 0.0])
    assert verdict([holds, holds]) == "reproduced"
    assert verdict([holds, noise]) == "inconclusive"
    assert verdict([holds, back, noise]) == "not reproduced"
    assert verdict([compare("one", [1.0], [0.0])]) == "inconclusive"


def test_run_configs_keep_each_familys_structure(tmp_path):
    from squad.reproduce.claims import Context, method_spec
    from squad.reproduce.runs import Runner, run_config
    from squad.reproduce.scales import get_scale

    scale = get_scale("small")
    ctx = Context(scale, [0], tmp_path, tmp_path, Runner(tmp_path, scale, tmp_path))
    paper = {f: squad.load_config(c) for f, c in
             [("modsquad", "modsquad_vit_b"), ("m3vit", "m3vit_vit_b"), ("moe_attn", "moe_attn_only_vit_b")]}
    for family, ref in paper.items():
        cfg = run_config(method_spec(ctx, family, 0), scale, tmp_path)
        assert [(b.attn, b.mlp) for b in cfg.model.plan] == [(b.attn, b.mlp) for b in ref.model.plan], family
        assert (cfg.loss.w_mi, cfg.loss.balance) == (ref.loss.w_mi, ref.loss.balance), family
        assert cfg.model.embed_dim == scale.embed_dim and cfg.model.img_size == scale.img_size
        assert cfg.model.moa.top_k * cfg.model.moa.head_dim == cfg.model.embed_dim  # as ViT-B's 12 × 64 = 768
    msq = run_config(method_spec(ctx, "modsquad", 0), scale, tmp_path).model
    assert msq.head_dim == 2 * scale.embed_dim // scale.num_heads  # Mod-Squad's dense heads twice D / heads
    balance = run_config(method_spec(ctx, "modsquad_balance", 0), scale, tmp_path)
    assert balance.loss.w_mi == 0 and balance.loss.balance == "switch" and balance.loss.balance_scope == "per_task"
