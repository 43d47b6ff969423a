"""Benchmark: adapter loading over an offloaded base, on each call as users write it (not part of
the test suite).

One row per entry point, each written as the public reports and peft's / transformers' docs write
it; every row times the same call over an in-memory base and over a base dispatched with half its
decoder layers on disk, and reports the ratio of the medians with the spread (min-max) of each side:

* ``PeftModel.from_pretrained(base, adapter)``
* ``PeftModel.from_pretrained(base, adapter, offload_dir=DIR)`` (what peft's own error message asks for)
  and ``offload_folder=DIR`` (its older spelling, which peft still accepts)
* ``PeftModel.from_pretrained(base, adapter, is_trainable=True)``
* ``PeftModel.from_pretrained(base, adapter, device_map="auto", offload_dir=DIR)`` (public reports passing the
  base's ``from_pretrained`` arguments again; "auto" without ``max_memory`` is peft's own default, so the base
  keeps its dispatch, as with no ``device_map``)
* ``PeftModel.from_pretrained(base, adapter, device_map="sequential", offload_dir=DIR)`` (a second placement
  really asked for: on a CPU-only machine where the model fits in memory it puts every layer in memory, so
  the disk layers move, read from the checkpoint, and the others keep their hooks; the in-memory side moves
  nothing, so this row measures that read as well)
* ``PeftModel.from_pretrained(base, adapter, device_map=<the base's map>, offload_dir=DIR)`` (a placement
  equal to the base's: the base keeps its dispatch)
* ``PeftModel.from_pretrained(base, adapter)`` then ``.load_adapter(adapter2, "second")`` (several adapters)
* transformers' ``base.load_adapter(adapter)`` and ``base.load_adapter(adapter, device_map="auto")``
  (transformers 5 reads ``device_map`` there as the adapter's loading map, not a new placement)

Goal: <= 1.20 in every row but the "sequential" one (a real move of half the model). Rounds are interleaved row by row and side by side (which side
goes first alternates), after one untimed warm-up of each row; every base is loaded (and its offload
folder flushed) before timing. Besides the wall time, each call's process CPU time is reported: on a
shared machine the wall time includes waits for a core.

    python benchmarks/bench_peft_entry_points.py [--hidden 256] [--layers 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import metapatch  # noqa: F401 - the patches under test
from metapatch.selftest._models import save_tiny_llama
from metapatch.selftest._peft import save_adapter


def _device_map(layers: int) -> Dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = "cpu" if i % 2 == 0 else "disk"
    return device_map


def _seconds(call: Callable[[], object]) -> Tuple[float, float]:
    """Wall time and this process's CPU time of one call. On a machine shared with other work the wall
    time includes waits for a core; the CPU time does not, and is what a quiet machine would show of a
    CPU-bound load (both sides read the same cached checkpoint)."""
    gc.collect()
    gc.disable()
    try:
        started, cpu = time.perf_counter(), time.process_time()
        call()
        return time.perf_counter() - started, time.process_time() - cpu
    finally:
        gc.enable()


def _rows(adapter: Path, second: Path, work: Path, base_map: Dict[str, str]) -> List[Tuple[str, Callable]]:
    from peft import PeftModel

    def two_adapters(base):
        model = PeftModel.from_pretrained(base, adapter)
        model.load_adapter(second, adapter_name="second")

    return [
        ("PeftModel.from_pretrained(base, adapter)", lambda base: PeftModel.from_pretrained(base, adapter)),
        ("... offload_dir=DIR", lambda base: PeftModel.from_pretrained(
            base, adapter, offload_dir=str(work / "peft-offload"))),
        ("... offload_folder=DIR", lambda base: PeftModel.from_pretrained(
            base, adapter, offload_folder=str(work / "peft-offload-folder"))),
        ("... is_trainable=True", lambda base: PeftModel.from_pretrained(base, adapter, is_trainable=True)),
        ('... device_map="auto", offload_dir=DIR', lambda base: PeftModel.from_pretrained(
            base, adapter, device_map="auto", offload_dir=str(work / "peft-offload-auto"))),
        ('... device_map="sequential", offload_dir=DIR', lambda base: PeftModel.from_pretrained(
            base, adapter, device_map="sequential", offload_dir=str(work / "peft-offload-sequential"))),
        ("... device_map=<base's map>, offload_dir=DIR", lambda base: PeftModel.from_pretrained(
            base, adapter, device_map=dict(base_map), offload_dir=str(work / "peft-offload-same"))),
        ("... then .load_adapter(adapter2)", two_adapters),
        ("transformers base.load_adapter(adapter)", lambda base: base.load_adapter(str(adapter))),
        ('... base.load_adapter(adapter, device_map="auto")',
         lambda base: base.load_adapter(str(adapter), device_map="auto")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per row (median taken; at least 5)")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")

    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench-peft-entry-"))
    os.chdir(work)
    checkpoint = save_tiny_llama(work / "base", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4)
    adapter = save_adapter("llama", checkpoint, work / "adapter", seed=3)
    second = save_adapter("llama", checkpoint, work / "adapter2", seed=4)
    device_map = _device_map(args.layers)
    rows = _rows(adapter, second, work, device_map)
    folders = iter(range(10 ** 6))

    def bases(count: int):
        made = [(AutoModelForCausalLM.from_pretrained(checkpoint),
                 AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                      offload_folder=str(work / f"offload{next(folders)}")))
                for _ in range(count)]
        os.sync()
        return made

    load_before = os.getloadavg()
    for _, call in rows:  # warm-up: lazy imports and first-call set-up off the clock
        for base in bases(1)[0]:
            call(base)
    times: Dict[str, Dict[str, List[float]]] = {name: {"in-memory": [], "offloaded": []} for name, _ in rows}
    cpu: Dict[str, Dict[str, List[float]]] = {name: {"in-memory": [], "offloaded": []} for name, _ in rows}
    for round_ in range(args.rounds):
        for name, call in rows:
            in_memory, offloaded = bases(1)[0]
            sides = [("in-memory", in_memory), ("offloaded", offloaded)]
            for side, base in (sides if round_ % 2 == 0 else sides[::-1]):  # neither side always goes first
                wall, used = _seconds(lambda: call(base))
                times[name][side].append(wall)
                cpu[name][side].append(used)

    print(f"model: Llama hidden={args.hidden}, {args.layers} layers (every second one on disk), non-zero LoRA r=4 "
          f"on q/v/o/down_proj; {args.rounds} interleaved rounds per row, medians (min-max)")
    print("load average (1/5/15 min) at the start: %.1f/%.1f/%.1f, at the end: %.1f/%.1f/%.1f"
          % (load_before + os.getloadavg()))
    print("ratio: of the wall-time medians; paired: the median of the rounds' ratios (each round's two sides run "
          "back to back, so a machine whose speed drifts affects both alike); spread: the rounds' ratios (min-max); "
          "cpu: the ratio of the medians of this process's CPU time; best: the ratio of the fastest rounds (on a "
          "machine whose speed jumps between rounds, what the call costs when nothing interferes)")
    print(f"{'call':<50}{'in-memory base':>22}{'offloaded base':>22}{'ratio':>7}{'paired':>8}{'spread':>12}{'cpu':>6}"
          f"{'best':>6}")
    for name, _ in rows:
        sides = times[name]
        cells = []
        for side in ("in-memory", "offloaded"):
            values = sides[side]
            cells.append(f"{statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}) ms")
        ratio = statistics.median(sides["offloaded"]) / statistics.median(sides["in-memory"])
        per_round = [o / m for o, m in zip(sides["offloaded"], sides["in-memory"])]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        cpu_ratio = statistics.median(cpu[name]["offloaded"]) / statistics.median(cpu[name]["in-memory"])
        paired = statistics.median(per_round)
        best = min(sides["offloaded"]) / min(sides["in-memory"])
        print(f"{name:<50}{cells[0]:>22}{cells[1]:>22}{ratio:>7.2f}{paired:>8.2f}{spread:>12}{cpu_ratio:>6.2f}"
              f"{best:>6.2f}")


if __name__ == "__main__":
    main()
