#!/usr/bin/env python
"""The documentation's generated pages.

    python tools/docs.py config-reference           # writes docs/config-reference.md from squad/config/
    python tools/docs.py config-reference --check   # exit 1 when the committed page is out of date

The page's text comes from `squad.config.reference.config_reference` (the config dataclasses' fields, defaults and
comments); tests/test_docs.py runs the same check.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", choices=["config-reference"])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the page is out of date")
    args = parser.parse_args(argv)
    try:
        from squad.config.reference import PAGE, config_reference
    except ModuleNotFoundError as e:
        print(f"error: cannot import squad with {sys.executable} ({e}); install it first (make test)", file=sys.stderr)
        return 2
    path, text = ROOT / PAGE, config_reference()
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{PAGE} is out of date: run `python tools/docs.py config-reference`", file=sys.stderr)
            return 1
        print(f"{PAGE} is up to date")
        return 0
    path.write_text(text)
    print(f"wrote {PAGE} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
