"""Models and checks shared by the tied-weight scenarios (``tied-device-map-*``,
``diffusion-gemma-offloaded-embeddings``): a tiny random DiffusionGemma (regex-tied encoder/decoder)
and its published full-size shape on meta, the comparison with the in-memory model, the budget
sweeps of map inference, and a tiny Llama loaded tied or untied. Where the installed transformers has
no DiffusionGemma (it arrived in 5.11) the builders raise :class:`~metapatch.selftest.NotApplicable`.

Where a loaded model computes is what its map says (:func:`execution_device_of`): GPU 0 where the map
has it (explicit maps put their memory entries on the execution device, ``on_main``), the CPU for a map
of cpu and disk only, GPU or not. The in-memory reference computes there too.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from . import NotApplicable

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


def on_main(device_map: Dict[str, Any]) -> Dict[str, Any]:
    """``device_map`` with its memory entries (``"cpu"``) on the execution device (GPU 0 where there is one)."""
    from ._device import main_device

    return {name: main_device() if device == "cpu" else device for name, device in device_map.items()}


def execution_device_of(model: Any) -> str:
    """Where ``model`` computes: the first GPU of its device map where it has one (accelerate's main
    device), else the CPU (a map of cpu and disk only is dispatched with a CPU main device on any
    machine); without a map, where its first parameter is."""
    import torch

    device_map = getattr(model, "hf_device_map", None)
    if device_map is None:
        device = next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
        return str(device)
    gpus = sorted(v if isinstance(v, int) else (torch.device(v).index or 0)
                  for v in device_map.values() if isinstance(v, int) or str(v).startswith("cuda"))
    return f"cuda:{gpus[0]}" if gpus else "cpu"


def outputs(model: Any, device: Any = "cpu") -> Dict[str, Any]:
    import torch

    # generate() first and outside no_grad, as the seed report calls it.
    torch.manual_seed(0)  # the denoiser samples (torch.multinomial) even when greedy
    prompt, canvas = torch.tensor(PROMPT, device=device), torch.tensor(CANVAS, device=device)
    generated = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False,
                               max_denoising_steps=3)  # a few offloaded decoder passes, not hundreds
    with torch.no_grad():
        logits = model(input_ids=prompt, decoder_input_ids=canvas).logits
        # One self-conditioned decoder pass, as generate()'s later denoising steps make: the decoder
        # then reads embed_tokens.weight directly. Offloaded, that is meta, and torch 2.13's cpu @ meta
        # matmul returns uninitialised memory instead of raising, so the few greedy tokens above can
        # still come out right by chance (measured on 5.23.0); these logits cannot.
        conditioned = None
        if "self_conditioning_logits" in inspect.signature(model.forward).parameters:
            soft = torch.randn(1, len(CANVAS[0]), model.config.get_text_config().vocab_size,
                               generator=torch.Generator().manual_seed(1)).to(device)
            conditioned = model(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=soft).logits
    sequences = getattr(generated, "sequences", generated)
    return {"logits": logits, "generated": sequences, "conditioned": conditioned}


def compare(loaded: Any, reference: Any) -> float:
    """The loaded model's outputs against the in-memory ``reference``'s, both computing where the loaded
    model does (the reference is moved there)."""
    import torch

    device = execution_device_of(loaded)
    got, want = outputs(loaded, device), outputs(reference.to(device), device)
    if not torch.equal(got["generated"].cpu(), want["generated"].cpu()):
        raise AssertionError(f"generate differs: {got['generated'].tolist()} != {want['generated'].tolist()}")
    from ._models import max_abs_diff

    diff = max_abs_diff(got["logits"], want["logits"])
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"logits differ from the in-memory model (max abs diff {diff})")
    if want["conditioned"] is not None:
        conditioned = max_abs_diff(got["conditioned"], want["conditioned"])
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


# ---------------------------------------------------------------------------------------------
# A tiny Llama (every supported transformers has it), loaded untied or tied through tie_word_embeddings.

LLAMA_GREEDY_TOKENS = 4


def _llama_outputs(model: Any, device: Any = "cpu") -> Dict[str, Any]:
    import torch

    from ._models import input_ids

    ids = input_ids().to(device)
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=LLAMA_GREEDY_TOKENS, do_sample=False)
    return {"logits": logits, "tokens": tokens}


def _compare_llama(loaded: Any, reference: Any) -> float:
    import torch

    from ._models import max_abs_diff

    device = execution_device_of(loaded)
    got, want = _llama_outputs(loaded, device), _llama_outputs(reference.to(device), device)
    diff = max_abs_diff(got["logits"], want["logits"])
    if diff > LOGITS_TOLERANCE:
        raise AssertionError(f"logits differ from the in-memory model (max abs diff {diff})")
    if not torch.equal(got["tokens"].cpu(), want["tokens"].cpu()):
        raise AssertionError(f"greedy tokens differ: {got['tokens'].tolist()} != {want['tokens'].tolist()}")
    return diff


def load_llama(workdir: Path, tie: bool, **load_kwargs: Any) -> Dict[str, Any]:
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
        return {"max_abs_diff": diff, "devices": sorted({str(p.device) for p in loaded.parameters()}),
                "computed_on": execution_device_of(loaded)}
    check_dispatched(loaded)
    return {"max_abs_diff": diff, "devices": sorted(map(str, set(device_map.values()))),
            "computed_on": execution_device_of(loaded)}


def tied_llama_models() -> Tuple[Any, Any]:
    """A tied tiny Llama as loaded (one tensor) and its meta copy built under init_empty_weights."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from ._models import tiny_llama_config

    config = tiny_llama_config(tie_word_embeddings=True)
    tied = LlamaForCausalLM(config)
    with init_empty_weights():
        meta = LlamaForCausalLM(config)
    return tied, meta


def llama_sweep(infer: Any) -> List[str]:
    problems: List[str] = []
    for model in tied_llama_models():
        total = model_bytes(model)
        budgets = budget_grid(total, FRACTIONS, 0) + budget_grid(total, FRACTIONS, 2)
        problems += sweep_budgets(model, infer, budgets, no_split_module_classes=["LlamaDecoderLayer"])
    return problems


