"""Offloaded forward, greedy generate and PEFT adapter load: metapatch against upstream, side by side in one
process (not part of the test suite).

The model is a random bf16 Llama (about 100M parameters by default) loaded with ``from_pretrained`` and a
``device_map`` that keeps the embedding, the head and the first half of the decoder layers on the execution
device and offloads the second half: to ``"cpu"`` where CUDA is present (accelerate's hooks copy them to the
GPU at each forward), to ``"disk"`` on a CPU-only machine (where ``"cpu"`` is not offloaded). Two copies are
loaded: one with every patch off (``metapatch.unpatch()``), one with them on (``metapatch.install()``); each
round runs both sides back to back, in alternating order, each with the patches as it was loaded. Reported
per row: each side's median time, the median of the rounds' own ratios (metapatch / upstream; a machine whose
speed drifts affects both sides of a round alike) and their spread (min-max). Goal: <= 1.02 per forward.

PEFT: ``PeftModel.from_pretrained`` (LoRA, non-zero) over the offloaded base, upstream against metapatch
where upstream loads it; where upstream fails, the error is reported and metapatch's load over the offloaded
base is compared with its load over the same base in memory.

    python benchmarks/bench_gpu_offload.py [--quick] [--json results.json] [--device cuda:0|cpu]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import metapatch

HERE = Path(__file__).resolve().parent
DISTS = ("torch", "transformers", "accelerate", "peft", "bitsandbytes")
GOAL_PER_FORWARD = 1.02


def stack() -> Dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in DISTS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def sizes(device: str, quick: bool, smoke: bool = False) -> Dict[str, Any]:
    """The model and the measurement: ~100M parameters and 256 tokens on a GPU, a small model on the CPU."""
    if device.startswith("cuda"):
        model = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                     num_key_value_heads=4, vocab_size=32000)
        return {"model": model, "tokens": 256, "prompt": 32, "new_tokens": 16,
                "rounds": 9 if quick else 25, "repeats": 5, "peft_rounds": 3 if quick else 7}
    if quick or smoke:  # the GPU lane's CPU dry run: the same steps, as small as they get
        model = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
        return {"model": model, "tokens": 32, "prompt": 8, "new_tokens": 4, "rounds": 5, "repeats": 2, "peft_rounds": 2}
    model = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=2048)
    return {"model": model, "tokens": 64, "prompt": 16, "new_tokens": 8, "rounds": 21, "repeats": 3, "peft_rounds": 7}


def device_map(layers: int, device: str) -> Dict[str, Any]:
    offload_to = "cpu" if device.startswith("cuda") else "disk"
    mapping: Dict[str, Any] = {"model.embed_tokens": device, "model.norm": device, "model.rotary_emb": device,
                               "lm_head": device}
    for i in range(layers):
        mapping[f"model.layers.{i}"] = device if i < layers // 2 else offload_to
    return mapping


def patches(on: bool) -> None:
    """Every patch on (as ``import metapatch`` leaves them) or off (upstream code at every site)."""
    if on:
        metapatch.install()
    else:
        metapatch.unpatch()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(call: Callable[[], Any], device: str, repeats: int = 1) -> float:
    """Seconds per call: the cyclic collector off meanwhile (a collection must not land on one side)."""
    gc.collect()
    gc.disable()
    try:
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize(device)
        return (time.perf_counter() - started) / repeats
    finally:
        gc.enable()


def summarize(name: str, upstream: List[float], patched: List[float], goal: Optional[float] = None,
              unit: str = "ms") -> Dict[str, Any]:
    ratios = [p / u for u, p in zip(upstream, patched)]
    row = {"name": name, "rounds": len(ratios), "unit": unit,
           "upstream": round(statistics.median(upstream) * 1e3, 3), "metapatch": round(statistics.median(patched) * 1e3, 3),
           "ratio": round(statistics.median(ratios), 4), "spread": [round(min(ratios), 4), round(max(ratios), 4)]}
    if goal is not None:
        row["goal"] = goal
        row["meets_goal"] = row["ratio"] <= goal
    return row


def interleaved(rounds: int, device: str, repeats: int, sides: Dict[bool, Callable[[], Any]]) -> Tuple[List[float], List[float]]:
    """Each round times both sides back to back (order alternating), each with its patch state."""
    times: Dict[bool, List[float]] = {False: [], True: []}
    for n in range(rounds):
        for on in ((False, True) if n % 2 == 0 else (True, False)):
            patches(on)
            times[on].append(timed(sides[on], device, repeats))
    patches(True)
    return times[False], times[True]


def build(work: Path, config: Dict[str, Any]) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, max_position_embeddings=1024, **config))
    model.to(torch.bfloat16).save_pretrained(work / "base")
    return work / "base"


def load(path: Path, mapping: Any, folder: Optional[Path]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"offload_folder": str(folder)} if folder is not None else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=mapping, **kwargs).eval()


def adapter(work: Path, path: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(work / "adapter")
    return work / "adapter"


def run(device: str, quick: bool, work: Path, smoke: bool = False, progress: Callable[[Dict[str, Any]], None] = lambda result: None
        ) -> Dict[str, Any]:
    import torch

    plan = sizes(device, quick, smoke)
    layers = plan["model"]["num_hidden_layers"]
    mapping = device_map(layers, device)
    path = build(work, plan["model"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, plan["model"]["vocab_size"], (1, plan["tokens"]), generator=generator).to(device)
    prompt = ids[:, :plan["prompt"]]

    models = {}
    for on in (False, True):
        patches(on)
        models[on] = load(path, mapping, work / f"offload-{int(on)}")
    patches(True)
    reference = load(path, {"": device}, None)
    parameters = sum(p.numel() for p in reference.parameters())
    equal_to_in_memory = {}
    with torch.no_grad():
        expected = reference(ids).logits
        for on in (False, True):
            patches(on)
            equal_to_in_memory["metapatch" if on else "upstream"] = bool(torch.equal(models[on](ids).logits, expected))
    patches(True)
    del reference

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else ""
    rows: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": device, "gpu": gpu, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "stack": stack(), "quick": quick,
              "model": {**plan["model"], "dtype": "bfloat16", "offloaded_layers": layers - layers // 2,
                        "offloaded_to": mapping[f"model.layers.{layers - 1}"], "parameters": parameters},
              # the offloaded forward against the same model in memory (torch.equal), each side as loaded
              "equal_to_in_memory": equal_to_in_memory, "rows": rows}
    with torch.no_grad():
        for on in (False, True):  # warm-up: first-call set-up lands on neither side's timings
            patches(on)
            models[on](ids)
            models[on].generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        up, mp = interleaved(plan["rounds"], device, plan["repeats"], {on: (lambda m=models[on]: m(ids)) for on in (False, True)})
        rows.append(summarize(f"forward ({plan['tokens']} tokens)", up, mp, GOAL_PER_FORWARD))
        progress(result)
        if smoke:  # the lane's own test: the forward row shows the logic works
            return result
        gen = {on: (lambda m=models[on]: m.generate(prompt, max_new_tokens=plan["new_tokens"], do_sample=False,
                                                    min_new_tokens=plan["new_tokens"], pad_token_id=0))
               for on in (False, True)}
        up, mp = interleaved(max(3, plan["rounds"] // 2), device, 1, gen)
        rows.append(summarize(f"greedy generate ({plan['prompt']} + {plan['new_tokens']} tokens)", up, mp))
        progress(result)
    del models
    gc.collect()

    # PEFT: a fresh base per load (the adapter is injected into it), all loaded before any timing.
    from peft import PeftModel

    lora = adapter(work, path)
    peft_rounds = plan["peft_rounds"]
    bases: Dict[bool, List[Any]] = {}
    for on in (False, True):
        patches(on)
        bases[on] = [load(path, mapping, work / f"peft-offload-{int(on)}-{n}") for n in range(peft_rounds + 1)]
    patches(False)
    upstream_error = ""
    try:
        with warnings.catch_warnings():  # upstream's own load warns once per adapter tensor where it fails
            warnings.simplefilter("ignore")
            PeftModel.from_pretrained(bases[False].pop(), lora)
    except Exception as exc:  # upstream's own failure: the row compares against the in-memory base instead
        upstream_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    patches(True)
    PeftModel.from_pretrained(bases[True].pop(), lora)  # warm-up
    if not upstream_error:
        loads = {on: (lambda on=on: PeftModel.from_pretrained(bases[on].pop(), lora)) for on in (False, True)}
        up, mp = interleaved(peft_rounds, device, 1, loads)
        rows.append(summarize("PeftModel.from_pretrained over the offloaded base", up, mp))
    else:
        in_memory = [load(path, {"": device}, None) for _ in range(peft_rounds)]
        times: Dict[str, List[float]] = {"in-memory": [], "offloaded": []}
        for n in range(peft_rounds):
            times["in-memory"].append(timed(lambda: PeftModel.from_pretrained(in_memory[n], lora), device))
            times["offloaded"].append(timed(lambda: PeftModel.from_pretrained(bases[True][n], lora), device))
        row = summarize("PeftModel.from_pretrained, offloaded base / in-memory base (metapatch)",
                        times["in-memory"], times["offloaded"])
        row["upstream_error"] = upstream_error
        row["compared"] = "metapatch: offloaded base against the same base in memory (upstream fails)"
        rows.append(row)

    progress(result)
    return result


def markdown(result: Dict[str, Any]) -> str:
    model = result["model"]
    lines = [f"{result['date']}, {result['gpu'] or 'CPU'} ({result['device']}), {result['machine']}; "
             + ", ".join(f"{k} {v}" for k, v in result["stack"].items()),
             f"model: random bf16 Llama, {model['parameters'] / 1e6:.1f}M parameters, {model['num_hidden_layers']} layers, "
             f"{model['offloaded_layers']} on {model['offloaded_to']}; interleaved rounds"
             + (" (--quick)" if result["quick"] else ""),
             "",
             "offloaded forward equal to the in-memory model: " + ", ".join(
                 f"{side} {'yes' if same else 'NO'}" for side, same in result.get("equal_to_in_memory", {}).items()),
             "",
             "| measurement | upstream | metapatch | ratio (median of rounds) | spread | rounds |",
             "|---|---|---|---|---|---|"]
    for row in result["rows"]:
        goal = f" (goal <= {row['goal']})" if "goal" in row else ""
        lines.append(f"| {row['name']} | {row['upstream']:.2f} ms | {row['metapatch']:.2f} ms | "
                     f"{row['ratio']:.3f}{goal} | {row['spread'][0]:.3f}-{row['spread'][1]:.3f} | {row['rounds']} |")
        if row.get("upstream_error"):
            lines.append(f"| (upstream: {row['upstream_error']}; columns: in-memory base / offloaded base) | | | | | |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 40 s on a GPU)")
    parser.add_argument("--smoke", action="store_true", help="the forward row only, on the smallest model (tests)")
    parser.add_argument("--device", help="execution device (default: cuda:0 where CUDA is present, else cpu)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    def write(result: Dict[str, Any]) -> None:  # after every row: a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps({**result, "markdown": markdown(result)}, indent=2))

    with tempfile.TemporaryDirectory(prefix="bench-gpu-offload-") as tmp:
        result = run(device, args.quick, Path(tmp), args.smoke, write)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
