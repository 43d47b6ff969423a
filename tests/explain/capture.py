"""Regenerate tracebacks/<flow>.txt: each script in flows/ run as a user runs it, in a fresh folder, without
metapatch (METAPATCH_DISABLE=all, and metapatch never imported), on the installed stack. Paths are shortened to
what a user would paste from any machine (``.../site-packages/``, the script's own name).

    python tests/explain/capture.py            # every flow
    python tests/explain/capture.py to_float16 # one

A flow that no longer fails on the installed stack is reported and its file kept."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLOWS = HERE / "flows"
TRACEBACKS = HERE / "tracebacks"


def _clean(text: str, workdir: str) -> str:
    text = re.sub(r'File "[^"]*?/(site-packages|dist-packages)/', r'File ".../\1/', text)
    text = text.replace(workdir + os.sep, "")
    lines = [line for line in text.splitlines() if "Loading weights" not in line and "it/s]" not in line]
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), 0)
    return "\n".join(lines[start:]).strip() + "\n"


def capture(name: str) -> "tuple[bool, str]":
    with tempfile.TemporaryDirectory() as workdir:
        workdir = os.path.realpath(workdir)
        for script in FLOWS.glob("*.py"):
            shutil.copy(script, workdir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("METAPATCH") and k != "PYTHONPATH"}
        env.update(METAPATCH_DISABLE="all", METAPATCH_AUTOLOAD="0", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, f"{name}.py"], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=600)
        return proc.returncode != 0 and "Traceback" in proc.stderr, _clean(proc.stderr, workdir)


def main(names) -> int:
    names = names or sorted(p.stem for p in FLOWS.glob("*.py") if not p.name.startswith("_"))
    TRACEBACKS.mkdir(exist_ok=True)
    code = 0
    for name in names:
        failed, text = capture(name)
        if not failed:
            print(f"{name}: no longer fails without metapatch here; kept the old traceback", file=sys.stderr)
            code = 1
            continue
        (TRACEBACKS / f"{name}.txt").write_text(text)
        print(f"{name}: {text.strip().splitlines()[-1][:120]}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
