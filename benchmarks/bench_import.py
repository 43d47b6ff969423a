"""Import overhead, measured side by side in one run.

Interleaves fresh interpreters running ``import transformers`` with and without a preceding
``import metapatch`` and reports the ratio of medians; also ``import metapatch`` alone against an
empty interpreter, and the overhead when every patch is not-affected (METAPATCH_DISABLE=all is the
floor; a fake far-future version range is not needed: disabled patches register no hooks).

    python benchmarks/bench_import.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c pass": "pass",
    "import metapatch": "import metapatch",
    "import transformers": "import transformers",
    "import metapatch, transformers": "import metapatch, transformers",
    "import transformers, accelerate, peft": "import transformers, accelerate, peft",
    "import metapatch, transformers, accelerate, peft": "import metapatch, transformers, accelerate, peft",
}


def timed(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(rounds: int) -> dict:
    env = dict(os.environ)
    env.pop("METAPATCH_DISABLE", None)
    # As installed for a user: byte-compiled. With PYTHONDONTWRITEBYTECODE set (as on the machines
    # these numbers come from), a source tree or editable install would be compiled again in every
    # interpreter (about 9 ms for metapatch's modules) while site-packages ship their .pyc files.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    samples = {name: [] for name in CASES}
    for name, code in CASES.items():  # warm the page cache and .pyc files
        timed(code, env)
    for _ in range(rounds):
        for name, code in CASES.items():  # interleaved, so drift hits every case alike
            samples[name].append(timed(code, env))
    return {name: statistics.median(values) for name, values in samples.items()}


def rows(medians: dict) -> list:
    return [
        ("import metapatch, transformers / import transformers",
         medians["import metapatch, transformers"] / medians["import transformers"], "< 1.02"),
        ("import metapatch, transformers, accelerate, peft / without metapatch",
         medians["import metapatch, transformers, accelerate, peft"] / medians["import transformers, accelerate, peft"],
         "(patches applied on import)"),
        ("import metapatch / python -c pass", medians["import metapatch"] / medians["python -c pass"], "(interpreter start)"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    for label, ratio, goal in rows(measure(args.rounds)):
        print(f"{label:<70} {ratio:6.3f}  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
