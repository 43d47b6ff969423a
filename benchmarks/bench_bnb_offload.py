"""Benchmark for bnb-quant-state-offload (not part of the test suite).

Measured side by side in one run, on the CPU (disk offload, CPU main device):
* resident bytes of the offloaded 4-bit layers while offloaded, against the same layers in an
  undispatched quantized model (packed weight + quant state), and against the packed weight alone
  (goal: only the quant-state scalars and absmax remain, under 5% of the packed weight);
* forward time of the dispatched 4-bit model against the same model dispatched in bfloat16 with
  the same device map, and against the undispatched 4-bit model (goal: <= 1.25 for nf4 double
  quant), and the number of quantize calls during those forwards (goal: zero);
* forward time of a LoRA adapter (non-zero B) over the dispatched nf4 double-quant base against the
  same adapter over the in-memory base.

Every pair is timed interleaved (one forward of each per round, so machine load hits both alike);
the figures are ratios of medians over the rounds.

    python benchmarks/bench_bnb_offload.py [--hidden 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List

import metapatch  # noqa: F401 - the patches under test
from metapatch.patches.bnb_quant_state_offload import HOST_ATTR
from metapatch.selftest import _bnb as scenario
from metapatch.selftest._models import input_ids, save_tiny_llama


def _tensors_of_state(state: Any) -> Iterable[Any]:
    import torch

    if state is None:
        return
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            yield value
    yield from _tensors_of_state(vars(state).get("state2"))
    yield from _tensors_of_state(vars(state).get(HOST_ATTR))


def resident_bytes(linears: List[Any], weights: bool = True) -> int:
    """Bytes held in memory (not meta) by these layers' weights and quant states, each storage once."""
    seen: Dict[int, int] = {}
    for _, module in linears:
        tensors = list(_tensors_of_state(module.weight.quant_state)) + list(_tensors_of_state(module.quant_state))
        if weights:
            tensors.append(module.weight.data)
        for tensor in tensors:
            if not tensor.is_meta:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def packed_weight_bytes(linears: List[Any]) -> int:
    return sum(m.weight.data.numel() * m.weight.data.element_size() for _, m in linears)


def timed_forwards(model: Any, ids: Any, repeats: int) -> List[float]:
    import torch

    times = []
    with torch.no_grad():
        model(ids)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (multiple of 64)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (medians)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    work = Path(tempfile.mkdtemp(prefix="bench-bnb-offload-"))
    save_tiny_llama(work / "base", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                    num_hidden_layers=scenario.NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=1024)
    ids = input_ids(vocab_size=1024, length=args.tokens)

    print(f"model: Llama hidden={args.hidden}, {scenario.NUM_LAYERS} layers, layers "
          f"{list(scenario.OFFLOADED_LAYERS)} on disk, CPU main, {args.tokens} tokens, {args.repeats} forwards")
    print(f"{'config':<22}{'resident/in-memory':>20}{'resident/packed':>18}{'fwd 4bit/bf16':>16}"
          f"{'fwd disp/in-mem':>18}{'quantize calls':>16}")
    bf16 = scenario.dispatch(AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.bfloat16).eval(),
                             work / "bf16")
    for quant_type, double_quant in (("nf4", True), ("nf4", False), ("fp4", True)):
        config = scenario.quant_config(quant_type, double_quant, "bfloat16")
        in_memory = scenario.load_quantized(work / "base", config)
        # Loaded again rather than deep-copied: a deepcopy splits Linear4bit.quant_state from
        # weight.quant_state (two objects), which would double the resident bytes measured.
        dispatched = scenario.dispatch(scenario.load_quantized(work / "base", config),
                                       work / f"{quant_type}-{double_quant}")
        layers_in_memory = scenario.offloaded_linears(in_memory)
        layers_offloaded = scenario.offloaded_linears(dispatched)
        with scenario.counting_quantize_calls() as counts:
            quant_times, bf16_times, memory_times = [], [], []
            for _ in range(args.repeats):  # interleaved, so that load on the machine hits all alike
                quant_times += timed_forwards(dispatched, ids, 1)
                bf16_times += timed_forwards(bf16, ids, 1)
                memory_times += timed_forwards(in_memory, ids, 1)
        resident = resident_bytes(layers_offloaded)
        print(f"{quant_type + (' double-quant' if double_quant else ''):<22}"
              f"{resident / resident_bytes(layers_in_memory):>20.4f}"
              f"{resident / packed_weight_bytes(layers_in_memory):>18.4f}"
              f"{statistics.median(quant_times) / statistics.median(bf16_times):>16.2f}"
              f"{statistics.median(quant_times) / statistics.median(memory_times):>18.2f}"
              f"{sum(counts.values()):>16d}")
    lora_over_offloaded_4bit(work, ids, args.repeats)
    print("resident: bytes the offloaded layers keep in memory while offloaded (host copy of the quant state);")
    print("in-memory: the same layers undispatched (packed weight + quant state); packed: packed weights alone.")
    print("fwd 4bit/bf16: dispatched 4-bit vs the same map in bfloat16;")
    print("fwd disp/in-mem: dispatched vs undispatched 4-bit (median of interleaved forwards).")


def lora_over_offloaded_4bit(work: Path, ids: Any, repeats: int) -> None:
    """LoRA (init_lora_weights=False) over the nf4 double-quant base: dispatched (disk offload) against
    in memory, interleaved."""
    from peft import PeftModel

    from metapatch.selftest._peft import save_adapter

    config = scenario.quant_config("nf4", True, "bfloat16")
    adapter = save_adapter("llama", work / "base", work / "adapter", seed=3)
    in_memory = PeftModel.from_pretrained(scenario.load_quantized(work / "base", config), adapter).eval()
    offloaded = PeftModel.from_pretrained(
        scenario.dispatch(scenario.load_quantized(work / "base", config), work / "lora-nf4"), adapter).eval()
    offloaded_times, memory_times = [], []
    for _ in range(repeats):
        offloaded_times += timed_forwards(offloaded, ids, 1)
        memory_times += timed_forwards(in_memory, ids, 1)
    print(f"{'nf4 dq + LoRA':<22}{'':>20}{'':>18}{'':>16}"
          f"{statistics.median(offloaded_times) / statistics.median(memory_times):>18.2f}{'':>16}")


if __name__ == "__main__":
    main()
