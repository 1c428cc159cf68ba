"""The figures of tools/reproduce.py's report (PNG, each stamped with its scale, seeds and steps).

`fig_claim` is every claim's main figure: on the left the claim's Δt curves over training steps (each method's Δt
against its reference at every validation step, mean and 95 % t-interval over seeds: `squad.reproduce.measure.
curve_band`), on the right each task's gain of the reference model over the best image-independent predictor, per
seed, with the learnability gate's threshold (`squad.reproduce.gate`). The other figures are the claims' own (Δt
bars, the pruning curve, fine-tuning curves, expert-usage maps, the A-MoD recovery, the MoNE e_c curve, PASCAL Δm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from squad.reproduce.measure import curve_band  # noqa: E402
from squad.reproduce.verdicts import spread  # noqa: E402


def big(v) -> str:
    """A count with a unit prefix (``1.26 M``), ``–`` for None."""
    if v is None:
        return "–"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= size:
            return f"{v / size:.2f} {unit}"
    return f"{v:.0f}"


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
    if not tasks:  # untestable: nothing was fine-tuned
        return []
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
                     label=f"adaptive model (e_c drawn per step, {data.get('steps', '?')} steps)")
    fixed = [float(k) for k in data["fixed_models"]]
    _errorbar_points(a1, fixed, [data["fixed_models"][k]["dt"] for k in data["fixed_models"]], linestyle="none",
                     label="trained at that e_c")
    a1.set_xlabel("effective capacity e_c")
    a1.set_ylabel("Δt vs the e_c = 1 model (%)")
    a1.legend(fontsize=7)
    a1.set_title("Quality per budget (mean ± sd over seeds; every model the same steps)", fontsize=9)
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
            ax.annotate(big(params), (i, 0), textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)
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


def claim_curves(data: dict) -> dict[str, list]:
    """A claim's Δt curves per label: ``data["curves"]``, or its methods' (``data["methods"][k]["curves"]``)."""
    if data.get("curves"):
        return dict(data["curves"])
    return {m["label"]: m["curves"] for m in (data.get("methods") or {}).values() if m.get("curves")}


def fig_claim(name: str, data: dict, folder: Path, stamp: str = "") -> list[str]:
    """The claim's main figure: its Δt curves over training steps with 95 % intervals over seeds (left), each task's
    gain of the reference model over the best image-independent predictor with the gate's threshold (right)."""
    curves = claim_curves(data)
    gate = data.get("gate")
    if not curves and not gate:
        return []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    drawn = 0
    for label, per_seed in curves.items():
        band = [b for b in curve_band(per_seed) if math.isfinite(b["mean"])]
        if not band:
            continue
        drawn += 1
        steps = [b["step"] for b in band]
        line = ax.plot(steps, [b["mean"] for b in band], marker="o", ms=3, label=label)[0]
        lo = [b["lower"] if math.isfinite(b["lower"]) else b["mean"] for b in band]
        hi = [b["upper"] if math.isfinite(b["upper"]) else b["mean"] for b in band]
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"{data.get('curve_label', 'Δt vs STL')} (%)")
    counted = ", ".join(gate["learnable"]) if gate else "all tasks"
    ax.set_title(f"{data.get('curve_label', 'Δt vs STL')} over training (mean, 95 % interval over seeds)\n"
                 f"over the learnable tasks: {counted or 'none'}", fontsize=8)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no learnable task: no Δt", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    if gate:
        tasks = list(gate["tasks"])
        for i, t in enumerate(tasks):
            row = gate["tasks"][t]
            vals = [g for g in row["gain"] if g is not None and math.isfinite(g)]
            ax2.bar(i, spread(vals)["mean"] if vals else 0.0, color="tab:green" if row["learnable"] else "tab:grey",
                    alpha=0.8)
            ax2.scatter([i] * len(vals), vals, color="black", s=12, zorder=3)
        ax2.axhline(gate["threshold"], color="tab:red", ls="--", lw=0.8, label=f"gate: {gate['threshold']:g} %")
        ax2.axhline(0, color="grey", lw=0.8)
        ax2.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", fontsize=7)
        ax2.set_yscale("symlog", linthresh=10)  # gains run from a few % (the gate) to 1,000 % (classes vs chance)
        ax2.set_ylabel("gain over the best image-independent predictor (%)")
        ax2.set_title("reference model vs image-independent predictor\n(green: counted in Δt; dots: seeds)",
                      fontsize=8)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    return [_save(fig, folder / f"{name}_curves.png", stamp)]


FIGURES = {"modsquad-table2": fig_table2, "table2-curve": lambda data, folder, stamp="": [],  # its curves: fig_claim
           "pruning": fig_pruning, "router-finetune": fig_finetune, "mi-vs-balance": fig_usage, "amod-table3": fig_amod,
           "mone-budget": fig_mone, "pascal-table3": fig_pascal}
