"""metapatch fingerprint"""

from __future__ import annotations

import argparse

HELP = "print the source fingerprint of module:qualname targets (for writing a patch record)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("targets", nargs="+", metavar="MODULE:QUALNAME")


def run(args: argparse.Namespace) -> int:
    import importlib

    from metapatch._framework.registry import fingerprint, resolve

    for dotted in args.targets:
        module_name, _, qualname = dotted.partition(":")
        _, _, obj = resolve(importlib.import_module(module_name), qualname)
        print(f"{dotted} {fingerprint(obj)}")
    return 0
