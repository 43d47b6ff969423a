"""Map inference for DiffusionGemma 26B-A4B on meta (and the stack scaled from 30 to 120 layers):
metapatch's tie-aware ``infer_auto_device_map`` against transformers' own, on the same model.

    python benchmarks/bench_tied_device_map.py [--layers 30 60 90 120] [--rounds 7]

Prints one row per size: tensors, tied groups, upstream seconds (or the error it raised), patched
seconds, and the median of the per-round ratios (upstream and patched alternate within each round,
so machine load hits both alike), and patched microseconds per tensor (flat when the cost grows
linearly). Both run the same allocator; the difference is metapatch's group resolution, size
de-duplication and placement.
"""

from __future__ import annotations

import argparse
import statistics
import time

GiB = 1 << 30
BUDGETS = {
    "2x44GiB+cpu": {0: 44 * GiB, 1: 44 * GiB, "cpu": 64 * GiB},
    "2x12GiB+cpu": {0: 12 * GiB, 1: 12 * GiB, "cpu": 16 * GiB},
}


def timed(func) -> float:
    started = time.perf_counter()
    func()
    return time.perf_counter() - started


def interleaved(rounds: int, base, patched):
    """(median base s, median patched s, median of per-round patched/base ratios); base None when
    upstream has no unpatched function; the exception class name when upstream raises."""
    base_times, patched_times, ratios = [], [], []
    for _ in range(rounds):
        if base is not None:
            base_times.append(timed(base))
        patched_times.append(timed(patched))
        if base is not None:
            ratios.append(patched_times[-1] / base_times[-1])
    median = statistics.median
    return (median(base_times) if base_times else None), median(patched_times), \
        (median(ratios) if ratios else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[30, 60, 90, 120])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import logging
    import warnings

    import metapatch  # noqa: F401 - installs the patch
    from metapatch._offload.tied_members import tied_groups
    from metapatch.selftest import _tied as sc

    warnings.filterwarnings("ignore")
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    import transformers
    from transformers.integrations.accelerate import infer_auto_device_map

    upstream = getattr(infer_auto_device_map, "__wrapped__", None)
    print(f"transformers {transformers.__version__}; patched: {upstream is not None}")
    print(f"{'layers':>6} {'budget':>12} {'tensors':>8} {'groups':>7} {'upstream s':>12} {'patched s':>10} "
          f"{'ratio':>6} {'us/tensor':>9}")
    for layers in args.layers:
        model = sc.meta_model(sc.full_size_config(num_layers=layers))
        tensors = sum(1 for _ in model.named_parameters(remove_duplicate=False))
        groups = len(tied_groups(model))
        for label, budget in BUDGETS.items():
            kwargs = dict(no_split_module_classes=model._no_split_modules)
            run_patched = lambda: infer_auto_device_map(model, max_memory=dict(budget), **kwargs)  # noqa: E731
            run_base = (lambda: upstream(model, max_memory=dict(budget), **kwargs)) if upstream else None  # noqa: E731
            try:
                base, patched, ratio = interleaved(args.rounds, run_base, run_patched)
                base_text = f"{base:12.3f}" if base is not None else f"{'-':>12}"
                ratio = f"{ratio:6.2f}" if ratio is not None else f"{'-':>6}"
            except Exception as exc:
                patched = interleaved(args.rounds, None, run_patched)[1]
                base_text, ratio = f"{type(exc).__name__:>12}", f"{'-':>6}"
            print(f"{layers:>6} {label:>12} {tensors:>8} {groups:>7} {base_text} {patched:10.3f} {ratio} "
                  f"{patched / tensors * 1e6:9.1f}", flush=True)


if __name__ == "__main__":
    main()
