"""Benchmark for bnb-cpu-repack-copy (not part of the test suite): the CPU repack cost of 4-bit layers.

On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its fused kernel. Measured in
one run, interleaved (one forward of each model per round; medians over the rounds, with min-max):
* forward time of the model with decoder layers 1 and 2 offloaded, against the same model in
  memory (goal: <= 1.5, the disk read included), for: disk offload (``dispatch_model``, CPU main
  device; the weight is put into the CPU layout at every forward by metapatch's byte layout), the
  same with bitsandbytes' own repack at every forward ("disk-bnb"), and cpu offload
  (``accelerate.cpu_offload`` of those layers: the repacked copy is kept per offload source);
* where the time goes in each forward: repacks (count and time), accelerate's reads of offloaded
  weights, bitsandbytes' fused 4-bit kernel (``gemv_4bit``, any number of tokens), and the rest
  (hooks, attention, norms);
* memory: bytes the repacked copies hold in RAM (in memory: one per 4-bit layer; cpu-offloaded: one
  per layer; disk-offloaded: the packed quant state only) and on disk (none: metapatch writes
  nothing into the offload folder).

Run it once as shipped and once with ``METAPATCH_DISABLE=bnb-cpu-repack-copy`` (upstream's in-place
repack: every offloaded layer is repacked at every forward).

    python benchmarks/bench_bnb_cpu_repack.py [--hidden 512] [--repeats 9]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator

import metapatch  # noqa: F401 - the patches under test
from metapatch.selftest import _bnb as scenario
from metapatch.selftest._models import input_ids, save_tiny_llama


@contextlib.contextmanager
def profiled() -> Iterator[Dict[str, float]]:
    """Seconds and calls of bitsandbytes' CPU repack and of accelerate's offloaded-weight reads."""
    import accelerate.utils.offload as offload
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as M

    import bitsandbytes.autograd._functions as AF

    totals = {"repack_s": 0.0, "repacks": 0, "disk_read_s": 0.0, "disk_reads": 0, "gemv_s": 0.0, "gemvs": 0}
    originals = (F._convert_weight_packed_for_cpu, offload.load_offloaded_weight, AF.F.gemv_4bit)

    def timed(function: Any, seconds: str, calls: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[seconds] += time.perf_counter() - start
                totals[calls] += 1
        return call

    F._convert_weight_packed_for_cpu = M._convert_weight_packed_for_cpu = timed(originals[0], "repack_s", "repacks")
    offload.load_offloaded_weight = timed(originals[1], "disk_read_s", "disk_reads")
    F.gemv_4bit = timed(originals[2], "gemv_s", "gemvs")  # the fused CPU kernel on repacked weights
    try:
        from metapatch._offload import bnb_fast_repack as fast
    except ImportError:  # an older metapatch
        fast = None
    if fast is not None:  # the byte-level repack of disk-offloaded weights counts as a repack
        originals = originals + (fast._permuted,)
        fast._permuted = timed(originals[3], "repack_s", "repacks")
    try:
        yield totals
    finally:
        F._convert_weight_packed_for_cpu = M._convert_weight_packed_for_cpu = originals[0]
        offload.load_offloaded_weight = originals[1]
        F.gemv_4bit = originals[2]
        if fast is not None:
            fast._permuted = originals[3]


@contextlib.contextmanager
def bitsandbytes_repack(active: bool) -> Iterator[None]:
    """With ``active``: disk-offloaded weights repacked by bitsandbytes' own conversion (no byte layout)."""
    try:
        from metapatch._offload import bnb_fast_repack as fast
    except ImportError:
        fast = None
    if not active or fast is None:
        yield
        return
    original = fast.packed_weight
    fast.packed_weight = lambda *args, **kwargs: None
    try:
        yield
    finally:
        fast.packed_weight = original


def forward_seconds(model: Any, ids: Any) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        model(ids)
        return time.perf_counter() - start


def repack_memory(models: Dict[str, Any], work: Path) -> Dict[str, int]:
    """Bytes of the patch's repacked copies: of the layers in memory (weight and absmax, in RAM), of
    the offloaded layers in RAM (cpu offload: the weight too; disk: the absmax only) and the
    memory-mapped files in the offload folders."""
    from metapatch.patches import bnb_cpu_repack_copy as patch

    files = {p.name: p.stat().st_size for p in work.rglob("*.metapatch-cpu-packed.dat")}
    in_memory = sum(packed.nbytes + state.absmax.nbytes for _, packed, state, _ in patch._PACKED.values())
    offloaded_ram = 0
    for model in models.values():
        for module in model.modules():
            cached = module.__dict__.get(patch.OFFLOAD_CACHE)
            if cached is not None:
                mapped = f"{cached[0][1]}.metapatch-cpu-packed.dat" in files
                offloaded_ram += cached[2].absmax.nbytes + (0 if mapped or cached[1] is None else cached[1].nbytes)
    return {"in_memory_layers_ram": in_memory, "offloaded_layers_ram": offloaded_ram,
            "offload_folder_files": sum(files.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (multiple of 64)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (medians)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()

    import bitsandbytes.functional as F

    import metapatch as mp

    work = Path(tempfile.mkdtemp(prefix="bench-bnb-cpu-repack-"))
    save_tiny_llama(work / "base", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                    num_hidden_layers=scenario.NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=1024)
    ids = input_ids(vocab_size=1024, length=args.tokens)
    state = next(str(p["state"]) for p in mp.status() if p["id"] == "bnb-cpu-repack-copy")
    print(f"bnb-cpu-repack-copy: {state}; CPU repack path: {bool(F.has_avx512bf16())}")
    print(f"model: Llama hidden={args.hidden}, {scenario.NUM_LAYERS} layers, layers "
          f"{list(scenario.OFFLOADED_LAYERS)} on disk, CPU main, {args.tokens} tokens, {args.repeats} rounds")
    import os

    import accelerate
    import torch

    print("load average (1/5/15 min) at the start: %.1f/%.1f/%.1f" % os.getloadavg())
    for quant_type, double_quant in (("nf4", True), ("fp4", False)):
        config = scenario.quant_config(quant_type, double_quant, "bfloat16")
        in_memory = scenario.load_quantized(work / "base", config)
        models = {"disk": scenario.dispatch(scenario.load_quantized(work / "base", config),
                                            work / f"{quant_type}-{double_quant}"),
                  # the same disk offload with bitsandbytes' own repack at every forward (no byte layout)
                  "disk-bnb": scenario.dispatch(scenario.load_quantized(work / "base", config),
                                                work / f"{quant_type}-{double_quant}-bnb"),
                  "cpu": scenario.load_quantized(work / "base", config)}
        for i in scenario.OFFLOADED_LAYERS:  # the same layers offloaded to CPU RAM (accelerate.cpu_offload)
            accelerate.cpu_offload(models["cpu"].model.layers[i], execution_device=torch.device("cpu"))
        for kind, model in (("in-memory", in_memory), *models.items()):
            with bitsandbytes_repack(kind == "disk-bnb"):
                forward_seconds(model, ids), forward_seconds(model, ids)  # warm-up: first repacks, proofs
        times = {"in-memory": [], "disk": [], "disk-bnb": [], "cpu": []}
        profiles = {}
        for _ in range(args.repeats):  # interleaved: one forward of each per round
            for kind in ("disk", "disk-bnb", "cpu", "in-memory"):
                model = in_memory if kind == "in-memory" else models[kind]
                with bitsandbytes_repack(kind == "disk-bnb"), profiled() as totals:
                    times[kind].append(forward_seconds(model, ids))
                for k, v in totals.items():
                    profiles.setdefault(kind, {}).setdefault(k, 0)
                    profiles[kind][k] += v
        memory = repack_memory({"in_memory": in_memory, **models}, work) if state == "applied" else {}
        n = args.repeats
        weights = sum(m.weight.data.nbytes for _, m in scenario.offloaded_linears(in_memory))
        mem = statistics.median(times["in-memory"])
        print(f"{quant_type}{' dq' if double_quant else ''}: 4-bit weights of layers 1-2: {weights} bytes; "
              f"in-memory forward {mem * 1e3:.1f} ms ({min(times['in-memory']) * 1e3:.1f}-"
              f"{max(times['in-memory']) * 1e3:.1f})")
        for kind in ("disk", "disk-bnb", "cpu", "in-memory"):
            p = {k: v / n for k, v in profiles[kind].items()}
            med = statistics.median(times[kind])
            print(f"  {kind:<10} fwd {med * 1e3:6.1f} ms ({min(times[kind]) * 1e3:.1f}-{max(times[kind]) * 1e3:.1f}) "
                  f"ratio {med / mem:.2f}; per forward: {p['repacks']:.1f} repacks {p['repack_s'] * 1e3:.1f} ms, "
                  f"{p['disk_reads']:.1f} offload reads {p['disk_read_s'] * 1e3:.1f} ms, "
                  f"{p['gemvs']:.1f} 4-bit kernels {p['gemv_s'] * 1e3:.1f} ms, rest "
                  f"{(med - p['repack_s'] - p['disk_read_s'] - p['gemv_s']) * 1e3:.1f} ms")
        print(f"  repacked copies: {memory}")
    print("load average (1/5/15 min) at the end: %.1f/%.1f/%.1f" % os.getloadavg())

if __name__ == "__main__":
    main()
