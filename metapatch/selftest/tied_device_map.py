"""Reproducers for tied-weight-aware device maps (DiffusionGemma's regex-tied encoder/decoder).

Each builds a tiny random DiffusionGemma (skipped where the installed transformers has none: it
arrived in 5.11), loads it the way the seed report did, and compares with the in-memory model.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from ._harness import Scenario

TRANSFORMERS_PATCH = "tied-device-map-transformers"
ACCELERATE_PATCH = "tied-device-map-accelerate"

PROMPT = [[5, 6, 7, 8, 9, 10]]
# Offloaded layers run the same float32 ops, but upstream transformers 5.24 already differs from the
# in-memory model by ~1e-7 at some budgets (accumulation order); anything past this is a wrong weight.
LOGITS_TOLERANCE = 1e-5
CANVAS = [[11, 12, 13, 14]]


class ModelUnavailable(RuntimeError):
    """The installed transformers has no DiffusionGemma: the scenario does not apply."""


def has_diffusion_gemma() -> bool:
    try:
        from transformers import DiffusionGemmaForBlockDiffusion  # noqa: F401
    except ImportError:
        return False
    return True


def tiny_config() -> Any:
    if not has_diffusion_gemma():
        raise ModelUnavailable("transformers has no DiffusionGemma (added in 5.11)")
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    text = DiffusionGemmaTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, num_global_key_value_heads=1, head_dim=16, global_head_dim=16,
        max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4,
                                pooling_kernel_size=2)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=4, boi_token_id=120,
                                eoi_token_id=121, image_token_id=122)


def full_size_config(num_layers: int = 30) -> Any:
    """google/diffusiongemma-26B-A4B-it's published shape (Gemma 4 26B-A4B text stack, 128 experts,
    top-8, 30 layers, 5:1 sliding/global, vocab 262144, ~550M-parameter vision tower), for meta-device
    models only: nothing is downloaded. ``num_layers`` scales the stack for the benchmark."""
    if not has_diffusion_gemma():
        raise ModelUnavailable("transformers has no DiffusionGemma (added in 5.11)")
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    layer_types[-1] = "full_attention"
    text = DiffusionGemmaTextConfig(
        vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=num_layers,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
        global_head_dim=512, sliding_window=1024, layer_types=layer_types, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704)
    vision = Gemma4VisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                num_attention_heads=16, num_key_value_heads=16, head_dim=72)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision)


def meta_model(config: Any, dtype: str = "bfloat16") -> Any:
    """The model on the meta device, in the checkpoint's dtype (bf16 for the released weights)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    with torch.device("meta"):
        return DiffusionGemmaForBlockDiffusion(config).to(getattr(torch, dtype))


def save_tiny(path: Path, seed: int = 0) -> Tuple[Path, Any]:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_config()).eval()
    model.save_pretrained(path)
    return path, model


def model_bytes(model: Any) -> int:
    from .. import _tied_groups as tg

    return sum(tg.bytes_per_device(model, {"": "cpu"}).values())


def outputs(model: Any) -> Dict[str, Any]:
    import torch

    # generate() first and outside no_grad, as the seed report calls it.
    torch.manual_seed(0)  # the denoiser samples (torch.multinomial) even when greedy
    generated = model.generate(input_ids=torch.tensor(PROMPT), max_new_tokens=4, do_sample=False,
                               max_denoising_steps=3)  # a few offloaded decoder passes, not hundreds
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT), decoder_input_ids=torch.tensor(CANVAS)).logits
    sequences = getattr(generated, "sequences", generated)
    return {"logits": logits, "generated": sequences}


def compare(loaded: Any, reference: Any) -> float:
    import torch

    got, want = outputs(loaded), outputs(reference)
    if not torch.equal(got["generated"], want["generated"]):
        raise AssertionError(f"generate differs: {got['generated'].tolist()} != {want['generated'].tolist()}")
    diff = float((got["logits"].float() - want["logits"].float()).abs().max())
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"logits differ from the in-memory model (max abs diff {diff})")
    return diff


def check_dispatched(model: Any) -> None:
    from ._models import meta_parameters

    device_map = model.hf_device_map  # AttributeError where from_pretrained never dispatched
    stray = meta_parameters(model)
    if stray:
        raise AssertionError(f"{len(stray)} parameters left on meta with no offload hook, e.g. {stray[:3]} "
                             f"(device map {dict(device_map)})")


def load_auto(workdir: Path, budget_fraction: float) -> Dict[str, Any]:
    from transformers import DiffusionGemmaForBlockDiffusion

    path, reference = save_tiny(workdir / "ckpt")
    budget = int(model_bytes(reference) * budget_fraction)
    offload = workdir / "offload"
    loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(offload)).eval()
    diff = compare(loaded, reference)  # the seed's symptom first: generate() on meta tensors
    check_dispatched(loaded)
    return {"max_abs_diff": diff, "cpu_budget": budget, "devices": sorted(map(str, set(loaded.hf_device_map.values())))}


def auto_map_moderate_budget(workdir: Path) -> Dict[str, Any]:
    """transformers 5.11-5.12: the map becomes {"": "disk"} and nothing is dispatched."""
    return load_auto(workdir, 0.6)


def auto_map_small_budget(workdir: Path) -> Dict[str, Any]:
    """Every release: IndexError in get_module_size_with_ties."""
    return load_auto(workdir, 0.1)


SPLIT_MAP = {"model.encoder": "cpu", "model.decoder": "disk", "lm_head": "disk"}


def explicit_map_splitting_ties(workdir: Path) -> Dict[str, Any]:
    from transformers import DiffusionGemmaForBlockDiffusion

    path, reference = save_tiny(workdir / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
            path, device_map=dict(SPLIT_MAP), offload_folder=str(workdir / "offload")).eval()
    diff = compare(loaded, reference)
    check_dispatched(loaded)
    named = [str(w.message) for w in caught if "tied" in str(w.message) and "model.encoder" in str(w.message)]
    return {"max_abs_diff": diff, "warned_pairs": bool(named), "warning": named[0][:300] if named else ""}


def sweep_budgets(model: Any, infer: Any, budgets: Sequence[Dict[Any, int]], **kwargs: Any) -> List[str]:
    """Map inference at each budget; the list of what went wrong (empty when all is well)."""
    from .. import _tied_groups as tg

    groups = tg.tied_groups(model)
    problems = []
    for max_memory in budgets:
        try:
            device_map = infer(model, max_memory=dict(max_memory), **kwargs)
        except Exception as exc:  # the finding is the data
            problems.append(f"{max_memory}: {type(exc).__name__}: {exc}"[:300])
            continue
        problems.extend(f"{max_memory}: {p}" for p in map_problems(model, device_map, max_memory, groups))
    return problems


def map_problems(model: Any, device_map: Any, max_memory: Dict[Any, int], groups: Any) -> List[str]:
    from .. import _tied_groups as tg

    problems = []
    unplaced = tg.unplaced_parameters(model, device_map)
    if unplaced:
        problems.append(f"{len(unplaced)} parameters unmapped, e.g. {unplaced[:2]}")
    split = tg.split_groups(model, device_map, groups)
    if split:
        problems.append(f"{len(split)} tied groups split across devices, e.g. {split[0][:2]}")
    if not unplaced:
        used = tg.bytes_per_device(model, device_map, groups)
        over = {d: (used.get(d, 0), b) for d, b in max_memory.items() if used.get(d, 0) > b}
        if over:
            problems.append(f"budgets exceeded (used, budget): {over}")
    return problems


def budget_grid(total: int, fractions: Sequence[float], gpus: int) -> List[Dict[Any, int]]:
    grids: List[Dict[Any, int]] = []
    for fraction in fractions:
        if gpus == 0:
            grids.append({"cpu": int(total * fraction)})
        else:
            share = int(total * fraction / gpus)
            budget: Dict[Any, int] = {i: share for i in range(gpus)}
            budget["cpu"] = int(total * 0.25)
            grids.append(budget)
    return grids


FRACTIONS = (1.5, 1.0, 0.8, 0.6, 0.45, 0.3, 0.2, 0.12, 0.06, 0.02, 0.005)


def transformers_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """transformers' own infer_auto_device_map over budgets, cpu/disk and two simulated GPUs, on the
    tiny model as loaded (tied): no exception, all mapped, groups whole, budgets kept."""
    from transformers import DiffusionGemmaForBlockDiffusion
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


def accelerate_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """accelerate's infer_auto_device_map (PEFT's re-dispatch) on the tied tiny model and on an
    untied meta copy built under init_empty_weights."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import DiffusionGemmaForBlockDiffusion

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


SCENARIOS = [
    Scenario(TRANSFORMERS_PATCH, "auto-map-moderate-budget", f"{__name__}:auto_map_moderate_budget",
             "from_pretrained(device_map='auto', cpu budget 60% of the model, offload_folder): on 5.11-5.12 the "
             "map is {'': 'disk'}, nothing is dispatched and generate() hits meta tensors",
             expected_error="RuntimeError"),
    Scenario(TRANSFORMERS_PATCH, "auto-map-small-budget", f"{__name__}:auto_map_small_budget",
             "from_pretrained(device_map='auto', cpu budget 10% of the model): IndexError in "
             "get_module_size_with_ties", expected_error="IndexError"),
    Scenario(TRANSFORMERS_PATCH, "explicit-map-split-group", f"{__name__}:explicit_map_splitting_ties",
             "explicit device_map with model.encoder on cpu and the decoder it is tied to on disk",
             expected_error="ValueError", in_selftest=False),
    Scenario(TRANSFORMERS_PATCH, "budget-sweep", f"{__name__}:transformers_budget_sweep",
             "transformers infer_auto_device_map over 22 budgets (cpu/disk, 2 simulated GPUs): every parameter "
             "mapped, tied groups whole, budgets kept", expected_error="AssertionError", in_selftest=False),
    Scenario(ACCELERATE_PATCH, "budget-sweep", f"{__name__}:accelerate_budget_sweep",
             "accelerate infer_auto_device_map over budgets, tied model and untied meta model",
             expected_error="AssertionError", in_selftest=False),
]
