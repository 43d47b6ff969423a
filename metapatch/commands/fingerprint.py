"""metapatch fingerprint"""

from __future__ import annotations

import argparse

from . import UsageError

HELP = "print the source fingerprint of module:qualname targets (for writing a patch record)"

EPILOG = """example:
  metapatch fingerprint transformers.modeling_utils:ModuleUtilsMixin.device
exit code: 0, or 2 when a target is not MODULE:QUALNAME, its module does not import or it has no such
attribute, or its source cannot be read.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("targets", nargs="+", metavar="MODULE:QUALNAME")


def target_object(dotted: str):
    """The object ``module:qualname`` names, or UsageError saying what is wrong with it."""
    import importlib

    from metapatch._registry import resolve

    module_name, colon, qualname = dotted.partition(":")
    if not colon or not module_name or not qualname:
        raise UsageError(f"{dotted!r} is not MODULE:QUALNAME (e.g. transformers.modeling_utils:ModuleUtilsMixin.device)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{dotted}: cannot import {module_name} ({exc})") from None
    try:
        return resolve(module, qualname)[2]
    except AttributeError as exc:
        raise UsageError(f"{dotted}: {module_name} has no {qualname} ({exc})") from None


def run(args: argparse.Namespace) -> int:
    from metapatch._registry import fingerprint

    for dotted in args.targets:
        obj = target_object(dotted)
        try:
            value = fingerprint(obj)
        except (OSError, TypeError, SyntaxError) as exc:
            raise UsageError(f"{dotted}: cannot read its source ({exc})") from None
        print(f"{dotted} {value}")
    return 0
