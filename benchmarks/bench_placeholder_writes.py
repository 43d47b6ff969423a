"""The per-forward cost of offloaded-placeholder-writes, side by side in one process (not part of the test suite).

One random Llama loaded with ``from_pretrained`` and a ``device_map`` that puts every second decoder layer and the
head on disk. Rounds alternate the patch off (``metapatch.unpatch("offloaded-placeholder-writes")``) and on
(``metapatch.install([...])``), in alternating order; after each toggle one forward is run untimed (it turns the
placeholders plain, or marks them), then ``--forwards`` forwards are timed. Reported: each side's median time per
forward, the median of the rounds' own ratios (on / off) and their spread (min-max).

    python benchmarks/bench_placeholder_writes.py [--hidden 256] [--layers 8] [--rounds 20] [--forwards 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import metapatch

PATCH_ID = "offloaded-placeholder-writes"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--forwards", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    work = Path(tempfile.mkdtemp(prefix="bench-placeholder-writes-"))
    LlamaForCausalLM(config).save_pretrained(work / "ckpt")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "disk",
                  **{f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(args.layers)}}
    model = LlamaForCausalLM.from_pretrained(work / "ckpt", device_map=device_map,
                                             offload_folder=str(work / "offload")).eval()
    ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    offloaded = sum(1 for p in model.parameters() if p.is_meta)

    def forwards() -> float:
        with torch.no_grad():
            model(ids)  # untimed: the placeholders become what this side makes of them
            start = time.perf_counter()
            for _ in range(args.forwards):
                model(ids)
        return (time.perf_counter() - start) / args.forwards

    on, off, ratios = [], [], []
    for round_ in range(args.rounds):
        times = {}
        for side in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            if side == "off":
                metapatch.unpatch(PATCH_ID)
            else:
                metapatch.install([PATCH_ID])
            times[side] = forwards()
        on.append(times["on"])
        off.append(times["off"])
        ratios.append(times["on"] / times["off"])
    metapatch.install([PATCH_ID])
    versions = {name: __import__(name).__version__ for name in ("torch", "transformers", "accelerate")}
    print(f"model: random fp32 Llama, hidden {args.hidden}, {args.layers} layers, every second one and lm_head on "
          f"disk ({offloaded} offloaded parameters), {args.tokens} tokens; {versions}")
    print("| measurement | patch off | patch on | ratio (median of rounds) | spread | rounds |")
    print("|---|---|---|---|---|---|")
    print(f"| forward | {statistics.median(off) * 1e3:.2f} ms | {statistics.median(on) * 1e3:.2f} ms | "
          f"{statistics.median(ratios):.3f} (goal <= 1.02) | {min(ratios):.3f}-{max(ratios):.3f} | {args.rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
