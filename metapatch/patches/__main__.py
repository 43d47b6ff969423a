"""``python -m metapatch.patches [--check | --write]``: the ``INDEX`` of this package, generated from
the patch records (every patch module is imported). Without an option it is printed; ``--check``
exits 1 when ``metapatch/patches/__init__.py`` holds another one; ``--write`` puts it there."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from metapatch._framework.patch_loading import index_of_records, render_index

_BLOCK = re.compile(r"^INDEX = \{\n.*?^\}\n", re.DOTALL | re.MULTILINE)


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metapatch.patches", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 when __init__.py is out of date")
    group.add_argument("--write", action="store_true", help="rewrite the INDEX block of __init__.py")
    args = parser.parse_args(argv)
    wanted = render_index(index_of_records())
    init = Path(__file__).with_name("__init__.py")
    text = init.read_text()
    current = _BLOCK.search(text)
    if current is None:
        print(f"{init}: no INDEX block found", file=sys.stderr)
        return 2
    if args.write:
        if current.group(0) != wanted:
            init.write_text(text[:current.start()] + wanted + text[current.end():])
            print(f"{init}: INDEX updated")
        return 0
    if args.check:
        if current.group(0) != wanted:
            print(f"{init}: INDEX is out of date; run python -m metapatch.patches --write", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
