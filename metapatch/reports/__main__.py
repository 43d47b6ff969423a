"""``python -m metapatch.reports [--write-docs PATH | --check-docs PATH]``"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from . import readme_sentence, render_docs

DEFAULT_DOCS = Path(__file__).resolve().parents[2] / "docs" / "reports.md"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metapatch.reports", description=__doc__)
    parser.add_argument("--write-docs", nargs="?", const=str(DEFAULT_DOCS), metavar="PATH")
    parser.add_argument("--check-docs", nargs="?", const=str(DEFAULT_DOCS), metavar="PATH")
    args = parser.parse_args(argv)
    text = render_docs()
    if args.write_docs:
        Path(args.write_docs).write_text(text)
        print(f"wrote {args.write_docs} ({readme_sentence()})")
        return 0
    if args.check_docs:
        path = Path(args.check_docs)
        current = path.read_text() if path.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                   str(path), "generated"))
        return 1
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
