"""The cost of METAPATCH_DEBUG=1's call counting on an offloaded forward.

A tiny Llama loaded with from_pretrained, half its layers on disk and the embedding on cpu (every forward goes
through accelerate's hooks and metapatch's patched functions), in two interpreters: counting off (the default)
and on. Each runs ROUNDS rounds of FORWARDS forwards; the rounds of the two interpreters interleave (one
round each, in turn), so both see the same machine. Prints the median milliseconds per forward of each and
the patched calls counted per forward, and the cost of one counted call (``model.device``).

    PYTHONPATH=. python benchmarks/bench_run_report.py [--rounds 15] [--forwards 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
import metapatch
import torch
from metapatch import _firing
from metapatch.selftest._models import save_tiny_llama, tiny_llama_config
from transformers import AutoModelForCausalLM

root = sys.argv[1]
path = os.path.join(root, "ckpt")
if not os.path.exists(path):
    save_tiny_llama(path)
layers = tiny_llama_config().num_hidden_layers
device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
              **{f"model.layers.{i}": ("disk" if i % 2 else "cpu") for i in range(layers)}}
model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map,
                                             offload_folder=os.path.join(root, f"offload-{os.getpid()}"))
ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
forwards = int(sys.argv[2])
with torch.no_grad():
    model(ids)  # warm
    for line in sys.stdin:
        before = sum(_firing.COUNTS.values())
        started = time.perf_counter()
        for _ in range(forwards):
            model(ids)
        seconds = time.perf_counter() - started
        calls = (sum(_firing.COUNTS.values()) - before) / forwards
        started = time.perf_counter()
        for _ in range(10000):
            model.device  # a patched property (offloaded-model-device): the counter's cost per call
        device_us = 100 * (time.perf_counter() - started)
        print(json.dumps({"ms": 1000 * seconds / forwards, "calls": calls, "device_us": device_us}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--forwards", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        children = {}
        for label, debug in (("off", "0"), ("on", "1")):
            env = dict(os.environ, METAPATCH_DEBUG=debug, OMP_NUM_THREADS="1")
            children[label] = subprocess.Popen([sys.executable, "-c", CHILD, root, str(args.forwards)], env=env,
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL, text=True)
            if label == "off":  # the first child writes the checkpoint the second one reads
                children[label].stdin.write("go\n")
                children[label].stdin.flush()
                children[label].stdout.readline()
        results = {label: [] for label in children}
        for _ in range(args.rounds):
            for label, child in children.items():
                child.stdin.write("go\n")
                child.stdin.flush()
                results[label].append(json.loads(child.stdout.readline()))
        for child in children.values():
            child.stdin.close()
            child.wait()
    off = statistics.median(r["ms"] for r in results["off"])
    on = statistics.median(r["ms"] for r in results["on"])
    calls = results["on"][-1]["calls"]
    print(f"offloaded tiny Llama forward, median of {args.rounds} rounds x {args.forwards} forwards:")
    print(f"  counting off (default): {off:.3f} ms; METAPATCH_DEBUG=1: {on:.3f} ms; ratio {on / off:.3f}")
    print(f"  patched calls counted per forward: {calls:g}")
    dev_off = statistics.median(r["device_us"] for r in results["off"])
    dev_on = statistics.median(r["device_us"] for r in results["on"])
    print(f"  model.device (a patched property): {dev_off:.2f} us off, {dev_on:.2f} us counted "
          f"(+{dev_on - dev_off:.2f} us per call)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
