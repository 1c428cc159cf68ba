"""The report of tools/reproduce.py: ``report.md`` (tables, verdicts and the rule behind them), PNG figures and
``results.json``, written from the claims' plain results (`squad.reproduce.claims`).

Layout of the output folder::

    report.md            one section per claim: the claim, its verdict, tables, the comparisons, figures, notes
    results.json         everything the report shows, as data (``claims.<name>.verdict`` ...)
    figures/*.png        Δt bars with the seed spread, the pruning curve, fine-tuning curves, expert-usage maps
                         (MI vs balance), the A-MoD recovery curve, the MoNE e_c curve, PASCAL-Context Δm bars
    runs/<run>/          the run folders (squad.load opens each)

A report covers every claim measured in the folder so far: a later invocation for other claims adds theirs (the
earlier ones are kept from ``results.json``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from squad.reproduce.claims import CLAIMS
from squad.reproduce.figures import FIGURES, big, fig_claim
from squad.reproduce.scales import Scale, format_duration
from squad.reproduce.stats import MIN_SEEDS
from squad.reproduce.tolerance import tolerance_line
from squad.reproduce.verdicts import RULE, parts_of, parts_summary, provisional, spread, verdict
from squad.tasks import get_task

# ---------------------------------------------------------------------------------------------- formatting


def _num(v, fmt: str = "{:+.2f}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return fmt.format(v)


def _ms(values: Sequence[float], fmt: str = "{:+.2f}") -> str:
    """``mean ± sd`` of per-seed values (just the value for one seed)."""
    s = spread(values)
    if s["n"] == 0:
        return "–"
    if s["n"] == 1:
        return _num(s["mean"], fmt)
    return f"{_num(s['mean'], fmt)} ± {_num(s['std'], fmt.replace('+', ''))}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(h.replace("|", "\\|") for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def _comparisons(comparisons: Sequence[dict]) -> list[str]:
    """The judged comparisons: per-seed differences, mean, one-sided 95 % bounds, p-value, status."""
    rows = []
    for c in comparisons:
        diffs = ", ".join(_num(d) for d in c["diffs"]) or "–"
        bounds = f"[{_num(c.get('lower'))}, {_num(c.get('upper'))}]" if c.get("n", 0) >= 3 else "–"
        p = c.get("p_greater") if c.get("status") != "reversed" else c.get("p_less")
        rows.append([c["label"], c.get("role", ""), diffs, _num(c.get("mean")), bounds, _num(p, "{:.3f}"),
                     f"**{c.get('status', '?')}**"])
    head = "d per seed" if not any(c["kind"] == "at_most" for c in comparisons) else "d per seed (bound − value for ≤)"
    return _table(["comparison", "role", head, "mean d", "95 % bounds (lower, upper)", "p", "status"], rows)


def _gate(gate: dict) -> list[str]:
    """The learnability gate's table: reference model, best image-independent predictor, gain per seed."""
    rows = []
    for t, r in gate["tasks"].items():
        arrow = "↓" if r["lower_is_better"] else "↑"
        rows.append([t, f"{r['metric']} {arrow}", _ms(r["reference"], "{:.4g}"),
                     f"{r['predictor']}: {_num(r['predictor_value'], '{:.4g}')}",
                     ", ".join(_num(g, "{:+.1f}") for g in r["gain"]), _num(r.get("gain_lower"), "{:+.1f}"),
                     "**counted**" if r["learnable"] else "apart"])
    return (["Learnability gate (Δt counts a task only when the reference model beats the best image-independent "
             f"predictor, fitted on the validation images themselves, by ≥ {gate['threshold']:g} % on every seed and "
             "by more than the seed noise: the mean gain's one-sided 95 % lower bound above it too; both numbers on "
             "the validation split):", ""]
            + _table(["task", "metric", "reference model (mean ± sd)", "best image-independent predictor",
                      "gain % per seed", "mean gain, 95 % lower bound", "in Δt"], rows))


def _sanitize(obj):
    """JSON without NaN/Infinity (as null) and with tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_sanitize(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------------------ sections
def _section_table2(d: dict) -> list[str]:
    rows = []
    for m in d["methods"].values():
        rows.append([m["label"], big(m.get("params")), big(m.get("macs")), _num(m.get("step_s"), "{:.3f}"),
                     _num(m.get("cpu_s"), "{:.3f}"), _num(m.get("peak_mib"), "{:.0f}"), _ms(m["dt"]),
                     ", ".join(_num(v) for v in m["dt"])])
    out = _table(["method", "params", "MACs / image / task", "s / train step", "CPU s / step", "peak MiB",
                  "Δt % (mean ± sd)", "Δt per seed"], rows)
    tasks = d["tasks"]
    head = ["task", "STL metric"] + [d["methods"][k]["label"] for k in d["methods"] if k != "stl"]
    rows = []

    counted = (d.get("gate") or {}).get("learnable", tasks)
    for t in tasks:
        stl = [m.get(t) for m in d["methods"]["stl"]["metrics"]]
        name = t if t in counted else f"{t} (apart: not learnable)"
        row = [name, f"{get_task(t).primary_metric} {_ms(stl, '{:.4f}')}"]
        for k, m in d["methods"].items():
            if k != "stl":
                row.append(_ms([p.get(t) for p in m["per_task"]]))
        rows.append(row)
    return out + ["Δt per task (%, mean ± sd over seeds; the STL column is the baseline's primary metric):", ""] + \
        _table(head, rows)


def _section_pruning(d: dict) -> list[str]:
    rows = [["full model", "1.000", "1.000", "1.000", _ms(d["full"]["dt"])]]
    for label, p in d["points"].items():
        rows.append([label, _ms(p["ratio"], "{:.3f}"), _ms(p["ratio_max"], "{:.3f}"), _ms(p["paper_ratio"], "{:.3f}"),
                     _ms(p["dt"])])
    return _table(["extraction", "parameters / full with the task's head (mean over tasks)", "(largest over tasks)",
                   "paper's count: / full with all heads (largest)", "Δt % vs STL"], rows)


def _section_finetune(d: dict) -> list[str]:
    out = []
    if d.get("plateau"):
        gains = ", ".join(_num(p.get("gain"), "{:+.1f} %") for p in d["plateau"])
        out += [f"The pretrained model's validation curve: its last evaluation gains {gains} over the one before "
                "(per seed; converged when below the plateau threshold on every seed).", ""]
    for task, t in d["tasks"].items():
        sizes = list(t["runs"][0]["table"]["router"])
        images = t["runs"][0]["images"]
        arrow = "lower" if t["lower_is_better"] else "higher"
        chance = [c for c in t.get("chance", []) if c is not None]
        apart = "" if t.get("learnable", True) else " — not learnable by STL at this scale (the gate): reported apart"
        out += [f"{task}: {t['metric']} on the validation split ({arrow} is better; untrained head "
                f"{_ms([r['untrained'].get(t['metric']) for r in t['runs']], '{:.2f}')}; STL on the whole training "
                f"split {_ms(t.get('stl', []), '{:.2f}')}"
                + (f"; chance {_ms(chance, '{:.2f}')}" if chance else "") + f"){apart}:", ""]
        rows = [[mode] + [_ms([r["table"][mode][s] for r in t["runs"]], "{:.2f}") for s in sizes]
                for mode in d["modes"]]
        rows.append(["images (learned from + held out)"]
                    + [f"{images[s]['fit']} + {images[s]['held']}" if s in images else "–" for s in sizes])
        out += _table(["mode"] + [f"{float(s):.1%}" for s in sizes], rows)
        chosen = {}
        for run in t["runs"]:
            for c in run["chosen"]:
                chosen.setdefault((c["mode"], c["size"]), []).append(f"{c['lr']:g} @ {c['best_step']}")
        rows = [[mode] + [", ".join(chosen.get((mode, s), [])) for s in sizes] for mode in d["modes"]]
        out += [f"{task}: the lr and the stopping step each mode chose on its held-out images (per seed):", ""]
        out += _table(["mode"] + [f"{float(s):.1%}" for s in sizes], rows)
    return out


def _section_mi(d: dict) -> list[str]:
    rows = []
    for v in d["variants"].values():
        rows.append([v["label"], _ms(v["experts90"], "{:.2f}"), _ms(v["entropy"], "{:.3f}"), _ms(v["mi"], "{:.3f}"),
                     _ms(v["dt"])])
    return _table(["loss", "experts for 90 % of a task's selections", "H(E|T) bits", "I(T;E) bits", "Δt % vs STL"],
                  rows)


def _section_amod(d: dict) -> list[str]:
    rows = []
    head_steps: list[str] = []
    for routing, r in d["routings"].items():
        curves = r["curves"]
        steps = [s for s, _ in curves[0]] if curves and curves[0] else []
        cells = [_ms([c[i][1] for c in curves if i < len(c)]) for i in range(len(steps))]
        fid = r["fidelity"]
        rows.append([f"{routing} routing", *cells, _ms([f["feature_cosine"] for f in fid], "{:.3f}"),
                     _ms([f["top1_agreement"] for f in fid], "{:.3f}")])
        head_steps = [f"step {s}" for s in steps]
    out = _table(["adapted model (Δt % vs the dense model)", *head_steps, "feature cosine (no training)",
                  "top-1 agreement"], rows)
    dense = d.get("dense") or []
    if dense:
        tasks = d.get("tasks") or list(dense[0].get("metrics", {}))
        steps = dense[0].get("steps") or ("–", "–")
        def step(info: dict, t: str) -> str:
            before, last = (info.get("before") or {}).get(t), (info.get("last") or {}).get(t)
            return f"{_num(before, '{:.3f}')} → {_num(last, '{:.3f}')}"

        rows = [[f"seed {i}", *[_num(info["metrics"].get(t), "{:.3f}") for t in tasks],
                 *[step(info, t) for t in tasks],
                 _num(info.get("gain"), "{:+.1f} %"), "yes" if info.get("at_plateau") else "no"]
                for i, info in enumerate(dense)]
        out += [f"The dense model before adaptation: its validation metric, and its validation curve's last two "
                f"evaluations (steps {steps[0]} → {steps[1]}) with the gain between them:", ""]
        out += _table(["dense model", *[f"{t} {get_task(t).primary_metric}" for t in tasks],
                       *[f"{t}: step {steps[0]} → {steps[1]}" for t in tasks], "gain", "plateau"], rows)
    return out


def _section_mone(d: dict) -> list[str]:
    rows = []
    macs = d.get("train_macs", {})
    for k, smp in d["sampled"].items():
        f = d["fixed_models"].get(k)
        rows.append([k, _ms(smp["dt"]), _ms(f["dt"]) if f else "–", big(macs.get(k)), big(spread(smp["macs"])["mean"]),
                     _ms([1e3 * v for v in smp["forward_s"]], "{:.1f}")])
    return _table(["e_c", "Δt % adaptive model", "Δt % model trained at e_c", "training MACs of that model",
                   "MACs / image / task", "forward ms / batch (adaptive)"], rows) + \
        [f"Every model trained {d.get('steps', '?')} steps; the adaptive model's training compute: "
         f"{big(macs.get('adaptive'))} MACs (the mean of its grid's per step).", ""]


def _section_pascal(d: dict) -> list[str]:
    rows = []
    for m in d["methods"].values():
        ratio = f"{_ms(m['ratio'], '{:.3f}')} (largest {_ms(m['ratio_max'], '{:.3f}')})" if m.get("ratio") else "–"
        paper = _ms(m["paper_ratio"], "{:.3f}") if m.get("paper_ratio") else "–"
        rows.append([m["label"], big(m.get("params")), ratio, paper, big(m.get("macs")),
                     _num(m.get("step_s"), "{:.3f}"), _num(m.get("peak_mib"), "{:.0f}"), _ms(m["dm"]),
                     ", ".join(_num(v) for v in m["dm"])])
    out = _table(["method", "params", "params / Mod-Squad with the task's head (mean over tasks)",
                  "paper's count: / Mod-Squad with every head (largest)", "MACs / image / task", "s / train step",
                  "peak MiB", "Δm % (mean ± sd)", "Δm per seed"], rows)
    head = ["task", "metric"] + [m["label"] for m in d["methods"].values()] + ["paper (real data)"]
    rows = []
    for t in d["tasks"]:
        task = get_task(t)
        arrow = "↓" if task.lower_is_better else "↑"
        row = [t, f"{task.primary_metric} {arrow}"]
        for m in d["methods"].values():
            row.append(_ms([p.get(t) for p in m["metrics"]], "{:.4f}"))
        row.append(_num(d.get("paper", {}).get("metrics", {}).get(t), "{:g}"))
        rows.append(row)
    return out + ["Primary metric per task on the validation split (mean ± sd over seeds; the paper's column is "
                  "Mod-Squad on the real PASCAL-Context, in %/degrees, for reference only):", ""] + _table(head, rows)


def _section_curve(d: dict) -> list[str]:
    if not d.get("budgets"):
        return []
    rows = []
    for f, per in d["table"].items():
        label = d["labels"][f]
        reach = d["reach_zero"].get(f)
        rows.append([label, *[_ms(per[str(n)]["values"]) for n in d["budgets"]], _ms(d["slopes"][f]),
                     f"~{reach:,.0f} steps" if reach else "–"])
    return _table(["Δt % vs STL (mean ± sd)", *[f"{n:,} steps" for n in d["budgets"]], "per doubling",
                   "reaches 0 near (extrapolated)"], rows)


SECTIONS = {"modsquad-table2": _section_table2, "table2-curve": _section_curve, "pruning": _section_pruning,
            "router-finetune": _section_finetune,
            "mi-vs-balance": _section_mi, "amod-table3": _section_amod, "mone-budget": _section_mone,
            "pascal-table3": _section_pascal}


def _shows(comparisons: Sequence[dict]) -> str:
    """One sentence on what the numbers show: each part's status, then the secondary ones by status (at most 6
    named per kind)."""
    if not comparisons:
        return "no comparison counts in the verdict (see the preconditions and what is reported apart)."
    parts = parts_of(comparisons)
    out = ["parts: " + "; ".join(f"{c['label']} — {c.get('status', '?')}" for c in parts)]
    groups = {"holds": "holds (Holm-corrected)", "reversed": "reversed (Holm-corrected)",
              "within noise": "within noise", "within tolerance": "within the cross-machine tolerance",
              "ahead": "ahead (direction only)", "behind": "behind (direction only)", "one seed": "on one seed only"}
    rest = [c for c in comparisons if c not in parts]
    for status, text in groups.items():
        labels = [c["label"] for c in rest if c.get("status") == status]
        if labels:
            more = f"; and {len(labels) - 6} more" if len(labels) > 6 else ""
            out.append(f"secondary {text} ({len(labels)} of {len(rest)}): {'; '.join(labels[:6])}{more}")
    return ". ".join(p[0].upper() + p[1:] for p in out) + "."


def scale_line(scale: Scale, seeds: Sequence[int]) -> str:
    return (f"scale **{scale.name}**: {len(scale.tasks)} tasks, {scale.img_size} px images, patch {scale.patch_size}, "
            f"ViT width {scale.embed_dim}, depth {scale.depth}, {scale.num_heads} heads (MoE attention "
            f"{scale.moa_top_k} of {scale.moa_experts} experts, MoE MLP {scale.moe_top_k} of {scale.moe_experts}), "
            f"{scale.steps} steps of {scale.batch} images per run, seeds {', '.join(map(str, seeds))}")


def part_cell(c: dict) -> str:
    """One part for the verdict table: its label, mean difference, one-sided 95 % bounds, seeds and status."""
    n = c.get("n", 0)
    bounds = f" [{_num(c.get('lower'))}, {_num(c.get('upper'))}]" if n >= 3 else ""
    return f"{c['label']}: {_num(c.get('mean'))}{bounds} — **{c.get('status', '?')}**"


def parts_cell(d: dict) -> str:
    """Every part of a claim (the verdict table's cell), one per line."""
    if not d.get("comparisons"):
        return "–"
    return "<br>".join(part_cell(c) for c in parts_of(d["comparisons"]))


def verdict_cell(d: dict) -> str:
    """The verdict, with what the parts would give where there are too few seeds for one."""
    v = f"**{d['verdict']}**"
    if d["verdict"] == "too few seeds":
        would = provisional(d["comparisons"], d.get("preconditions", ()))
        v += f" ({d['seeds']} < {MIN_SEEDS}; the parts give: {would})"
    return v


def read_results(path: str | Path, what: str = "") -> dict:
    """A ``results.json`` of tools/reproduce.py, loaded (``what``: the option that named it, for the messages).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, or not a results.json (no claims); each names the file.
    """
    path = Path(path)
    name = f"{what} {path}".strip()
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no such results.json")
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: not a results.json ({e})") from e
    if not isinstance(results, dict) or not isinstance(results.get("claims"), dict):
        raise ValueError(f"{name}: not a results.json of tools/reproduce.py (no claims)")
    return results


def write_report(out: Path, claims: dict[str, dict], meta: dict) -> Path:
    """Writes ``report.md``, ``results.json`` and the figures for ``claims`` (claim → its measured data).

    Args:
        out: the output folder.
        claims: claim name → the dict its measure function returned (verdicts are added here).
        meta: ``command``, ``scale`` (a `Scale`), ``scale_settings``, ``seeds``, ``data`` (root and its manifest),
            ``data_line``, ``seconds`` and ``duration`` (this invocation), ``train_seconds`` (every run's training),
            ``runs`` (total / trained / skipped this time), ``run_metrics`` (each finished run's final validation
            metrics by name: what `squad.reproduce.rerun` checks a rerun against).

    Returns:
        The path of report.md.
    """
    out = Path(out)
    figures = out / "figures"
    scale: Scale = meta["scale"]
    order = [c for c in CLAIMS if c in claims]
    for name in order:
        d = claims[name]
        d["verdict"] = verdict(d["comparisons"], d.get("preconditions", ()), untestable=d.get("untestable"),
                               plumbing=bool(d.get("plumbing") or scale.plumbing))
        d["seeds"] = len(meta["seeds"])
        if d["verdict"] == "too few seeds":
            d["provisional"] = provisional(d["comparisons"], d.get("preconditions", ()))
        stamp = (f"scale {scale.name} · {len(meta['seeds'])} seed{'s' if len(meta['seeds']) != 1 else ''} · "
                 f"{d.get('budget', f'{scale.steps} steps')}")
        d["figures"] = fig_claim(name, d, figures, stamp) + FIGURES[name](d, figures, stamp)
    lines = ["# Reproducing the papers' claims with squad", "",
             f"Made by `{meta['command']}` ({scale_line(scale, meta['seeds'])}; data: {meta['data_line']}). "
             f"This invocation took {meta['duration']}; training all {meta['runs']['total']} runs took "
             f"{format_duration(meta.get('train_seconds', 0.0))} in all (each run's time is in its reproduce.json). "
             "Every seed uses the same data.", "",
             "Metrics are on the validation split, which no run uses for any choice (fixed schedules, no early "
             "stopping). Δt is Mod-Squad's: the mean over the learnable tasks of each task's relative gain on its "
             "primary metric against the baseline, in percent, higher is better.", "",
             "## Verdicts", ""]
    lines += ["Each claim's parts with the mean difference d (> 0: as the paper says), its one-sided 95 % bounds "
              "[lower, upper] and its status (Holm over the claim's parts); the claim is reproduced only when every "
              "part holds.", ""]
    lines += _table(["claim", "source", "parts: mean d [95 % bounds] — status", "verdict"],
                    [[f"[{n}](#{n})", CLAIMS[n].source, parts_cell(claims[n]), verdict_cell(claims[n])]
                     for n in order])
    if meta.get("tolerance"):
        lines += [tolerance_line(meta["tolerance"]), ""]
    lines += ["## How a verdict is decided", "", RULE, ""]
    for name in order:
        d = claims[name]
        c = CLAIMS[name]
        lines += [f"## {name}", "", f"*{c.source}.* **Claim:** {c.statement}", "",
                  f"Verdict: {verdict_cell(d)}", ""]
        if d["verdict"] in ("partly reproduced", "not reproduced", "inconclusive", "too few seeds") and \
                d["comparisons"] and parts_summary(d["comparisons"]):
            lines += [f"Parts that do not hold: {parts_summary(d['comparisons'])}.", ""]
        lines += [f"Measured at scale {scale.name}, {len(meta['seeds'])} seed(s), {d.get('budget', '')}.", ""]
        if d.get("untestable"):
            lines += [f"Untestable at this scale: {d['untestable']}.", ""]
        lines += SECTIONS[name](d)
        if d.get("gate"):
            lines += _gate(d["gate"])
        if d.get("preconditions"):
            lines += ["Preconditions of a fair test (one not met makes the claim inconclusive):", ""]
            lines += _table(["precondition", "detail", "status"],
                            [[p["label"], p.get("detail", ""), f"**{p['status']}**"] for p in d["preconditions"]])
        if d["comparisons"]:
            lines += ["Comparisons (the rule above; the parts first):", ""] + _comparisons(d["comparisons"])
        lines += [f"What the numbers show: {_shows(d['comparisons'])}", ""]
        if d.get("apart"):
            lines += ["Reported apart (controls, and tasks the test cannot use; not part of the verdict):", ""]
            lines += _comparisons(d["apart"])
        lines += [f"![{name}]({f})" for f in d["figures"]] + [""]
        lines += [f"- {n}" for n in d.get("notes", [])] + [""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    results = {"command": meta["command"], "scale": scale.name, "scale_settings": meta["scale_settings"],
               "seeds": list(meta["seeds"]), "data": meta["data"], "rule": RULE,
               "verdicts": {n: claims[n]["verdict"] for n in order}, "claims": {n: claims[n] for n in order},
               "tolerance": meta.get("tolerance"), "run_metrics": meta.get("run_metrics", {}),
               "seconds": meta["seconds"], "train_seconds": meta.get("train_seconds"), "runs": meta["runs"]}
    (out / "results.json").write_text(json.dumps(_sanitize(results), indent=1) + "\n")
    return report
