"""Cost of offloaded-move-guard on calls that must go straight through: Module.to / .cpu on models
that are not offloaded, with accelerate imported.

    python benchmarks/bench_move_guard.py [--rounds 9] [--number 200]

Two states of the process:
* "no offload hook": accelerate is imported but has never attached an offload hook (the guard
  tests one flag and calls through);
* "after an offload": some other module was offloaded, so the guard looks up which modules of the
  moved subtree carry an offload hook (walked once, then cached until a hook or a submodule is
  added anywhere; before that cache it walked the subtree on every call).
Each round times the guarded method and torch's original (the function the patch wraps) back to
back, in alternating order (each side the fastest of 5 timings of --number calls), and takes their
ratio; the table shows the median over the rounds of the per-call times and of the ratios. Not
part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    small = torch.nn.Linear(8, 8)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=2)
    return {"Linear": small, "Llama-16-layers": LlamaForCausalLM(config)}


def calls(model):
    """(label, guarded call, the same call through torch's original method)."""
    import torch

    module = vars(torch.nn.Module)
    original_to, original_cpu = module["to"].__wrapped__, module["cpu"].__wrapped__
    return [
        ("to(float32)", lambda: model.to(torch.float32), lambda: original_to(model, torch.float32)),
        ("to('cpu')", lambda: model.to("cpu"), lambda: original_to(model, "cpu")),
        ("cpu()", lambda: model.cpu(), lambda: original_cpu(model)),
    ]


def per_call_us(function, number: int, repeat: int = 5) -> float:
    """The fastest of ``repeat`` timings of ``number`` calls: a timing the scheduler interrupted
    (a busy machine) is dropped rather than averaged in."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(number):
            function()
        best = min(best, time.perf_counter() - started)
    return best / number * 1e6


def measure(guarded, plain, rounds: int, number: int):
    guarded_us, plain_us, ratios = [], [], []
    for i in range(rounds):
        if i % 2:  # alternate the order so that neither side always runs warm
            p, g = per_call_us(plain, number), per_call_us(guarded, number)
        else:
            g, p = per_call_us(guarded, number), per_call_us(plain, number)
        guarded_us.append(g)
        plain_us.append(p)
        ratios.append(g / p)
    return statistics.median(plain_us), statistics.median(guarded_us), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median taken; at least 7)")
    parser.add_argument("--number", type=int, default=40, help="calls per timing (5 timings per side and round)")
    args = parser.parse_args()
    if args.rounds < 7:
        parser.error("--rounds must be at least 7")

    import metapatch  # first: the guard's flag must see accelerate's hooks from the start

    import accelerate.hooks as hooks
    import torch

    from metapatch.patches.offloaded_move_guard import _OffloadSeen

    state = {r["id"]: r["state"] for r in metapatch.status()}["offloaded-move-guard"]
    if state != "applied":
        raise SystemExit(f"offloaded-move-guard is {state} here; nothing to measure")
    models = build()
    rows = []
    for phase in ("no offload hook", "after an offload"):
        if phase == "after an offload":
            hooks.attach_align_device_hook(torch.nn.Linear(4, 4), execution_device="cpu", offload=True)
        assert _OffloadSeen.seen is (phase == "after an offload"), "the flag is not in the state measured"
        for name, model in models.items():
            for label, guarded, plain in calls(model):
                rows.append((phase, name, label, *measure(guarded, plain, args.rounds, args.number)))
    print(f"median of {args.rounds} interleaved rounds; each side the fastest of 5 x {args.number} calls")
    print(f"{'process state':17} {'model':16} {'call':12} {'plain us':>9} {'guarded us':>11} {'ratio':>6}")
    for phase, name, label, plain, guarded, ratio in rows:
        print(f"{phase:17} {name:16} {label:12} {plain:9.1f} {guarded:11.1f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
