"""The verdicts block that README.md and docs/reproduce.md quote: each claim's verdict and its parts, generated from a
report's ``results.json`` (``python tools/docs.py verdicts``; tests/test_docs.py checks the pages against it).

A report made by the current code (its ``results.json`` has a ``tolerance`` entry) is quoted as it judged itself. An
older report, made before claims were split into parts, is quoted through its interim re-judgement
(`squad.reproduce.rejudge`): its per-seed numbers under the current rule, labelled so, its old verdicts withdrawn.
"""

from __future__ import annotations

import re
from pathlib import Path

from squad.reproduce.rejudge import rejudge
from squad.reproduce.report import part_cell, read_results
from squad.reproduce.stats import MIN_SEEDS
from squad.reproduce.verdicts import parts_of

RESULTS = "reports/cpu/results.json"  # the report the pages quote
PAGES = ("README.md", "docs/reproduce.md")
BEGIN = (f"<!-- verdicts: generated from {RESULTS} by `python tools/docs.py verdicts`; edit nothing up to the end "
         "mark -->")
END = "<!-- end of verdicts -->"


def _cells(parts: list[dict]) -> str:
    return "<br>".join(part_cell(c) for c in parts) or "–"


def _current(results: dict, source: str) -> list[str]:
    seeds = len(results.get("seeds", []))
    tol = (results.get("tolerance") or {}).get("tolerance", {}).get("Δt")
    lines = [f"Made by `{results['command']}`: {seeds} seed{'s' if seeds != 1 else ''}, scale {results['scale']}; "
             "the cross-machine tolerance "
             + (f"is {tol:.2f} Δt points (a part inside it is no finding)." if tol is not None else "was not measured.")
             + " Each part: mean paired difference d (> 0: as the paper says) [its own one-sided 95 % bounds] — "
             "status, Holm-corrected over the claim's parts (so a part whose own bounds exclude 0 can still be within "
             "noise); a claim is reproduced only when every part holds (the rule and every comparison: "
             f"`{Path(source).parent}/report.md`).", "",
             "| claim | verdict | parts: mean d [95 % bounds] — status |", "| --- | --- | --- |"]
    for name, c in results["claims"].items():
        verdict = f"**{c['verdict']}**"
        if c["verdict"] == "too few seeds" and c.get("provisional"):
            verdict += f" (< {MIN_SEEDS} seeds; the parts give: {c['provisional']})"
        parts = _cells(parts_of(c.get("comparisons", []))) if not c.get("untestable") else \
            f"untestable: {c['untestable']}"
        lines.append(f"| {name} | {verdict} | {parts} |")
    return lines


def _interim(results: dict, source: str) -> list[str]:
    claims = rejudge(results)
    seeds = ", ".join(map(str, results.get("seeds", [])))
    lines = [f"`{source}` was made before claims were split into parts (seeds {seeds}); its verdicts are withdrawn."
             f" Its per-seed numbers judged again under the current rule (`python tools/reproduce.py all --rejudge "
             f"{source} --out {Path(source).parent}`; nothing trained again) give no verdict: a verdict needs "
             f"{MIN_SEEDS} seeds. Each part: mean paired difference d (> 0: as the paper says) [its own one-sided "
             "95 % bounds] — status, Holm-corrected over the claim's parts (so a part whose own bounds exclude 0 can "
             "still be within noise).", "",
             "| claim | verdict (current rule) | the parts give | parts: mean d [95 % bounds] — status | old verdict "
             "(withdrawn) |", "| --- | --- | --- | --- | --- |"]
    for name, c in claims.items():
        parts = _cells(parts_of(c["comparisons"])) if not c.get("untestable") else f"not judged: {c['untestable']}"
        lines.append(f"| {name} | **{c['verdict']}** | {c['parts_give']} | {parts} | {c['old_verdict']} |")
    return lines


def verdict_block(results: dict, source: str = RESULTS) -> str:
    """The block between `BEGIN` and `END` (both included) for a report's loaded ``results.json``."""
    body = _current(results, source) if "tolerance" in results else _interim(results, source)
    return "\n".join([BEGIN, *body, END])


def fill(text: str, block: str, page: str = "the page") -> str:
    """``text`` with its verdicts block replaced by ``block``.

    Raises:
        ValueError: the page has no block, or more than one (names the page).
    """
    begin = BEGIN.split(";")[0]
    starts, ends = text.count(begin), text.count(END)
    if starts != 1 or ends != 1 or text.index(begin) > text.index(END):
        raise ValueError(f"{page}: expected one verdicts block, its begin mark ({begin} ...) before its end mark "
                         f"({END}); found {starts} begin and {ends} end marks")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(END), re.S)
    return pattern.sub(lambda _: block, text)


def pages(root: Path, results_file: Path | None = None) -> dict[str, tuple[str, str]]:
    """``{page: (its text now, its text with the block regenerated)}`` for every page of `PAGES` under ``root``.

    Raises:
        FileNotFoundError, ValueError: the report is missing or is not a results.json (`read_results`); a page
            without exactly one block (`fill`).
    """
    results_file = root / RESULTS if results_file is None else Path(results_file)
    results = read_results(results_file)
    if "command" not in results:
        raise ValueError(f"{results_file}: not a results.json of tools/reproduce.py (no command)")
    block = verdict_block(results, RESULTS)
    out = {}
    for page in PAGES:
        text = (root / page).read_text()
        out[page] = (text, fill(text, block, page))
    return out
