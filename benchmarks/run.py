"""Run every benchmark (benchmarks/bench_*.py) and print one report of side-by-side ratios.

    python benchmarks/run.py [--out benchmarks/RESULTS.md]

Each benchmark measures its own pairs side by side in one process run and prints ratios; this
script runs them one after another, adds the machine and the installed versions, and writes the
whole report as Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DISTS = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "wrapt")


def header() -> str:
    versions = []
    for dist in DISTS:
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} (not installed)")
    return "\n".join([
        f"Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        f"Python {platform.python_version()}; " + ", ".join(versions),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    parser.add_argument("--only", help="substring of the benchmark file names to run")
    args = parser.parse_args()
    sections = ["# metapatch benchmarks", "", "```", header(), "```"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    for script in sorted(HERE.glob("bench_*.py")):
        if args.only and args.only not in script.name:
            continue
        print(f"== {script.name}", flush=True)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
        output = proc.stdout.strip() or "(no output)"
        if proc.returncode != 0:
            output += f"\n(exit code {proc.returncode})\n" + proc.stderr.strip()[-2000:]
        print(output, flush=True)
        sections += ["", f"## {script.stem}", "", "```", output, "```"]
    report = "\n".join(sections) + "\n"
    if args.out:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
