"""The documentation holds together: README.md and docs/*.md link only to files and headings that exist, every page
is reachable from the README, and the generated config reference is what `python tools/docs.py config-reference`
writes from the config dataclasses. (tests/test_readme.py runs the pages' commands.)"""

from __future__ import annotations

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

from tests.helpers import ROOT, run_command, tool_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code (a link written inside code is not a link)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)[^`\n]*?\1", "", text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```[^\n]*$", "", path.read_text(), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text))
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The links of ``page`` whose file or heading does not exist (web links are not followed)."""
    text = prose(page.read_text())
    bad = []
    for m in [*LINK.finditer(text), *IMAGE.finditer(text)]:
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(root)}: ({target})"
        if not dest.exists():
            bad.append(f"{where}: no file {dest}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return bad


def test_links_and_anchors_resolve():
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# B page\n## Part two\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#part-two) [gone](c.md) [bad anchor](b.md#part-three) `[code](x.md)`\n"
                    "```\n[block](y.md)\n```\n[web](https://example.org/x) [self](#a)\n# A\n")
    bad = broken_links(page, tmp_path)
    assert len(bad) == 2 and "no file" in bad[0] and "no heading #part-three" in bad[1], bad


def test_slugs_match_github():
    assert slug("Performance (`tools/bench.py`)") == "performance-toolsbenchpy"
    assert slug("Compiling (torch.compile)") == "compiling-torchcompile"
    assert slug("`model.moe` (MoEConfig)") == "modelmoe-moeconfig"
    assert slug("Preemption, interrupts and resuming anywhere") == "preemption-interrupts-and-resuming-anywhere"


def test_every_page_is_linked_from_the_readme():
    readme = prose((ROOT / "README.md").read_text())
    linked = {(ROOT / m.group("target").partition("#")[0]).resolve() for m in LINK.finditer(readme)}
    missing = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_config_reference_is_current():
    """docs/config-reference.md is what the config dataclasses generate: a key added, renamed or re-documented in
    squad/config/ without running `python tools/docs.py config-reference` fails here."""
    from squad.config.reference import PAGE, config_reference

    assert (ROOT / PAGE).read_text() == config_reference(), (
        f"{PAGE} is out of date: run `python tools/docs.py config-reference` and commit it")


def test_config_reference_lists_every_key():
    import dataclasses

    from squad.config.reference import config_reference
    from squad.config.run import RunConfig

    text = config_reference()

    def keys(cls):
        for f in dataclasses.fields(cls):
            yield f.name
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(value):
                yield from keys(type(value))

    sections = [f.default_factory() for f in dataclasses.fields(RunConfig)]
    missing = [k for section in sections for k in keys(type(section)) if f"| `{k}` |" not in text]
    assert not missing, missing
    assert all(f"### `{f.name}` (" in text for f in dataclasses.fields(RunConfig))
    assert "| `expert_parallel` | int | `1` |" in text and "#### `model.moe` (MoEConfig)" in text


def test_docs_tool_checks_the_page():
    res = run_command([sys.executable, "tools/docs.py", "config-reference", "--check"], ROOT, tool_env(), 120)
    assert res.returncode == 0 and "up to date" in res.stdout, res.stdout + res.stderr


def test_verdicts_block_is_current():
    """README.md and docs/reproduce.md quote the committed report's verdicts as `python tools/docs.py verdicts`
    generates them from reports/cpu/results.json: a report regenerated without running it fails here."""
    from squad.reproduce.summary import pages

    stale = [page for page, (now, text) in pages(ROOT).items() if now != text]
    assert not stale, f"{stale}: the verdicts block is out of date: run `python tools/docs.py verdicts` and commit it"


def test_verdicts_block_is_found_once_or_named_missing():
    import pytest

    from squad.reproduce.summary import BEGIN, END, fill

    page = f"intro\n{BEGIN}\nold\n{END}\nrest\n"
    assert fill(page, f"{BEGIN}\nnew\n{END}") == f"intro\n{BEGIN}\nnew\n{END}\nrest\n"
    with pytest.raises(ValueError, match=r"README\.md: expected one verdicts block.* found 0 begin and 0 end marks"):
        fill("no block here", "x", "README.md")
    with pytest.raises(ValueError, match="found 2 begin and 2 end marks"):
        fill(page + page, "x", "docs/reproduce.md")
    stray = f"{BEGIN}\nmy text\n{page}"  # a second begin mark: refused, the text between kept
    with pytest.raises(ValueError, match="found 2 begin and 1 end marks"):
        fill(stray, "x", "README.md")
    with pytest.raises(ValueError, match="found 1 begin and 0 end marks"):
        fill(page.replace(END, ""), "x", "README.md")


def test_docs_tool_checks_and_writes_the_verdicts(tmp_path, monkeypatch, capsys):
    """`python tools/docs.py verdicts --check` exits 1 naming a stale page, and without --check rewrites it."""
    import importlib.util
    import shutil

    for page in ("README.md", "docs/reproduce.md", "reports/cpu/results.json"):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("**too few seeds**", "**reproduced**", 1))
    spec = importlib.util.spec_from_file_location("docs_tool", ROOT / "tools" / "docs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    assert tool.main(["verdicts", "--check"]) == 1
    assert tool.main(["verdicts"]) == 0
    assert readme.read_text() == (ROOT / "README.md").read_text()
    assert tool.main(["verdicts", "--check"]) == 0
    results = tmp_path / "reports" / "cpu" / "results.json"
    for text, message in [("{not json", "not a results.json"), ("{}", "not a results.json of tools/reproduce.py")]:
        results.write_text(text)
        capsys.readouterr()
        assert tool.main(["verdicts", "--check"]) == 2
        err = capsys.readouterr().err
        assert message in err and str(results) in err, err
    results.unlink()
    assert tool.main(["verdicts"]) == 2 and readme.read_text() == (ROOT / "README.md").read_text()
