"""``metapatch`` command line. Each sub-command lives in ``metapatch/commands/<name>.py`` and
defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> exit code``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

COMMANDS = ("status", "selftest", "doctor", "diffs", "pr", "pins", "fingerprint", "survey", "run", "enable", "disable",
            "explain", "sweep")

EPILOG = """environment:
  METAPATCH_DISABLE=id1,id2|all   do not install these patches (ids as in `metapatch status`)
  METAPATCH_STRICT=1              a stale, conflict or failed patch raises instead of warning; `status` exits 1
  METAPATCH_DIFFS_ROOT=DIR        read upstream diffs from DIR (`diffs`, `pr`) instead of the source tree
  METAPATCH_AUTOLOAD=0            the start-up hooks of `run` and `enable` import nothing in this process
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="metapatch",
        description="Version-gated fixes for meta-device bugs in the Hugging Face big-model stack.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"metapatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"metapatch.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"metapatch.commands.{name}":
                raise
            continue  # a command not shipped in this build
        command = sub.add_parser(name, help=module.HELP, description=module.HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
