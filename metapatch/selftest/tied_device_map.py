"""Reproducers for tied-weight-aware device maps (DiffusionGemma's regex-tied encoder/decoder).

The DiffusionGemma scenarios build a tiny random DiffusionGemma, load it the way the seed report did,
and compare with the in-memory model; where the installed transformers has no DiffusionGemma (it
arrived in 5.11) they raise :class:`~metapatch.selftest.NotApplicable`. The same bugs are also
reproduced on classes every supported transformers has (a tiny Llama, untied and tied through
``tie_word_embeddings``) and, for accelerate's meta-pointer bug, on a plain torch module.
"""

from __future__ import annotations

import inspect

import warnings
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from . import NotApplicable
from ._harness import Scenario

TRANSFORMERS_PATCH = "tied-device-map-transformers"
ACCELERATE_PATCH = "tied-device-map-accelerate"
DISK_INDEX_PATCH = "tied-device-map-disk-index"
META_POINTER_PATCH = "tied-device-map-meta-pointer"
EMBEDDINGS_PATCH = "diffusion-gemma-offloaded-embeddings"
V4_PATCH = "tied-device-map-transformers-v4"

PROMPT = [[5, 6, 7, 8, 9, 10]]
# Offloaded layers run the same float32 ops, but upstream transformers 5.24 already differs from the
# in-memory model by ~1e-7 at some budgets (accumulation order); anything past this is a wrong weight.
LOGITS_TOLERANCE = 1e-5
CANVAS = [[11, 12, 13, 14]]


NEEDS_DIFFUSION_GEMMA = "needs transformers >= 5.11 (DiffusionGemmaForBlockDiffusion)"


class ModelUnavailable(NotApplicable):
    """The installed transformers has no DiffusionGemma: the scenario does not apply (n/a)."""


def has_diffusion_gemma() -> bool:
    try:
        from transformers import DiffusionGemmaForBlockDiffusion  # noqa: F401
    except ImportError:
        return False
    return True


def diffusion_gemma_class() -> Any:
    """The model class, or NotApplicable (never an ImportError) where this transformers has none."""
    try:
        from transformers import DiffusionGemmaForBlockDiffusion
    except ImportError:
        raise ModelUnavailable(NEEDS_DIFFUSION_GEMMA) from None
    return DiffusionGemmaForBlockDiffusion


def tiny_config() -> Any:
    if not has_diffusion_gemma():
        raise ModelUnavailable(NEEDS_DIFFUSION_GEMMA)
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
        raise ModelUnavailable(NEEDS_DIFFUSION_GEMMA)
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
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

    with torch.device("meta"):
        return DiffusionGemmaForBlockDiffusion(config).to(getattr(torch, dtype))


def save_tiny(path: Path, seed: int = 0) -> Tuple[Path, Any]:
    import torch
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

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
        # One self-conditioned decoder pass, as generate()'s later denoising steps make: the decoder
        # then reads embed_tokens.weight directly. Offloaded, that is meta, and torch 2.13's cpu @ meta
        # matmul returns uninitialised memory instead of raising, so the few greedy tokens above can
        # still come out right by chance (measured on 5.23.0); these logits cannot.
        conditioned = None
        if "self_conditioning_logits" in inspect.signature(model.forward).parameters:
            soft = torch.randn(1, len(CANVAS[0]), model.config.get_text_config().vocab_size,
                               generator=torch.Generator().manual_seed(1))
            conditioned = model(input_ids=torch.tensor(PROMPT), decoder_input_ids=torch.tensor(CANVAS),
                                self_conditioning_logits=soft).logits
    sequences = getattr(generated, "sequences", generated)
    return {"logits": logits, "generated": sequences, "conditioned": conditioned}


def compare(loaded: Any, reference: Any) -> float:
    import torch

    got, want = outputs(loaded), outputs(reference)
    if not torch.equal(got["generated"], want["generated"]):
        raise AssertionError(f"generate differs: {got['generated'].tolist()} != {want['generated'].tolist()}")
    diff = float((got["logits"].float() - want["logits"].float()).abs().max())
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"logits differ from the in-memory model (max abs diff {diff})")
    if want["conditioned"] is not None:
        conditioned = float((got["conditioned"].float() - want["conditioned"].float()).abs().max())
        if not conditioned <= LOGITS_TOLERANCE:  # NaN fails too
            raise AssertionError(f"self-conditioned logits differ from the in-memory model (max abs diff {conditioned})")
        diff = max(diff, conditioned)
    return diff


def check_dispatched(model: Any) -> None:
    from ._models import meta_parameters

    device_map = model.hf_device_map  # AttributeError where from_pretrained never dispatched
    stray = meta_parameters(model)
    if stray:
        raise AssertionError(f"{len(stray)} parameters left on meta with no offload hook, e.g. {stray[:3]} "
                             f"(device map {dict(device_map)})")


def load_auto(workdir: Path, budget_fraction: float) -> Dict[str, Any]:
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

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
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()

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


# ---------------------------------------------------------------------------------------------
# The same bugs on a tiny Llama (every supported transformers has it), untied and tied through
# tie_word_embeddings, and accelerate's meta-pointer bug on a plain torch module.

LLAMA_GREEDY_TOKENS = 4


def _llama_outputs(model: Any) -> Dict[str, Any]:
    import torch

    from ._models import input_ids

    ids = input_ids()
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=LLAMA_GREEDY_TOKENS, do_sample=False)
    return {"logits": logits, "tokens": tokens}


def _compare_llama(loaded: Any, reference: Any) -> float:
    import torch

    from ._models import max_abs_diff

    got, want = _llama_outputs(loaded), _llama_outputs(reference)
    diff = max_abs_diff(got["logits"], want["logits"])
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"logits differ from the in-memory model (max abs diff {diff})")
    if not torch.equal(got["tokens"], want["tokens"]):
        raise AssertionError(f"greedy tokens differ: {got['tokens'].tolist()} != {want['tokens'].tolist()}")
    return diff


def _load_llama(workdir: Path, tie: bool, **load_kwargs: Any) -> Dict[str, Any]:
    from transformers import LlamaForCausalLM

    from ._models import save_tiny_llama

    path = save_tiny_llama(workdir / "ckpt", tie_word_embeddings=tie)
    reference = LlamaForCausalLM.from_pretrained(path).eval()
    if load_kwargs.get("max_memory") == "fraction":
        load_kwargs["max_memory"] = {"cpu": int(model_bytes(reference) * load_kwargs.pop("fraction"))}
    loaded = LlamaForCausalLM.from_pretrained(path, offload_folder=str(workdir / "offload"), **load_kwargs).eval()
    diff = _compare_llama(loaded, reference)
    device_map = getattr(loaded, "hf_device_map", None)
    if device_map is None:  # a one-device map is loaded in place, not dispatched: nothing may be on meta
        on_meta = [n for n, p in loaded.named_parameters() if p.is_meta]
        if on_meta:
            raise AssertionError(f"{len(on_meta)} parameters left on meta with no device map, e.g. {on_meta[:3]}")
        return {"max_abs_diff": diff, "devices": sorted({str(p.device) for p in loaded.parameters()})}
    check_dispatched(loaded)
    return {"max_abs_diff": diff, "devices": sorted(map(str, set(device_map.values())))}


def untied_llama_all_offload(workdir: Path) -> Dict[str, Any]:
    """device_map="auto" with a cpu budget of 10% of an untied Llama: nothing fits on cpu, the map is
    all disk. transformers 5.0-5.12 never dispatch a one-device map (weights left on meta); 5.13+
    hand it to accelerate, which before 1.15 refuses ("offload the whole model to the disk");
    4.57 fails while loading ("device disk is invalid")."""
    return _load_llama(workdir, False, device_map="auto", max_memory="fraction", fraction=0.1)


def tied_llama_all_offload(workdir: Path) -> Dict[str, Any]:
    """The same with tie_word_embeddings=True."""
    return _load_llama(workdir, True, device_map="auto", max_memory="fraction", fraction=0.1)


LLAMA_SPLIT_MAP = {"model": "cpu", "lm_head": "disk"}


def tied_llama_explicit_split(workdir: Path) -> Dict[str, Any]:
    """An explicit map with the tied lm_head on disk and its source (embed_tokens) on cpu: the head has
    no value on disk (KeyError 'lm_head.weight' at the first forward), every release."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _load_llama(workdir, True, device_map=dict(LLAMA_SPLIT_MAP))
    named = [str(w.message) for w in caught if "lm_head.weight" in str(w.message) and "metapatch" in str(w.message)]
    return {**result, "warned_pairs": bool(named)}


LLAMA_BOTH_ON_DISK_MAP = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu",
                          "model.rotary_emb": "cpu", "lm_head": "disk"}


def tied_llama_both_on_disk(workdir: Path) -> Dict[str, Any]:
    """A tied pair both offloaded to disk: only the source is in the checkpoint, so before transformers
    5.13 the offload index has no entry for lm_head.weight (KeyError at the first forward)."""
    return _load_llama(workdir, True, device_map=dict(LLAMA_BOTH_ON_DISK_MAP))


def _two_tied_groups_module() -> Any:
    import torch.nn as nn

    class TwoTiedPairs(nn.Module):
        """Two tied pairs of different shapes, the way DiffusionGemma ties several tensors at once."""

        def __init__(self) -> None:
            super().__init__()
            self.embed_a = nn.Embedding(16, 8)
            self.embed_b = nn.Embedding(16, 12)
            self.mix = nn.Linear(20, 20)
            self.head_a = nn.Linear(8, 16, bias=False)
            self.head_b = nn.Linear(12, 16, bias=False)
            self.head_a.weight = self.embed_a.weight
            self.head_b.weight = self.embed_b.weight

        def forward(self, ids: Any) -> Any:
            import torch

            hidden = self.mix(torch.cat([self.embed_a(ids), self.embed_b(ids)], dim=-1))
            return self.head_a(hidden[..., :8]) + self.head_b(hidden[..., 8:])

    return TwoTiedPairs


def meta_pointer_two_tied_groups(workdir: Path) -> Dict[str, Any]:
    """accelerate's load_checkpoint_and_dispatch of a meta model with two tied groups on disk: before
    1.15 every meta tensor reports data_ptr() 0, the groups share one cache slot and one tied module
    receives the other's weight (a shape error, or a wrong result)."""
    import torch
    from accelerate import dispatch_model, init_empty_weights, load_checkpoint_in_model
    from safetensors.torch import save_file

    module_class = _two_tied_groups_module()
    torch.manual_seed(0)
    reference = module_class().eval()
    # Every name stored (tied copies as their own tensors), as a checkpoint written by torch.save would be:
    # the scenario is about the hooks' cache of tied weights, not about missing checkpoint entries.
    state = {name: tensor.detach().clone().contiguous() for name, tensor in reference.state_dict().items()}
    save_file(state, str(workdir / "model.safetensors"), metadata={"format": "pt"})
    with init_empty_weights():
        model = module_class()
    device_map = {"embed_a": "disk", "embed_b": "disk", "mix": "cpu", "head_a": "disk", "head_b": "disk"}
    offload = workdir / "offload"
    load_checkpoint_in_model(model, str(workdir / "model.safetensors"), device_map=device_map,
                             offload_folder=str(offload))
    # Loading replaces each parameter on its own; tie again, as transformers does before dispatching.
    model.head_a.weight = model.embed_a.weight
    model.head_b.weight = model.embed_b.weight
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload)).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        got, want = model(ids), reference(ids)
    diff = float((got - want).abs().max())
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"outputs differ from the in-memory module (max abs diff {diff})")
    return {"max_abs_diff": diff}


EMBEDDING_OFFLOAD_MAP = {"model.encoder.language_model": "disk", "model.encoder.vision_tower": "cpu",
                         "model.encoder.embed_vision": "cpu", "model.decoder": "disk", "lm_head": "disk"}


def generate_with_offloaded_embedding(workdir: Path) -> Dict[str, Any]:
    """DiffusionGemma generate() with the (tied) embeddings offloaded to disk: the decoder reads
    embed_tokens.weight outside the embedding's hook, on meta (NaN probabilities)."""
    DiffusionGemmaForBlockDiffusion = diffusion_gemma_class()
    path, reference = save_tiny(workdir / "ckpt")
    loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, device_map=dict(EMBEDDING_OFFLOAD_MAP), offload_folder=str(workdir / "offload")).eval()
    diff = compare(loaded, reference)
    check_dispatched(loaded)
    return {"max_abs_diff": diff}


def _tied_llama_models() -> Tuple[Any, Any]:
    """A tied tiny Llama as loaded (one tensor) and its meta copy built under init_empty_weights."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from ._models import tiny_llama_config

    config = tiny_llama_config(tie_word_embeddings=True)
    tied = LlamaForCausalLM(config)
    with init_empty_weights():
        meta = LlamaForCausalLM(config)
    return tied, meta


def _llama_sweep(infer: Any) -> List[str]:
    problems: List[str] = []
    for model in _tied_llama_models():
        total = model_bytes(model)
        budgets = budget_grid(total, FRACTIONS, 0) + budget_grid(total, FRACTIONS, 2)
        problems += sweep_budgets(model, infer, budgets, no_split_module_classes=["LlamaDecoderLayer"])
    return problems


def transformers_llama_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """transformers' infer_auto_device_map over budgets on a tied Llama (loaded and meta)."""
    try:
        from transformers.integrations.accelerate import infer_auto_device_map
    except ImportError:
        raise NotApplicable("needs transformers >= 5.0 (its own infer_auto_device_map)") from None
    problems = _llama_sweep(infer_auto_device_map)
    if problems:
        raise AssertionError(f"{len(problems)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0}


def accelerate_llama_budget_sweep(workdir: Path) -> Dict[str, Any]:
    """accelerate's infer_auto_device_map over budgets on a tied Llama (loaded and meta)."""
    from accelerate import infer_auto_device_map

    problems = _llama_sweep(infer_auto_device_map)
    if problems:
        raise AssertionError(f"{len(problems)} budgets went wrong: " + " | ".join(problems[:4]))
    return {"max_abs_diff": 0.0}


def _transformers_major() -> int:
    import importlib.metadata

    return int(importlib.metadata.version("transformers").split(".")[0])


def _for_transformers_5(workdir: Path, scenario: Any) -> Dict[str, Any]:
    """The Llama scenarios under the 5.x patches; transformers 4.57 has the same bugs in other
    functions, covered (and reproduced by the same scenarios) under tied-device-map-transformers-v4."""
    if _transformers_major() < 5:
        raise NotApplicable(f"transformers < 5: see {V4_PATCH}, which runs this scenario there")
    return scenario(workdir)


def _for_transformers_4(workdir: Path, scenario: Any) -> Dict[str, Any]:
    if _transformers_major() >= 5:
        raise NotApplicable(f"needs transformers < 5 (5.x: see {TRANSFORMERS_PATCH} and {DISK_INDEX_PATCH})")
    return scenario(workdir)


def untied_llama_all_offload_5(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_5(workdir, untied_llama_all_offload)


def tied_llama_all_offload_5(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_5(workdir, tied_llama_all_offload)


def tied_llama_explicit_split_5(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_5(workdir, tied_llama_explicit_split)


def tied_llama_both_on_disk_5(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_5(workdir, tied_llama_both_on_disk)


def untied_llama_all_offload_4(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_4(workdir, untied_llama_all_offload)


def tied_llama_all_offload_4(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_4(workdir, tied_llama_all_offload)


def tied_llama_explicit_split_4(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_4(workdir, tied_llama_explicit_split)


def tied_llama_both_on_disk_4(workdir: Path) -> Dict[str, Any]:
    return _for_transformers_4(workdir, tied_llama_both_on_disk)


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
    Scenario(TRANSFORMERS_PATCH, "untied-llama-all-offload", f"{__name__}:untied_llama_all_offload_5",
             "untied Llama, device_map='auto' with a cpu budget of 10% of the model: the map is all disk; "
             "5.0-5.12 never dispatch it (meta tensors), 5.13+ with accelerate < 1.15 get 'offload the whole "
             "model to the disk'", expected_error="RuntimeError"),
    Scenario(TRANSFORMERS_PATCH, "tied-llama-all-offload", f"{__name__}:tied_llama_all_offload_5",
             "the same on a Llama with tie_word_embeddings=True", expected_error="RuntimeError"),
    Scenario(TRANSFORMERS_PATCH, "tied-llama-explicit-split", f"{__name__}:tied_llama_explicit_split_5",
             "explicit device_map with the tied lm_head on disk and embed_tokens on cpu: KeyError "
             "'lm_head.weight' at the first forward", expected_error="KeyError"),
    Scenario(DISK_INDEX_PATCH, "tied-llama-both-on-disk", f"{__name__}:tied_llama_both_on_disk_5",
             "tied Llama with embed_tokens and lm_head both on disk: no offload-index entry for the tied "
             "copy before transformers 5.13 (KeyError 'lm_head.weight')", expected_error="KeyError"),
    Scenario(META_POINTER_PATCH, "two-tied-groups-on-disk", f"{__name__}:meta_pointer_two_tied_groups",
             "load_checkpoint_and_dispatch of a meta module with two tied pairs on disk: before accelerate "
             "1.15 both share the meta pointer 0 and one gets the other's weight", expected_error="RuntimeError"),
    Scenario(EMBEDDINGS_PATCH, "generate-offloaded-embedding", f"{__name__}:generate_with_offloaded_embedding",
             "DiffusionGemma generate() with the tied embeddings on disk: the decoder's direct "
             "embed_tokens.weight read sees meta (NaN probabilities)", expected_error="RuntimeError"),
    Scenario(TRANSFORMERS_PATCH, "tied-llama-budget-sweep", f"{__name__}:transformers_llama_budget_sweep",
             "transformers infer_auto_device_map over 22 budgets on a tied Llama (loaded, and meta)",
             expected_error="AssertionError", in_selftest=False),
    Scenario(ACCELERATE_PATCH, "tied-llama-budget-sweep", f"{__name__}:accelerate_llama_budget_sweep",
             "accelerate infer_auto_device_map over 22 budgets on a tied Llama (loaded, and meta)",
             expected_error="AssertionError"),
    Scenario(V4_PATCH, "untied-llama-all-offload", f"{__name__}:untied_llama_all_offload_4",
             "transformers 4.57: untied Llama, device_map='auto', cpu budget 10%: SafetensorError 'device disk is "
             "invalid' while loading", expected_error="SafetensorError"),
    Scenario(V4_PATCH, "tied-llama-all-offload", f"{__name__}:tied_llama_all_offload_4",
             "transformers 4.57: the same with tie_word_embeddings=True", expected_error="SafetensorError"),
    Scenario(V4_PATCH, "tied-llama-explicit-split", f"{__name__}:tied_llama_explicit_split_4",
             "transformers 4.57: tied lm_head on disk, embed_tokens on cpu: KeyError 'lm_head.weight'",
             expected_error="KeyError"),
    Scenario(V4_PATCH, "tied-llama-both-on-disk", f"{__name__}:tied_llama_both_on_disk_4",
             "transformers 4.57: embed_tokens and the tied lm_head both on disk: KeyError 'lm_head.weight'",
             expected_error="KeyError"),
]
