"""Reproducers for tied-device-map-transformers: transformers' device-map inference and loading with
tied weights. On a tiny DiffusionGemma (regex-tied encoder/decoder; n/a before transformers 5.11) as
the seed report loaded it, and the same bugs on a tiny Llama, untied and tied through
``tie_word_embeddings`` (transformers 5; on 4.57 the same scenarios run under
tied-device-map-transformers-v4).

Devices: ``device_map="auto"`` gets its budget on the execution device's memory (on a GPU machine the
same total split between GPU 0 and the CPU: ``_device.memory_budget``), explicit maps put their memory entries
there (``_tied.on_main``), and the all-offload scenarios are pinned to the CPU: a map that is all disk
computes on the CPU on any machine (``from_pretrained`` dispatches it with a CPU main device)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict

from . import NotApplicable
from ._device import memory_budget
from ._harness import Expect, Scenario
from ._tied import (FRACTIONS, LOGITS_TOLERANCE, budget_grid, check_dispatched, compare, diffusion_gemma_class,
                    execution_device_of, llama_sweep, load_llama, model_bytes, on_main, save_tiny, sweep_budgets)

PATCH_ID = "tied-device-map-transformers"
TRANSFORMERS_5 = {"transformers": ">=5.0.0.dev0"}  # 4.57: tied-device-map-transformers-v4 runs these

def load_auto(workdir: Path, budget_fraction: float) -> Dict[str, Any]:
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

    path, reference = save_tiny(workdir / "ckpt")
    budget = int(model_bytes(reference) * budget_fraction)
    offload = workdir / "offload"
    loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, device_map="auto", max_memory=memory_budget(budget), offload_folder=str(offload)).eval()
    diff = compare(loaded, reference)  # the seed's symptom first: generate() on meta tensors
    check_dispatched(loaded)
    return {"max_abs_diff": diff, "cpu_budget": budget, "devices": sorted(map(str, set(loaded.hf_device_map.values()))),
            "computed_on": execution_device_of(loaded)}


def auto_map_moderate_budget(workdir: Path) -> Dict[str, Any]:
    """transformers 5.11-5.12: the map becomes {"": "disk"} and nothing is dispatched."""
    return load_auto(workdir, 0.6)


def auto_map_small_budget(workdir: Path) -> Dict[str, Any]:
    """Every release: IndexError in get_module_size_with_ties."""
    return load_auto(workdir, 0.1)


SPLIT_MAP = {"model.encoder": "cpu", "model.decoder": "disk", "lm_head": "disk"}


def explicit_map_splitting_ties(workdir: Path) -> Dict[str, Any]:
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

    path, reference = save_tiny(workdir / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
            path, device_map=on_main(SPLIT_MAP), offload_folder=str(workdir / "offload")).eval()
    diff = compare(loaded, reference)
    check_dispatched(loaded)
    named = [str(w.message) for w in caught if "tied" in str(w.message) and "model.encoder" in str(w.message)]
    return {"max_abs_diff": diff, "warned_pairs": bool(named), "warning": named[0][:300] if named else ""}


def transformers_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """transformers' own infer_auto_device_map over budgets, cpu/disk and two simulated GPUs, on the
    tiny model as loaded (tied): no exception, all mapped, groups whole, budgets kept."""
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()
    from transformers.integrations.accelerate import infer_auto_device_map

    path, _ = save_tiny(workdir / "ckpt")
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path)
    total = model_bytes(model)
    budgets = budget_grid(total, FRACTIONS, 0) + budget_grid(total, FRACTIONS, 2)
    problems = sweep_budgets(model, infer_auto_device_map, budgets,
                             no_split_module_classes=model._no_split_modules)
    if problems:
        raise AssertionError(f"{len(problems)} of {len(budgets)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0, "budgets": len(budgets)}


def untied_llama_all_offload(workdir: Path) -> Dict[str, Any]:
    """device_map="auto" with a cpu budget of 10% of an untied Llama: nothing fits on cpu, the map is
    all disk. transformers 5.0-5.12 never dispatch a one-device map (weights left on meta); 5.13+
    hand it to accelerate, which before 1.15 refuses ("offload the whole model to the disk");
    4.57 fails while loading ("device disk is invalid")."""
    return load_llama(workdir, False, device_map="auto", max_memory="fraction", fraction=0.1)


def tied_llama_all_offload(workdir: Path) -> Dict[str, Any]:
    """The same with tie_word_embeddings=True."""
    return load_llama(workdir, True, device_map="auto", max_memory="fraction", fraction=0.1)


LLAMA_SPLIT_MAP = {"model": "cpu", "lm_head": "disk"}


def tied_llama_explicit_split(workdir: Path) -> Dict[str, Any]:
    """An explicit map with the tied lm_head on disk and its source (embed_tokens) on cpu: the head has
    no value on disk (KeyError 'lm_head.weight' at the first forward), every release."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load_llama(workdir, True, device_map=on_main(LLAMA_SPLIT_MAP))
    named = [str(w.message) for w in caught if "lm_head.weight" in str(w.message) and "metapatch" in str(w.message)]
    return {**result, "warned_pairs": bool(named)}


def transformers_llama_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """transformers' infer_auto_device_map over budgets on a tied Llama (loaded and meta)."""
    try:
        from transformers.integrations.accelerate import infer_auto_device_map
    except ImportError:
        raise NotApplicable("needs transformers >= 5.0 (its own infer_auto_device_map)") from None
    problems = llama_sweep(infer_auto_device_map)
    if problems:
        raise AssertionError(f"{len(problems)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0}




# The seed's symptom where nothing was dispatched: a forward or generate() on meta placeholders.
ON_META = r"(?s)(?=.*meta).*(?:Tensor\.item\(\)|device meta)"
WHOLE_MODEL_TO_DISK = {"transformers": ">=5.11,<5.13.0.dev0"}  # the releases that map it all to disk
# A map that is all disk, without metapatch (measured): never dispatched on 5.0-5.12 (meta tensors),
# refused by accelerate < 1.15 on 5.13+, dispatched correctly with accelerate 1.15.
ALL_DISK_UNPATCHED = (
    Expect("RuntimeError", ON_META, when=WHOLE_MODEL_TO_DISK),
    Expect("RuntimeError", when={"transformers": ">=5.0,<5.13.0.dev0"}),
    Expect("ValueError", "offload the whole model to the disk", when={"accelerate": ">=1.0,<1.15.0.dev0"}),
    Expect(""),
)
LM_HEAD_HAS_NO_VALUE = (Expect("KeyError", "lm_head.weight"),)  # every release
ALL_DISK_ON_CPU = {"device": "cpu", "device_reason": "a map that is all disk computes on the CPU on any machine "
                                                     "(from_pretrained dispatches it with a CPU main device)"}

SCENARIOS = [
    Scenario(PATCH_ID, "auto-map-moderate-budget", f"{__name__}:auto_map_moderate_budget",
             "from_pretrained(device_map='auto', cpu budget 60% of the model, offload_folder): on 5.11-5.12 the "
             "map is {'': 'disk'}, nothing is dispatched and generate() hits meta tensors",
             expected_error="RuntimeError", tolerance=LOGITS_TOLERANCE, unpatched=(
                 Expect("RuntimeError", ON_META, when=WHOLE_MODEL_TO_DISK),
                 # 5.13+: dispatched, but accelerate < 1.15 hands one tied weight to every meta tensor
                 Expect("RuntimeError", when={"accelerate": ">=1.0,<1.15.0.dev0"}),
                 Expect(""))),
    Scenario(PATCH_ID, "auto-map-small-budget", f"{__name__}:auto_map_small_budget",
             "from_pretrained(device_map='auto', cpu budget 10% of the model): IndexError in "
             "get_module_size_with_ties", expected_error="IndexError", expected_message="list index out of range",
             tolerance=LOGITS_TOLERANCE, quick=True),
    Scenario(PATCH_ID, "explicit-map-split-group", f"{__name__}:explicit_map_splitting_ties",
             "explicit device_map with model.encoder on cpu and the decoder it is tied to on disk",
             expected_error="ValueError", expected_message="weight is on the meta device", in_selftest=False,
             tolerance=LOGITS_TOLERANCE),
    Scenario(PATCH_ID, "budget-sweep", f"{__name__}:transformers_budget_sweep",
             "transformers infer_auto_device_map over 22 budgets (cpu/disk, 2 simulated GPUs): every parameter "
             "mapped, tied groups whole, budgets kept", expected_error="AssertionError", in_selftest=False,
             tolerance=LOGITS_TOLERANCE),
    Scenario(PATCH_ID, "untied-llama-all-offload", f"{__name__}:untied_llama_all_offload",
             "untied Llama, device_map='auto' with a cpu budget of 10% of the model: the map is all disk; "
             "5.0-5.12 never dispatch it (meta tensors), 5.13+ with accelerate < 1.15 get 'offload the whole "
             "model to the disk'", expected_error="RuntimeError", requires=TRANSFORMERS_5,
             unpatched=ALL_DISK_UNPATCHED, tolerance=LOGITS_TOLERANCE, **ALL_DISK_ON_CPU),
    Scenario(PATCH_ID, "tied-llama-all-offload", f"{__name__}:tied_llama_all_offload",
             "the same on a Llama with tie_word_embeddings=True", expected_error="RuntimeError",
             requires=TRANSFORMERS_5, unpatched=ALL_DISK_UNPATCHED, tolerance=LOGITS_TOLERANCE, **ALL_DISK_ON_CPU),
    Scenario(PATCH_ID, "tied-llama-explicit-split", f"{__name__}:tied_llama_explicit_split",
             "explicit device_map with the tied lm_head on disk and embed_tokens on cpu: KeyError "
             "'lm_head.weight' at the first forward", expected_error="KeyError", requires=TRANSFORMERS_5,
             unpatched=LM_HEAD_HAS_NO_VALUE, tolerance=LOGITS_TOLERANCE),
    Scenario(PATCH_ID, "tied-llama-budget-sweep", f"{__name__}:transformers_llama_budget_sweep",
             "transformers infer_auto_device_map over 22 budgets on a tied Llama (loaded, and meta)",
             expected_error="AssertionError", in_selftest=False, tolerance=LOGITS_TOLERANCE,
             # a regression guard: transformers' own maps of a tied Llama were right (measured 5.0, 5.11)
             unpatched=(Expect(""),)),
]
