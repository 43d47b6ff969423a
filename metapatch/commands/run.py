"""``metapatch run``: start a program you do not edit with every patch active in it and in every
Python process it starts (``accelerate launch``, ``torchrun``, a converter script).

The program's environment gets metapatch's start-up folder first on ``PYTHONPATH``; its
``sitecustomize`` imports metapatch in each Python interpreter of the process tree and then runs
the user's own ``sitecustomize``. metapatch then *replaces* itself with the program (``exec``): same
process id, so exit code, signals, stdin/stdout/stderr and argv are the program's own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional

HELP = "run a program (script.py, -m module, or any command) with metapatch active in it and its Python children"

EPILOG = """examples:
  metapatch run train.py --epochs 1
  metapatch run -m my_package.cli --flag
  metapatch run accelerate launch --cpu train.py
  metapatch run -- python convert_hf_to_gguf.py ./bitnet --outtype f32
  metapatch run --report train.py      which patches applied and ran, printed at exit

A PROGRAM ending in .py is run with this interpreter; anything else is looked up on PATH (console
scripts, python, torchrun). Children started with `python -E` or `-I` ignore PYTHONPATH and run
without metapatch. METAPATCH_DISABLE / METAPATCH_STRICT pass through to every process as usual.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--report", action="store_true",
                        help="at exit, each Python process prints to stderr which patches applied and how often each "
                             "one's code ran (METAPATCH_DEBUG=1): which pins the program still needs")
    # REMAINDER on the option too: everything after -m MODULE is the module's, even "--flags".
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                        help="run a module as `python -m MODULE ARGS...`")
    parser.add_argument("program", nargs=argparse.REMAINDER, metavar="PROGRAM ARGS...",
                        help="the program and its arguments, passed on unchanged ('--' first if the program's "
                             "name starts with '-')")


def bootstrap_env(environ: Mapping[str, str]) -> Dict[str, str]:
    """``environ`` with the start-up folder first on PYTHONPATH and the package's home named."""
    from metapatch._bootstrap import BOOTSTRAP_DIR, HOME_ENV

    env = dict(environ)
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *existing])
    env[HOME_ENV] = str(Path(__file__).resolve().parents[2])
    return env


def command_line(module: Optional[List[str]], program: List[str]) -> List[str]:
    """The argv to exec: ``python -m MODULE ...``, ``python script.py ...`` or the program itself."""
    if module is not None:
        if not module:
            raise ValueError("-m needs a module name")
        return [sys.executable, "-m", *module, *program]
    if not program:
        raise ValueError("nothing to run: give a script, -m MODULE, or a command")
    if program[0].endswith(".py") or program[0].endswith(".pyw"):
        return [sys.executable, *program]
    return list(program)


def run(args: argparse.Namespace) -> int:
    program = list(args.program)
    if program[:1] == ["--"]:
        program = program[1:]
    try:
        argv = command_line(args.module, program)
    except ValueError as exc:
        print(f"metapatch run: {exc}", file=sys.stderr)
        return 2
    executable = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    if executable is None:
        print(f"metapatch run: {argv[0]}: command not found", file=sys.stderr)
        return 127  # what a shell answers
    sys.stdout.flush()
    sys.stderr.flush()
    env = bootstrap_env(os.environ)
    if args.report:
        env["METAPATCH_DEBUG"] = "1"
    try:
        os.execve(executable, argv, env)
    except OSError as exc:
        print(f"metapatch run: cannot execute {executable}: {exc}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process
