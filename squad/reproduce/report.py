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

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from squad.reproduce.claims import CLAIMS  # noqa: E402
from squad.reproduce.scales import Scale, format_duration  # noqa: E402
from squad.reproduce.verdicts import RULE, spread, verdict  # noqa: E402
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


def _big(v) -> str:
    if v is None:
        return "–"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(h.replace("|", "\\|") for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def _comparisons(comparisons: Sequence[dict]) -> list[str]:
    rows = []
    for c in comparisons:
        diffs = ", ".join(_num(d) for d in c["diffs"]) or "–"
        noise = c.get("noise")
        rows.append([c["label"], diffs, _num(c["mean"]), _num(noise, "{:.2f}"), f"**{c['status']}**"])
    head = "difference per seed" if not any(c["kind"] == "at_most" for c in comparisons) else \
        "difference per seed (bound − value for ≤)"
    return _table(["comparison", head, "mean", "noise", "status"], rows)


def _sanitize(obj):
    """JSON without NaN/Infinity (as null) and with tuples as lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_sanitize(v) for v in obj]
    return obj


def _save(fig, path: Path, stamp: str = "") -> str:
    """Writes a figure with ``stamp`` (its scale, seeds and steps) under it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for ax in fig.axes:  # plain tick values (no "+5.049e1" offset above the axis)
        try:
            ax.ticklabel_format(axis="y", useOffset=False)
        except AttributeError:  # an axis without a scalar formatter (a colour bar, a log axis)
            pass
    if stamp:  # below everything drawn (rotated tick labels reach below the axes)
        bottom = fig.get_tightbbox(fig.canvas.get_renderer()).y0 / fig.get_figheight()
        fig.text(0.5, bottom - 0.01, stamp, ha="center", va="top", fontsize=7, color="dimgray")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"figures/{path.name}"


def _finite_mean(values) -> float:
    """The mean of the values that are numbers (NaN when none is: a bar left out)."""
    mean = spread([v for v in values if v is not None])["mean"]
    return mean if math.isfinite(mean) else float("nan")


def _errorbar_points(ax, xs, per_seed: Sequence[Sequence[float]], **kw) -> None:
    means = [spread(v)["mean"] for v in per_seed]
    stds = [spread(v)["std"] for v in per_seed]
    stds = [s if math.isfinite(s) else 0.0 for s in stds]
    ax.errorbar(xs, means, yerr=stds, capsize=3, marker="o", **kw)


# ------------------------------------------------------------------------------------------------- figures
def fig_table2(data: dict, folder: Path, stamp: str = "") -> list[str]:
    """Mean Δt per method with the seed spread (bars, sd) and every seed (dots); Δt per task per method."""
    methods = [k for k in data["methods"] if k != "stl"]
    labels = [data["methods"][k]["label"] for k in methods]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, k in enumerate(methods):
        vals = [v for v in data["methods"][k]["dt"] if v is not None and math.isfinite(v)]
        s = spread(vals)
        ax.bar(i, s["mean"] if vals else 0.0, yerr=s["std"] if math.isfinite(s["std"]) else 0.0, capsize=4,
               color="tab:orange" if k == "modsquad" else "tab:blue", alpha=0.8)
        ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(methods)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("Δt vs STL (%)")
    ax.set_title("Mean Δt over tasks (bar: mean ± sd over seeds; dots: seeds)", fontsize=9)
    files = [_save(fig, folder / "modsquad-table2_dt.png", stamp)]
    tasks = data["tasks"]
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(tasks) + 2), 3.8))
    width = 0.8 / len(methods)
    for i, k in enumerate(methods):
        per = data["methods"][k]["per_task"]
        means = [_finite_mean([p.get(t) for p in per]) for t in tasks]
        ax.bar(np.arange(len(tasks)) + (i - (len(methods) - 1) / 2) * width, means, width,
               label=data["methods"][k]["label"])
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("Δt vs STL (%)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Δt per task (mean over seeds)", fontsize=9)
    files.append(_save(fig, folder / "modsquad-table2_dt_per_task.png", stamp))
    return files


def fig_pruning(data: dict, folder: Path, stamp: str = "") -> list[str]:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, p in data["points"].items():
        rs, ds = spread(p["ratio"]), spread(p["dt"])
        ax.errorbar(rs["mean"], ds["mean"], xerr=rs["std"] if math.isfinite(rs["std"]) else 0,
                    yerr=ds["std"] if math.isfinite(ds["std"]) else 0, marker="o", capsize=3, label=label)
    fs = spread(data["full"]["dt"])
    ax.errorbar(1.0, fs["mean"], yerr=fs["std"] if math.isfinite(fs["std"]) else 0, marker="s", color="black",
                capsize=3, label="full model")
    ax.axvline(0.6, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("parameters / full model with the task's head only (mean over tasks)")
    ax.set_ylabel("Δt vs STL (%)")
    ax.set_title("Extracted single-task models (mean ± sd over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    return [_save(fig, folder / "pruning_curve.png", stamp)]


def fig_finetune(data: dict, folder: Path, stamp: str = "") -> list[str]:
    tasks = list(data["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        t = data["tasks"][task]
        sizes = list(t["runs"][0]["table"]["router"])
        xs = [float(s) * 100 for s in sizes]
        for mode in data["modes"]:
            per = [[r["table"][mode][s] for r in t["runs"]] for s in sizes]
            _errorbar_points(ax, xs, per, label=mode)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [f"{x:g} %" for x in xs])
        ax.set_xlabel("training data")
        ax.set_ylabel(f"{t['metric']} ({'lower' if t['lower_is_better'] else 'higher'} is better)")
        stl = spread(t.get("stl") or [])["mean"]
        if math.isfinite(stl):
            ax.axhline(stl, color="black", ls="--", lw=0.8, label="STL, whole split")
        chance = spread([c for c in t.get("chance") or [] if c is not None])["mean"]
        if math.isfinite(chance):
            ax.axhline(chance, color="grey", ls=":", lw=0.8, label="chance")
        ax.set_title(f"{task}{'' if t.get('learnable', True) else ' (not learnable at this scale: apart)'}",
                     fontsize=9)
        ax.legend(fontsize=7)
    return [_save(fig, folder / "router-finetune_curves.png", stamp)]


def fig_usage(data: dict, folder: Path, stamp: str = "") -> list[str]:
    variants = list(data["variants"])
    layers = list(data["variants"][variants[0]]["maps"] or {})
    if not layers:
        return []
    fig, axes = plt.subplots(len(variants), len(layers), figsize=(2.6 * len(layers) + 1.5, 0.28 * len(
        data["tasks"]) * len(variants) + 1.5), squeeze=False)
    top = max(float(np.nanmax(np.asarray(data["variants"][v]["maps"][layer]["share"], dtype=float)))
              for v in variants for layer in layers)
    im = None
    for i, v in enumerate(variants):
        maps = data["variants"][v]["maps"]
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            share = np.asarray(maps[layer]["share"], dtype=float)
            im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=top)
            ax.set_xticks(range(share.shape[1]))
            ax.set_title(f"{data['variants'][v]['label']}: {layer} ({maps[layer]['kind']})", fontsize=7)
            ax.set_xlabel("expert", fontsize=7)
            ax.set_yticks(range(len(data["tasks"])), data["tasks"] if j == 0 else [""] * len(data["tasks"]),
                          fontsize=6)
            ax.tick_params(axis="x", labelsize=6)
    fig.suptitle("P(expert | task) on the validation split (first seed)", fontsize=9)
    fig.tight_layout()
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.02, pad=0.02)
    return [_save(fig, folder / "mi-vs-balance_usage.png", stamp)]


def fig_amod(data: dict, folder: Path, stamp: str = "") -> list[str]:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for routing, r in data["routings"].items():
        curves = r["curves"]
        if not curves or not curves[0]:
            continue
        steps = [s for s, _ in curves[0]]
        per = [[c[i][1] for c in curves if i < len(c)] for i in range(len(steps))]
        _errorbar_points(ax, steps, per, label=f"{routing} routing")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("fine-tune step (0 = no training)")
    ax.set_ylabel("Δt vs the dense model (%)")
    ax.set_title(f"Dense → MoD at capacity {data['capacity']:g} (mean ± sd over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    return [_save(fig, folder / "amod-table3_recovery.png", stamp)]


def fig_mone(data: dict, folder: Path, stamp: str = "") -> list[str]:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    grid = [float(k) for k in data["sampled"]]
    _errorbar_points(a1, grid, [data["sampled"][k]["dt"] for k in data["sampled"]],
                     label=f"adaptive model (e_c drawn per step, {data.get('adaptive_steps', '?')} steps)")
    fixed = [float(k) for k in data["fixed_models"]]
    _errorbar_points(a1, fixed, [data["fixed_models"][k]["dt"] for k in data["fixed_models"]], linestyle="none",
                     label="trained at that e_c")
    a1.set_xlabel("effective capacity e_c")
    a1.set_ylabel("Δt vs the e_c = 1 model (%)")
    a1.legend(fontsize=7)
    a1.set_title("Quality per budget (mean ± sd over seeds)", fontsize=9)
    _errorbar_points(a2, grid, [[1e3 * v for v in data["sampled"][k]["forward_s"]] for k in data["sampled"]],
                     label="forward time")
    a2.set_xlabel("effective capacity e_c")
    a2.set_ylabel("forward time per batch (ms)")
    a3 = a2.twinx()
    a3.plot(grid, [spread(data["sampled"][k]["macs"])["mean"] / 1e6 for k in data["sampled"]], color="tab:red",
            marker="x", label="MMACs / image / task")
    a3.set_ylabel("MMACs / image / task", color="tab:red")
    a2.set_title("Forward time and MACs of the adaptive model", fontsize=9)
    fig.tight_layout()
    return [_save(fig, folder / "mone-budget_ec.png", stamp)]


def fig_pascal(data: dict, folder: Path, stamp: str = "") -> list[str]:
    """Δm per method with the seed spread (bars: mean ± sd; dots: seeds), and Δm per task per method."""
    methods = [k for k in data["methods"] if k != "stl"]
    colours = {"pascal_mtl": "tab:blue", "pascal_modsquad": "tab:orange", "pruned": "tab:red",
               "pruned_top": "tab:purple"}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 3]})
    for i, k in enumerate(methods):
        vals = [v for v in data["methods"][k]["dm"] if v is not None and math.isfinite(v)]
        s = spread(vals)
        ax.bar(i, s["mean"] if vals else 0.0, yerr=s["std"] if math.isfinite(s["std"]) else 0.0, capsize=4,
               color=colours.get(k, "tab:grey"), alpha=0.8)
        ax.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
        params = data["methods"][k].get("params")
        if params:
            ax.annotate(_big(params), (i, 0), textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(methods)), [data["methods"][k]["label"] for k in methods], rotation=20, ha="right",
                  fontsize=8)
    ax.set_ylabel("Δm vs STL (%)")
    ax.set_title("Mean Δm over the 5 tasks (mean ± sd over seeds; dots: seeds;\nbelow 0: parameters)", fontsize=9)
    tasks = data["tasks"]
    width = 0.8 / len(methods)
    for i, k in enumerate(methods):
        per = data["methods"][k]["per_task"]
        means = [_finite_mean([p.get(t) for p in per]) for t in tasks]
        ax2.bar(np.arange(len(tasks)) + (i - (len(methods) - 1) / 2) * width, means, width,
                color=colours.get(k, "tab:grey"), label=data["methods"][k]["label"])
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks(range(len(tasks)), tasks, fontsize=8)
    ax2.set_ylabel("Δ vs STL (%)")
    ax2.legend(fontsize=7)
    ax2.set_title("Δ per task (mean over seeds)", fontsize=9)
    fig.tight_layout()
    return [_save(fig, folder / "pascal-table3_dm.png", stamp)]


FIGURES = {"modsquad-table2": fig_table2, "pruning": fig_pruning, "router-finetune": fig_finetune,
           "mi-vs-balance": fig_usage, "amod-table3": fig_amod, "mone-budget": fig_mone, "pascal-table3": fig_pascal}


# ------------------------------------------------------------------------------------------------ sections
def _section_table2(d: dict) -> list[str]:
    rows = []
    for m in d["methods"].values():
        rows.append([m["label"], _big(m.get("params")), _big(m.get("macs")), _num(m.get("step_s"), "{:.3f}"),
                     _num(m.get("cpu_s"), "{:.3f}"), _num(m.get("peak_mib"), "{:.0f}"), _ms(m["dt"]),
                     ", ".join(_num(v) for v in m["dt"])])
    out = _table(["method", "params", "MACs / image / task", "s / train step", "CPU s / step", "peak MiB",
                  "Δt % (mean ± sd)", "Δt per seed"], rows)
    tasks = d["tasks"]
    head = ["task", "STL metric"] + [d["methods"][k]["label"] for k in d["methods"] if k != "stl"]
    rows = []

    for t in tasks:
        stl = [m.get(t) for m in d["methods"]["stl"]["metrics"]]
        row = [t, f"{get_task(t).primary_metric} {_ms(stl, '{:.4f}')}"]
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
    for task, t in d["tasks"].items():
        sizes = list(t["runs"][0]["table"]["router"])
        images = t["runs"][0]["images"]
        arrow = "lower" if t["lower_is_better"] else "higher"
        chance = [c for c in t.get("chance", []) if c is not None]
        apart = "" if t.get("learnable", True) else " — not learnable by STL at this scale: reported apart"
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
        rows = [[f"seed {i}", *[_num(info["metrics"].get(t), "{:.3f}") for t in tasks],
                 _num(info.get("loss_before"), "{:.4f}"), _num(info.get("loss_last"), "{:.4f}"),
                 _num(100 * info["drop"] if info.get("drop") is not None else None, "{:+.1f} %"),
                 "yes" if info.get("at_plateau") else "no"] for i, info in enumerate(dense)]
        out += ["The dense model before adaptation (its validation metric; its training loss over the 4th and the "
                "last fifth of training, and the fall between them):", ""]
        out += _table(["dense model", *[f"{t} {get_task(t).primary_metric}" for t in tasks], "loss, 4th fifth",
                       "loss, last fifth", "fall", "plateau"], rows)
    return out


def _section_mone(d: dict) -> list[str]:
    rows = []
    for k, s in d["sampled"].items():
        f = d["fixed_models"].get(k)
        rows.append([k, _ms(s["dt"]), _ms(f["dt"]) if f else "–", _big(spread(s["macs"])["mean"]),
                     _ms([1e3 * v for v in s["forward_s"]], "{:.1f}")])
    return _table(["e_c", f"Δt % adaptive model ({d.get('adaptive_steps', '?')} steps, iso-FLOPs)",
                   "Δt % model trained at e_c", "MACs / image / task", "forward ms / batch"], rows)


def _section_pascal(d: dict) -> list[str]:
    rows = []
    for m in d["methods"].values():
        ratio = f"{_ms(m['ratio'], '{:.3f}')} (largest {_ms(m['ratio_max'], '{:.3f}')})" if m.get("ratio") else "–"
        paper = _ms(m["paper_ratio"], "{:.3f}") if m.get("paper_ratio") else "–"
        rows.append([m["label"], _big(m.get("params")), ratio, paper, _big(m.get("macs")),
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


SECTIONS = {"modsquad-table2": _section_table2, "pruning": _section_pruning, "router-finetune": _section_finetune,
            "mi-vs-balance": _section_mi, "amod-table3": _section_amod, "mone-budget": _section_mone,
            "pascal-table3": _section_pascal}


def _shows(comparisons: Sequence[dict]) -> str:
    """One sentence on what the numbers show: which comparisons hold, which do not (at most 6 named per kind)."""
    if not comparisons:
        return "no comparison counts in the verdict (see the preconditions and what is reported apart)."
    groups = {"holds": "holds (by the rule above)", "within noise": "within the seed spread",
              "reversed": "reversed", "one seed": "measured on one seed only (no spread)"}
    parts = []
    for status, text in groups.items():
        labels = [c["label"] for c in comparisons if c["status"] == status]
        if labels:
            more = f"; and {len(labels) - 6} more" if len(labels) > 6 else ""
            parts.append(f"{text} ({len(labels)} of {len(comparisons)}): {'; '.join(labels[:6])}{more}")
    return ". ".join(p[0].upper() + p[1:] for p in parts) + "."


def scale_line(scale: Scale, seeds: Sequence[int]) -> str:
    return (f"scale **{scale.name}**: {len(scale.tasks)} tasks, {scale.img_size} px images, patch {scale.patch_size}, "
            f"ViT width {scale.embed_dim}, depth {scale.depth}, {scale.num_heads} heads (MoE attention "
            f"{scale.moa_top_k} of {scale.moa_experts} experts, MoE MLP {scale.moe_top_k} of {scale.moe_experts}), "
            f"{scale.steps} steps of {scale.batch} images per run, seeds {', '.join(map(str, seeds))}")


def write_report(out: Path, claims: dict[str, dict], meta: dict) -> Path:
    """Writes ``report.md``, ``results.json`` and the figures for ``claims`` (claim → its measured data).

    Args:
        out: the output folder.
        claims: claim name → the dict its measure function returned (verdicts are added here).
        meta: ``command``, ``scale`` (a `Scale`), ``scale_settings``, ``seeds``, ``data`` (root and its manifest),
            ``data_line``, ``seconds`` and ``duration`` (this invocation), ``train_seconds`` (every run's training),
            ``runs`` (total / trained / skipped this time).

    Returns:
        The path of report.md.
    """
    out = Path(out)
    figures = out / "figures"
    scale: Scale = meta["scale"]
    order = [c for c in CLAIMS if c in claims]
    for name in order:
        d = claims[name]
        d["verdict"] = verdict(d["comparisons"], d.get("preconditions", ()))
        stamp = (f"scale {scale.name} · {len(meta['seeds'])} seed{'s' if len(meta['seeds']) != 1 else ''} · "
                 f"{d.get('budget', f'{scale.steps} steps')}")
        d["figures"] = FIGURES[name](d, figures, stamp)
    lines = ["# Reproducing the papers' claims with squad", "",
             f"Made by `{meta['command']}` ({scale_line(scale, meta['seeds'])}; data: {meta['data_line']}). "
             f"This invocation took {meta['duration']}; training all {meta['runs']['total']} runs took "
             f"{format_duration(meta.get('train_seconds', 0.0))} in all (each run's time is in its reproduce.json). "
             "Every seed uses the same data.", "",
             "Metrics are on the validation split, which no run uses for any choice (fixed schedules, no early "
             "stopping). Δt is Mod-Squad's: the mean over tasks of each task's relative gain on its primary metric "
             "against the baseline, in percent, higher is better.", "",
             "## Verdicts", ""]
    lines += _table(["claim", "source", "verdict"], [[f"[{n}](#{n})", CLAIMS[n].source, f"**{claims[n]['verdict']}**"]
                                                     for n in order])
    lines += ["## How a verdict is decided", "", RULE, ""]
    for name in order:
        d = claims[name]
        c = CLAIMS[name]
        lines += [f"## {name}", "", f"*{c.source}.* **Claim:** {c.statement}", "",
                  f"Verdict: **{d['verdict']}**", ""]
        lines += [f"Measured at scale {scale.name}, {len(meta['seeds'])} seed(s), {d.get('budget', '')}.", ""]
        lines += SECTIONS[name](d)
        if d.get("preconditions"):
            lines += ["Preconditions of a fair test (one not met makes the claim inconclusive):", ""]
            lines += _table(["precondition", "detail", "status"],
                            [[p["label"], p.get("detail", ""), f"**{p['status']}**"] for p in d["preconditions"]])
        lines += ["Comparisons (the rule above):", ""] + _comparisons(d["comparisons"])
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
               "seconds": meta["seconds"], "train_seconds": meta.get("train_seconds"), "runs": meta["runs"]}
    (out / "results.json").write_text(json.dumps(_sanitize(results), indent=1) + "\n")
    return report
