#!/usr/bin/env python
"""The documentation's generated pages.

    python tools/docs.py config-reference           # writes docs/config-reference.md from squad/config/
    python tools/docs.py config-reference --check   # exit 1 when the committed page is out of date
    python tools/docs.py verdicts                   # the verdicts block of README.md and docs/reproduce.md
    python tools/docs.py verdicts --check

The config reference comes from `squad.config.reference.config_reference` (the config dataclasses' fields, defaults
and comments); the verdicts block from the committed reproduction report, reports/cpu/results.json
(`squad.reproduce.summary`): each claim's verdict and its parts, the estimate and interval of each.
tests/test_docs.py runs both checks.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", choices=["config-reference", "verdicts"])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    try:
        if args.page == "verdicts":
            from squad.reproduce.summary import pages

            texts = pages(ROOT)
        else:
            from squad.config.reference import PAGE, config_reference

            texts = {PAGE: ((ROOT / PAGE).read_text() if (ROOT / PAGE).is_file() else None, config_reference())}
    except ModuleNotFoundError as e:
        print(f"error: cannot import squad with {sys.executable} ({e}); install it first (make test)", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = [page for page, (now, text) in texts.items() if now != text]
    if args.check:
        for page in stale:
            print(f"{page} is out of date: run `python tools/docs.py {args.page}`", file=sys.stderr)
        if not stale:
            print(f"{', '.join(texts)}: up to date")
        return 1 if stale else 0
    for page, (_, text) in texts.items():
        (ROOT / page).write_text(text)
        print(f"wrote {page} ({len(text.splitlines())} lines)" if page in stale else f"{page}: unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
