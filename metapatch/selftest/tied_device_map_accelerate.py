"""Reproducers for tied-device-map-accelerate: accelerate's infer_auto_device_map (PEFT's re-dispatch)
with tied weights, swept over budgets on a tiny DiffusionGemma (n/a before transformers 5.11) and a
tied tiny Llama, each as loaded and as a meta copy built under init_empty_weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Expect, Scenario
from ._tied import FRACTIONS, LOGITS_TOLERANCE, budget_grid, diffusion_gemma_class, llama_sweep, model_bytes, save_tiny, sweep_budgets

PATCH_ID = "tied-device-map-accelerate"

def accelerate_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """accelerate's infer_auto_device_map (PEFT's re-dispatch) on the tied tiny model and on an
    untied meta copy built under init_empty_weights."""
    from accelerate import infer_auto_device_map, init_empty_weights
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

    path, _ = save_tiny(workdir / "ckpt")
    tied = DiffusionGemmaForBlockDiffusion.from_pretrained(path)
    with init_empty_weights():
        untied = DiffusionGemmaForBlockDiffusion(tied.config)
    problems = []
    for model in (tied, untied):
        total = model_bytes(model)
        budgets = budget_grid(total, FRACTIONS, 0) + budget_grid(total, FRACTIONS, 2)
        problems += sweep_budgets(model, infer_auto_device_map, budgets,
                                  no_split_module_classes=list(model._no_split_modules))
    if problems:
        raise AssertionError(f"{len(problems)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0}


def accelerate_llama_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """accelerate's infer_auto_device_map over budgets on a tied Llama (loaded and meta)."""
    from accelerate import infer_auto_device_map

    problems = llama_sweep(infer_auto_device_map)
    if problems:
        raise AssertionError(f"{len(problems)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0}



SCENARIOS = [
    Scenario(PATCH_ID, "budget-sweep", f"{__name__}:accelerate_budget_sweep",
             "accelerate infer_auto_device_map over budgets, tied model and untied meta model",
             expected_error="AssertionError", in_selftest=False, tolerance=LOGITS_TOLERANCE),
    Scenario(PATCH_ID, "tied-llama-budget-sweep", f"{__name__}:accelerate_llama_budget_sweep",
             "accelerate infer_auto_device_map over 22 budgets on a tied Llama (loaded, and meta)",
             expected_error="AssertionError", tolerance=LOGITS_TOLERANCE, unpatched=(
                 # transformers 5 builds meta models untied (ties declared only): accelerate splits the pair
                 Expect("AssertionError", when={"transformers": ">=5.0.0.dev0"}), Expect(""))),
]
