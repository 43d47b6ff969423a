"""Benchmark for peft-offload-redispatch (not part of the test suite).

Measured side by side in one run, on the CPU (layers split between CPU memory and disk):
* ``PeftModel.from_pretrained`` over the offloaded base against the same call over the in-memory
  base (goal: ratio <= 1.2: the re-dispatch re-uses the offloaded weights, it copies and saves none);
* files written by that load: in the base's offload folder (goal: none), anywhere else in the run's
  folder or the working directory (must be none);
* forward time of the PEFT model over the offloaded base against the offloaded base model alone.

Rounds are interleaved (after one untimed warm-up load of each kind) and medians reported.

    python benchmarks/bench_peft_offload.py [--hidden 512] [--layers 8] [--rounds 9]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import metapatch  # noqa: F401 - the patch under test
from metapatch.selftest._models import input_ids, save_tiny_llama
from metapatch.selftest._peft import _listing, save_adapter


def _device_map(layers: int) -> Dict[str, str]:
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(layers):
        device_map[f"model.layers.{i}"] = "cpu" if i < layers // 2 else "disk"
    return device_map


def _load_seconds(load) -> float:
    """One load, timed as timeit does: the garbage of earlier rounds (whole models) collected
    first and the cyclic collector off during the call, so a collection never lands on one side."""
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        load()
        return time.perf_counter() - started
    finally:
        gc.enable()


def _forward_seconds(model, ids, repeats: int = 3) -> float:
    import torch

    with torch.no_grad():
        model(input_ids=ids)  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=ids)
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median taken; at least 7)")
    args = parser.parse_args()
    if args.rounds < 7:
        parser.error("--rounds must be at least 7")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench-peft-offload-"))
    os.chdir(work)
    checkpoint = save_tiny_llama(work / "base", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4)
    adapter = save_adapter("llama", checkpoint, work / "adapter", seed=3)
    device_map = _device_map(args.layers)
    ids = input_ids(length=32)

    times: Dict[str, List[float]] = {"load in-memory": [], "load offloaded": [], "fwd base offloaded": [],
                                     "fwd peft offloaded": []}
    written: List[str] = []
    # One untimed load of each kind first: peft's and metapatch's lazy imports and first-call
    # set-up would otherwise land on whichever side runs first.
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint), adapter)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        checkpoint, device_map=device_map, offload_folder=str(work / "offload-warm-up")), adapter)
    # Every base is loaded (and its offload folder written and flushed) before any timing: the
    # disk write-back of a fresh offload folder otherwise lands on the timed loads at random.
    bases = [(AutoModelForCausalLM.from_pretrained(checkpoint),
              AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                   offload_folder=str(work / f"offload{n}")),
              AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                   offload_folder=str(work / f"offload{n}")))
             for n in range(args.rounds)]
    os.sync()
    for in_memory_base, base, bare in bases:
        times["load in-memory"].append(_load_seconds(lambda: PeftModel.from_pretrained(in_memory_base, adapter)))
        before = _listing(work, True)
        loaded = []
        times["load offloaded"].append(_load_seconds(lambda: loaded.append(PeftModel.from_pretrained(base, adapter))))
        model = loaded[0].eval()
        written += sorted(_listing(work, True) - before)
        times["fwd base offloaded"].append(_forward_seconds(bare.eval(), ids))
        times["fwd peft offloaded"].append(_forward_seconds(model, ids))

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: Llama hidden={args.hidden}, {args.layers} layers (half on disk), LoRA r=4 on q/v/o/down_proj; "
          f"{args.rounds} interleaved rounds, medians")
    print(f"{'PeftModel.from_pretrained':<34}{'in-memory base':>16}{'offloaded base':>16}{'ratio':>8}")
    print(f"{'':<34}{med['load in-memory'] * 1e3:>14.1f}ms{med['load offloaded'] * 1e3:>14.1f}ms"
          f"{med['load offloaded'] / med['load in-memory']:>8.2f}")
    print(f"{'forward (32 tokens)':<34}{'base offloaded':>16}{'PEFT offloaded':>16}{'ratio':>8}")
    print(f"{'':<34}{med['fwd base offloaded'] * 1e3:>14.1f}ms{med['fwd peft offloaded'] * 1e3:>14.1f}ms"
          f"{med['fwd peft offloaded'] / med['fwd base offloaded']:>8.2f}")
    print(f"files written by the PEFT loads (offload folders, checkpoint, working directory): {len(written)}"
          + (f" {written[:5]}" if written else ""))


if __name__ == "__main__":
    main()
