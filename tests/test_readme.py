"""Every command in README.md and the pages of docs/ runs, as written, at tiny sizes.

The pages (`PAGES`: README.md, then docs/*.md in reading order) are parsed when the tests are collected, so a command
added to one is run here without any change to this file — or, when this file cannot tell how to run it, fails
`test_every_readme_command_is_known` until it is taught. A page of docs/ missing from `PAGES` fails
`test_every_page_is_walked`.

What counts as a command:

- every line of a fenced block whose lines start with a program (`PROGRAMS`: ``python``, ``deepspeed``,
  ``torchrun``, ``make``, ``squad-*``, ...), ``\\``-continued lines joined, ``#`` comments dropped (a block of file
  names, such as the Layout section, is not a command block; nor is a SLURM batch script, ``#!`` with ``#SBATCH``
  lines: tests/test_preemption.py runs it with a stand-in ``scontrol``);
- every ``python`` fenced block: one script;
- inline code (`` `...` ``) that starts with ``python tools/``, ``deepspeed``, ``torchrun``, ``make``, or
  ``squad-<tool>`` followed by arguments; and inline ``squad.<function>(...)`` calls (run after the python block,
  with the names in `GIVEN_NAMES`).

How a command is run (the only changes, all here):

- in one scratch folder, in the order of `PAGES` and of the lines of each page (later commands use what earlier ones
  wrote: ``data/synthetic``, ``runs/demo``, ``depth.pt``), with ``tools/`` and ``configs/`` linked from the checkout;
  ``python`` is this interpreter, ``deepspeed``/``torchrun``/``accelerate``/``squad-*`` the virtualenv's, on CPU
  DeepSpeed (`tests.helpers.tool_env`); ``python tools/...`` and the python blocks are forked from an interpreter
  that has imported torch, DeepSpeed and squad once (`tests.helpers.run_command`); a command the pages repeat
  word for word (its optional ``[ ]`` arguments aside: the README's front page repeats the pages' commands) runs once;
- sizes (`SIZES`): ``make_data`` renders/packs 32 images of 32 px; ``--num-heads`` is the small ViT's 4;
  ``torchrun --nproc_per_node`` runs 2 processes;
  launchers get a free ``--master_port`` (accelerate: ``--main_process_port``); the first ``deepspeed`` command runs
  under the real launcher and the later ones' ranks are forked from a preloaded interpreter (`tests.rank_launcher`:
  the environment the launcher gives each rank, without four interpreters' imports; torchrun and accelerate run
  once each, under their own launchers); a training gets `TRAIN_SETS`
  appended as ``--set`` overrides (the `tests.helpers.TINY` widths, 2 steps of 4 images, no workers, 1 validation
  batch); finetune_router gets ``--steps 2``, upcycle the TINY widths and bench ``--quick`` (`TOOL_ARGS`);
- paths (`PATHS`): ``/data/taskonomy`` is a random Taskonomy tree (`squad.data.write_random_tree`, its split CSV also
  under the names ``tiny`` and ``full``), ``/data/taskonomy_shards`` a scratch folder, ``/data/PASCAL_MT`` and
  ``/data/NYUD_MT`` small synthetic trees in those layouts; ``deepspeed --num_gpus N`` runs at most 2 ranks; a
  training config whose ``data.root`` is one of them gets it substituted; ``vit_small.pth`` is a small timm ViT
  state dict (32 px, the TINY widths);
- optional arguments written in ``[ ]`` are left out; ``...`` and ``<name>`` are placeholders, not commands;
- the python block gets ``images`` (a batch at the model's 64 px, `GIVEN_NAMES`); a line ``expr  # literal`` asserts
  that ``expr`` equals the literal.

`SKIPPED` lists the commands that cannot run here, each with its reason.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from squad.distributed import free_port
from tests.helpers import RANK_LAUNCHER, ROOT, TINY, run_command, tool_env

README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The pages whose commands run, in the order they run (a page uses what the pages before it made: data/synthetic,
# runs/demo, depth.pt, ...). config-reference.md is generated (`python tools/docs.py config-reference`).
PAGES = [README, *(DOCS / f"{name}.md" for name in (
    "getting-started", "data", "training", "operating", "scaling", "model", "tools", "gpu", "reproduce", "design",
    "config-reference"))]
BIN = Path(sys.executable).parent
TIMEOUT = 300

# The first word of a shell line in a fenced block (a block with none of these is a listing, not commands).
PROGRAMS = ("python", "python3", "deepspeed", "torchrun", "accelerate", "make", "pip", "bash", "sh", "export", "cd",
            "git", "curl", "wget", "conda", "docker", "TRITON_INTERPRET=", "squad-")
INLINE = re.compile(r"^(python3? tools/\S+\.py|(deepspeed|torchrun|accelerate|make|squad-[a-z-]+) \S)")

# Commands that cannot run here (matched at the start of the command), each with its reason.
SKIPPED = {
    "make demo": "the whole demo: creates .venv and trains for ~5 minutes; its steps are the commands below",
    "make test@": "runs this test suite",
    "make test-fast": "runs the quick part of this test suite",
    "make lint-imports": "`make test` runs it before the tests (CI: .ci/run)",
    "make lint@": "ruff over the whole tree: tests/test_docs.py and CI run ruff",
    "make bench@": "the full benchmark (`python tools/bench.py`); test_bench.py runs it at --quick sizes",
    "make clean-venv": "removes this .venv",
    "python tools/docs.py": "rewrites the generated pages in the checkout; tests/test_docs.py checks them",
    "deepspeed --hostfile hosts --num_nodes 4 --num_gpus 8": "needs 4 nodes with 8 GPUs each; multi-node launching "
    "runs on loopback in test_train.py::test_multi_node_loopback_matches_one_node",
    "python tools/bench.py@": "the full benchmark runs for many minutes; test_bench.py runs it at --quick sizes",
    "python tools/reproduce.py all --scale small": "the small-scale reproduction trains 70+ models (hours); "
    "test_reproduce.py runs every claim at --scale tiny, and the tiny command below runs here",
    "python tools/reproduce.py modsquad-table2 --scale gpu": "the gpu scale needs a GPU (minutes there, many hours "
    "on a CPU); test_reproduce.py checks its plan and runs --parallel at tiny scale",
    "python tools/reproduce.py modsquad-table2 table2-curve pruning mi-vs-balance amod-table3 mone-budget --scale cpu "
    "--out runs/repro-cpu --report": "the converged CPU runs train 175 models for hours (its --dry-run below prints "
    "the plan and runs here); test_reproduce.py runs every claim at --scale tiny",
    "python tools/reproduce.py modsquad-table2 --scale cpu --out /tmp/rerun --rerun": "renders the cpu scale's data "
    "and trains a 1,000-step run (many minutes); test_reproduce.py runs --rerun at --scale tiny",
    "make gpu-check": "needs a CUDA GPU; test_gpu_check.py runs its refusal, stage runner and report on the CPU",
    "python3 tools/gpu_check.py": "needs a CUDA GPU (the same as make gpu-check)",
    "python tools/gpu_check.py --rejoin": "test_gpu_check.py runs it on the committed H200 report",
}

SIZES = {"--n": "32", "--image-size": "32", "--nproc_per_node": "2", "--num-heads": "4"}  # vit_small.pth: 4 heads
TRAIN_SETS = [*TINY, "model.head_dim=null", "optim.steps=2", "optim.batch_per_rank=4", "data.workers=0",
              "data.val_batches=1", "train.progress=false"]
TOOL_ARGS = {"finetune_router": ["--steps", "2"], "bench": ["--quick"],
             "upcycle": [a for s in [*TINY, "model.head_dim=null"] for a in ("--set", s)]}  # the TINY model's widths
PATHS = {"/data/taskonomy_shards": "taskonomy_shards", "/data/taskonomy": "taskonomy", "/data/PASCAL_MT": "PASCAL_MT",
         "/data/NYUD_MT": "NYUD_MT"}
MAX_RANKS = 2  # ``deepspeed --num_gpus 8`` runs 2 CPU ranks here
GIVEN_NAMES = "import torch\nimages = torch.randn(2, 3, 64, 64)\n"


@dataclass
class Command:
    kind: str  # "shell", "python" or "inline-python"
    text: str  # as written in the page
    line: int
    page: str = "README.md"  # relative to the checkout

    @property
    def id(self) -> str:
        words = re.sub(r"[^\w./-]+", " ", self.text).split()
        return f"{Path(self.page).stem}:L{self.line}-{'-'.join(words[:4])}"[:70]

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    @property
    def key(self) -> str:
        """What makes two commands the same run: the text without its optional ``[ ]`` arguments."""
        return " ".join(re.sub(r"\s\[[^\]]*\]", "", self.text).split()) if self.kind == "shell" else self.text


def readme_commands(text: str | None = None, page: str = "README.md") -> list[Command]:
    """The commands of one page (``text``), or of every page of `PAGES` in order; see the module docstring for what
    counts."""
    if text is None:
        return [c for p in PAGES for c in readme_commands(p.read_text(), str(p.relative_to(ROOT)))]
    commands: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", lines[i]):
                span = span.strip()
                if "..." in span or "<" in span:
                    continue
                if INLINE.match(span):
                    commands.append(Command("shell", span, i + 1, page))
                elif re.match(r"^squad\.[\w.]+\(.*\)$", span) and _parses(span):
                    commands.append(Command("inline-python", span, i + 1, page))
            i += 1
            continue
        lang, start, body = fence.group(1), i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang == "python":
            commands.append(Command("python", "\n".join(body), start + 1, page))
        elif body and body[0].startswith("#!") and any(ln.startswith("#SBATCH") for ln in body):
            continue  # a SLURM batch script: tests/test_preemption.py runs it
        elif lang in ("", "bash", "sh", "shell", "console"):
            joined, at = "", None
            shell = [(n, ln) for n, ln in enumerate(body) if ln.strip().startswith(PROGRAMS)]
            if not shell:
                continue  # a listing (file names), not commands
            for n, ln in enumerate(body):
                stripped = _strip_comment(ln)
                if not stripped.strip() and not joined:
                    continue
                at = at if joined else start + 1 + n
                if stripped.rstrip().endswith("\\"):
                    joined += stripped.rstrip()[:-1] + " "
                    continue
                joined += stripped
                if joined.strip():
                    commands.append(Command("shell", " ".join(joined.split()), at, page))
                joined = ""
    return commands


def _parses(code: str) -> bool:
    try:
        ast.parse(code, mode="eval")
    except SyntaxError:
        return False
    return True


def _strip_comment(line: str) -> str:
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0]


def _skip_reason(cmd: Command) -> str | None:
    for start, reason in SKIPPED.items():
        if start.endswith("@") and cmd.text == start[:-1]:
            return reason
        if not start.endswith("@") and cmd.text.startswith(start):
            return reason
    return None


def _tool_of(words: list[str]) -> str | None:
    """The squad tool a command runs (``train`` for ``python tools/train.py`` or ``squad-train``)."""
    for w in words:
        if w.startswith("tools/") and w.endswith(".py"):
            return Path(w).stem
        if w.startswith("squad-"):
            return w.removeprefix("squad-").replace("-", "_")
    return None



def to_argv(text: str, ws: Path, forked: bool = False) -> list[str]:
    """A README shell command as the argv run here (the substitutions of the module docstring); with ``forked`` a
    ``deepspeed --num_gpus N [--master_port P] SCRIPT ...`` runs its ranks through `tests.rank_launcher`."""
    text = re.sub(r"\s\[[^\]]*\]", "", text)  # optional arguments
    for src, dst in PATHS.items():
        text = text.replace(src, str(ws / dst))
    words = shlex.split(text)
    program = words[0]
    launchers = ("deepspeed", "torchrun", "accelerate")
    if program not in ("python", "python3", *launchers) and not program.startswith("squad-"):
        raise LookupError(f"tests/test_readme.py does not know how to run {program!r}")
    words[0] = sys.executable if program.startswith("python") else str(BIN / program)
    for n in range(1, len(words) - 1):
        if words[n] in SIZES:
            words[n + 1] = SIZES[words[n]]
        if words[n] == "--num_gpus" and int(words[n + 1]) > MAX_RANKS:
            words[n + 1] = str(MAX_RANKS)
    if program in ("deepspeed", "torchrun") and "--master_port" not in words:
        words[1:1] = ["--master_port", str(free_port())]
    if program == "accelerate" and "--main_process_port" not in words:
        words[2:2] = ["--main_process_port", str(free_port())]
    tool = _tool_of(words)
    if tool is None:
        raise LookupError(f"tests/test_readme.py does not know which squad tool {text!r} runs")
    if tool == "train":
        sets = list(TRAIN_SETS)
        config = words[words.index("--config") + 1] if "--config" in words else None
        if config:
            import yaml

            root = (yaml.safe_load((ws / config).read_text()) or {}).get("data", {}).get("root")
            if root in PATHS:
                sets += [f"data.root={ws / PATHS[root]}", "data.resize=null"]
        words += [a for s in sets for a in ("--set", s)]
    words += TOOL_ARGS.get(tool, [])
    if forked and program == "deepspeed":
        script = next(n for n, w in enumerate(words) if w.endswith(".py"))
        flags = dict(zip(words[1:script:2], words[2:script:2], strict=True)) if script % 2 else {}
        if set(flags) == {"--num_gpus", "--master_port"}:  # no other launcher option
            words = [sys.executable, RANK_LAUNCHER, "--num_gpus", flags["--num_gpus"], "--master_port",
                     flags["--master_port"], *words[script:]]
    return words


def _run(argv: list[str], cwd: Path) -> tuple[int | str, str]:
    try:
        proc = run_command(argv, cwd, tool_env(), TIMEOUT, code_any_imports=True)
    except subprocess.TimeoutExpired as e:
        return "timeout", f"{e.stdout or ''}{e.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def python_script(code: str) -> str:
    """The python block with its ``expr  # literal`` lines turned into assertions."""
    out = []
    for line in code.splitlines():
        m = re.match(r"^(?P<expr>[^#=]+?)\s+#\s*(?P<lit>.+)$", line)
        if m:
            try:
                literal = ast.literal_eval(m["lit"].strip())
                ast.parse(m["expr"], mode="eval")
            except (ValueError, SyntaxError):
                pass
            else:
                line = f"assert ({m['expr']}) == {literal!r}, ({m['expr']!r}, {m['expr']})"
        out.append(line)
    return "\n".join(out)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A scratch folder a new user's checkout would look like: tools/ and configs/ and the substituted paths."""
    import timm
    import torch

    from squad.data.offline.random_tree import write_random_tree
    from squad.data.synthetic.nyud import render_nyud
    from squad.data.synthetic.pascal import render_pascal

    ws = tmp_path_factory.mktemp("readme")
    for name in ("tools", "configs"):
        (ws / name).symlink_to(ROOT / name)
    (ws / "reports" / "cpu").mkdir(parents=True)  # `--rejudge reports/cpu/results.json` reads the committed report's
    shutil.copy(ROOT / "reports" / "cpu" / "results.json", ws / "reports" / "cpu")
    tree = write_random_tree(ws / PATHS["/data/taskonomy"], n=16, size=32, buildings=2)
    csv = next(tree.glob("train_val_test_*.csv"))
    for split in ("tiny", "full"):
        shutil.copy(csv, tree / f"train_val_test_{split}.csv")
    render_pascal(ws / PATHS["/data/PASCAL_MT"], n=32, image_size=32, workers=1)
    render_nyud(ws / PATHS["/data/NYUD_MT"], n=32, image_size=32, workers=1)
    torch.manual_seed(0)
    # a ViT at the TINY widths (timm's ViT-S layout), so tools/upcycle.py can turn it into the TINY Mod-Squad
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
                            depth=4, num_heads=4, num_classes=0)
    torch.save(vit.state_dict(), ws / "vit_small.pth")
    return ws


@pytest.fixture(scope="module")
def walkthrough(workspace) -> dict[tuple[str, int], tuple[int | str, str]]:
    """Runs every command of `PAGES` in order in the workspace; ``{(page, line): (exit status, output)}``."""
    results: dict[tuple[str, int], tuple[int | str, str]] = {}
    done: dict[str, tuple[int | str, str]] = {}  # a command the pages give twice (`Command.key`) runs once
    done_python = False
    launched = False  # a deepspeed command has run under the real launcher
    for cmd in COMMANDS:  # as collected (a page edited while the tests run changes nothing here)
        if _skip_reason(cmd):
            continue
        at = (cmd.page, cmd.line)
        if cmd.key in done:
            results[at] = done[cmd.key]  # the same command on the same files: its first run's result
            continue
        if cmd.kind == "python":
            script = GIVEN_NAMES + python_script(cmd.text)
            results[at] = _run([sys.executable, "-c", script], workspace)
            done_python = True
        elif cmd.kind == "inline-python":
            script = (GIVEN_NAMES + "import squad, timm\n"
                      "model = squad.load('runs/demo')\npath = 'runs/demo/model.pt'\n"
                      "timm_vit = timm.create_model('vit_small_patch16_224', pretrained=False, img_size=32, "
                      "patch_size=8)\n" + f"print({cmd.text})\n")
            results[at] = _run([sys.executable, "-c", script], workspace)
        else:
            try:
                argv = to_argv(cmd.text, workspace, forked=launched)
            except LookupError as e:
                results[at] = ("unknown", str(e))
                continue
            launched = launched or Path(argv[0]).name == "deepspeed"
            results[at] = _run(argv, workspace)
        done[cmd.key] = results[at]
    assert done_python or not any(c.kind == "python" for c in COMMANDS)
    return results


COMMANDS = readme_commands()


def test_readme_has_commands():
    kinds = {c.kind for c in COMMANDS}
    assert {"shell", "python"} <= kinds and len(COMMANDS) > 10, [c.text for c in COMMANDS]


def test_every_page_is_walked():
    """Every page of docs/ is in `PAGES` (its commands run), and every page of `PAGES` exists."""
    assert sorted(DOCS.glob("*.md")) == sorted(PAGES[1:]), "docs/*.md and tests/test_readme.py's PAGES differ"


def test_every_readme_command_is_known(workspace):
    unknown = []
    for cmd in COMMANDS:
        if cmd.kind != "shell" or _skip_reason(cmd):
            continue
        try:
            to_argv(cmd.text, workspace)
        except LookupError as e:
            unknown.append(f"{cmd.where}: {cmd.text}: {e}")
    assert not unknown, "\n".join(unknown)


def test_skip_list_is_current():
    """Every skipped command is still in a page (the list stays short and honest)."""
    for start in SKIPPED:
        assert any(_skip_reason(c) == SKIPPED[start] for c in COMMANDS), f"{start!r} is in none of the pages"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{n:02d}-{c.id}" for n, c in enumerate(COMMANDS)])
def test_readme_command(cmd, walkthrough):
    reason = _skip_reason(cmd)
    if reason:
        pytest.skip(reason)
    rc, out = walkthrough[cmd.page, cmd.line]
    assert rc == 0, f"{cmd.where}: {textwrap.shorten(cmd.text, 300)}\nexit {rc}\n{out[-4000:]}"


def test_parser_reads_blocks_inline_code_and_continuations():
    text = textwrap.dedent("""\
        Run `python tools/bench.py --profile` or `squad-train` (a name), `TRITON_INTERPRET=1 python ...`.
        ```
        python tools/extract.py --checkpoint runs/demo \\
            --task depth   # a comment
        [--baseline b.json]
        ```
        ```
        squad/io.py   saving and loading
        ```
        ```python
        x = 1
        ```
        Then `squad.load("runs/demo")`.
        """)
    cmds = readme_commands(text)
    assert [(c.kind, c.text) for c in cmds] == [
        ("shell", "python tools/bench.py --profile"),
        ("shell", "python tools/extract.py --checkpoint runs/demo --task depth"),
        ("shell", "[--baseline b.json]"),
        ("python", "x = 1"),
        ("inline-python", 'squad.load("runs/demo")'),
    ]
    assert python_script("squad.list_models('*')   # ['a']") == (
        "assert (squad.list_models('*')) == ['a'], (\"squad.list_models('*')\", squad.list_models('*'))")
