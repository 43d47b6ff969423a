"""Cost of offloaded-move-guard on calls that must go straight through: Module.to / .cpu on models
that are not offloaded, with accelerate imported (the guard's slow path: it walks the modules).

    python benchmarks/bench_move_guard.py [--repeat N]

Prints microseconds per call with and without the patch and their ratio. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import timeit


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    small = torch.nn.Linear(8, 8)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                         num_attention_heads=4, num_key_value_heads=2)
    return {"Linear": small, "Llama-16-layers": LlamaForCausalLM(config)}


def measure(model, call: str, repeat: int) -> float:
    import torch

    calls = {"to(float32)": lambda: model.to(torch.float32), "to('cpu')": lambda: model.to("cpu"),
             "cpu()": lambda: model.cpu()}
    best = min(timeit.repeat(calls[call], number=repeat, repeat=5))
    return best / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    import accelerate.hooks  # noqa: F401 - the guard only looks at modules once accelerate is imported

    import metapatch

    models = build()
    rows = []
    for name, model in models.items():
        for call in ("to(float32)", "to('cpu')", "cpu()"):
            metapatch.install(["offloaded-move-guard"])
            patched = measure(model, call, args.repeat)
            metapatch.unpatch("offloaded-move-guard")
            plain = measure(model, call, args.repeat)
            rows.append((name, call, plain, patched))
    metapatch.install(["offloaded-move-guard"])
    print(f"{'model':18} {'call':12} {'plain us':>10} {'guarded us':>11} {'ratio':>6}")
    for name, call, plain, patched in rows:
        print(f"{name:18} {call:12} {plain:10.1f} {patched:11.1f} {patched / plain:6.2f}")


if __name__ == "__main__":
    main()
