"""``metapatch`` command line. Each sub-command lives in ``metapatch/commands/<name>.py`` and
defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> exit code``.

Every command answers bad input with one line on stderr and exit code 2, never a traceback: a
command raises :class:`metapatch.commands.UsageError` (or lets an ``OSError`` about a path the user
gave escape), and :func:`main` prints it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

COMMANDS = ("status", "selftest", "doctor", "diffs", "pr", "pins", "fingerprint", "survey", "run", "enable", "disable",
            "explain", "sweep", "scaffold")

EPILOG = """exit codes (every command):
  0    ok
  1    problems found, not fixed, or nothing matched (each command's --help says which)
  2    bad usage or input: one line on stderr names it
  3    metapatch itself failed (one line; METAPATCH_DEBUG=1 shows the traceback)
  141  the reader of the output went away (e.g. `metapatch pins | head -1`)

environment:
  METAPATCH_DISABLE=id1,id2|all   do not install these patches (ids as in `metapatch status`)
  METAPATCH_STRICT=1              a stale, conflict or failed patch raises instead of warning; `status` exits 1
  METAPATCH_DEBUG=1               at exit, print to stderr which patches applied and how often each one's
                                  code ran (see `metapatch run --report`); tracebacks of metapatch's own errors
  METAPATCH_DIFFS_ROOT=DIR        read upstream diffs from DIR (`diffs`, `pr`) instead of the source tree
  METAPATCH_SELFTEST_FORK=0       selftest: a fresh interpreter per run instead of a fork of a warm parent
  METAPATCH_SELFTEST_PRELOAD=0    selftest: the warm parents import torch only
  METAPATCH_SELFTEST_DEVICE=cpu|cuda|cuda:N
                                  selftest: the execution device (default: cuda:0 where CUDA is present)
  METAPATCH_AUTOLOAD=0            the start-up hooks of `run` and `enable` import nothing in this process
"""

# 128 + SIGPIPE: what a shell reports for a writer whose reader closed the pipe.
EXIT_BROKEN_PIPE = 141


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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _path_error(exc: OSError) -> str:
    """``nope.txt: no such file or directory`` for an OSError about a path."""
    reason = (exc.strerror or _one_line(exc)).lower() if exc.strerror else _one_line(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def main(argv: Optional[List[str]] = None) -> int:
    from .commands import UsageError, quiet_upstream_import_noise

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    name = f"metapatch {args.command}"
    quiet_upstream_import_noise()
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # here, not at interpreter exit: a closed pipe is answered below
        return code
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.filename is None:
            return _internal_error(name, exc)
        print(f"{name}: {_path_error(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line for the user, the traceback on request
        return _internal_error(name, exc)


def _internal_error(name: str, exc: BaseException) -> int:
    if os.environ.get("METAPATCH_DEBUG", "") not in ("", "0"):
        import traceback

        traceback.print_exc()
    print(f"{name}: failed: {type(exc).__name__}: {_one_line(exc)[:500]} (METAPATCH_DEBUG=1 shows the traceback)",
          file=sys.stderr)
    return 3


def _drop_stdout() -> None:
    """The reader went away: whatever is still buffered cannot be written, and Python would report
    that at exit with a traceback of its own. Point stdout at /dev/null instead."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
