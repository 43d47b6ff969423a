"""Reproducers for offloaded-model-device: ``model.device`` of a model whose first parameter is offloaded.

transformers answers ``model.device`` with the device of the model's first parameter. When accelerate
offloads that parameter (``model.embed_tokens`` on disk, or cpu offload on a GPU machine), it is a meta
placeholder between forward passes, so ``model.device`` says ``meta`` and the usual idiom
``inputs = tok(...).to(model.device)`` sends the prompt to meta: ``generate()`` then dies with
``Tensor.item() cannot be called on meta tensors`` (QwenLM/Qwen2.5-Omni#110, huggingface/diffusers#13096).
Fixed means: the idiom works and generates exactly the in-memory model's tokens. A second scenario
guards what must not change: models that are not offloaded (in memory, dispatched without offload, or
built on meta under ``init_empty_weights``) keep upstream's answer. "In memory" is the execution device
(``_device``): on a GPU machine ``model.device`` must say ``cuda:0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._device import execution_device, main_device, to_device
from ._harness import Scenario
from ._models import input_ids, save_tiny_llama

PATCH_ID = "offloaded-model-device"
_NEW_TOKENS = 6

# The embedding (the first parameter of a Llama) on disk, everything else in memory (the execution device,
# _in_memory). On a machine without accelerators "cpu" entries are not offloaded, so disk is what puts the
# embedding behind an offload hook everywhere.
EMBEDDING_ON_DISK = {
    "model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu", "model.norm": "cpu",
    "lm_head": "cpu",
}


def _in_memory(device_map: Dict[str, Any]) -> Dict[str, Any]:
    """``device_map`` with its memory entries on the execution device."""
    return {name: main_device() if device == "cpu" else device for name, device in device_map.items()}


def _load(workdir: Path, **kwargs: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(workdir / "ckpt", **kwargs).eval()


def _prompt() -> Any:
    """What a tokenizer returns: a BatchEncoding, whose .to(device) is the idiom under test."""
    import torch
    from transformers import BatchEncoding

    ids = input_ids()
    return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def _generate(model: Any, inputs: Any) -> Any:
    import torch

    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False,
                              pad_token_id=0)


def generate_with_offloaded_embedding(workdir: Path) -> Dict[str, Any]:
    """from_pretrained with model.embed_tokens on disk; inputs.to(model.device); greedy generate()
    must equal the in-memory model's tokens."""
    import torch

    save_tiny_llama(workdir / "ckpt")
    reference_model = to_device(_load(workdir))
    reference = _generate(reference_model, _prompt().to(reference_model.device))
    model = _load(workdir, device_map=_in_memory(EMBEDDING_ON_DISK), offload_folder=str(workdir / "offload"))
    if not model.model.embed_tokens.weight.is_meta:
        raise AssertionError("the device map was meant to offload model.embed_tokens to disk; it is in memory")
    device = model.device
    inputs = _prompt().to(device)  # the README's idiom
    tokens = _generate(model, inputs)
    if not torch.equal(tokens.cpu(), reference.cpu()):
        raise AssertionError(f"generate() with the embedding offloaded: {tokens.tolist()} != in-memory "
                             f"{reference.tolist()}")
    return {"max_abs_diff": 0.0, "model_device": str(device), "inner_model_device": str(model.model.device)}


def device_unchanged_when_not_offloaded(workdir: Path) -> Dict[str, Any]:
    """Upstream's answer stays where nothing the first parameter needs is offloaded: an in-memory model,
    a model dispatched with nothing offloaded, a model with only later layers on disk, and a model built
    on meta under init_empty_weights (no hooks: genuinely meta)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    from ._models import tiny_llama_config

    save_tiny_llama(workdir / "ckpt")
    seen = {
        "in_memory": to_device(_load(workdir)).device,
        "dispatched_cpu": _load(workdir, device_map={"": main_device()}).device,
        "later_layers_on_disk": _load(workdir, offload_folder=str(workdir / "offload"), device_map=_in_memory({
            "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
            "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu"})).device,
    }
    with init_empty_weights():
        seen["init_empty_weights"] = LlamaForCausalLM(tiny_llama_config()).device
    memory = execution_device()
    expected = {"in_memory": memory, "dispatched_cpu": memory, "later_layers_on_disk": memory,
                "init_empty_weights": "meta"}
    wrong = {k: str(v) for k, v in seen.items() if v != torch.device(expected[k])}
    if wrong:
        raise AssertionError(f"model.device changed for models whose first parameter is not offloaded: {wrong} "
                             f"(expected {expected})")
    return {"max_abs_diff": 0.0, "devices": {k: str(v) for k, v in seen.items()}}


TRANSFORMERS_5 = {"transformers": ">=5.0.0.dev0"}  # 4.57: offloaded-model-device-v4 runs these


def scenarios(patch_id: str, requires: Dict[str, str], release: str = "") -> list:
    """The two scenarios, for this patch (transformers 5) or the 4.57 one (the same functions)."""
    return [
        Scenario(patch_id, "generate-embedding-on-disk", f"{__name__}:generate_with_offloaded_embedding",
                 f"{release}a Llama loaded with model.embed_tokens on disk: inputs.to(model.device) and greedy "
                 "generate() equal the in-memory model's tokens (unpatched: RuntimeError 'Tensor.item() cannot be "
                 "called on meta tensors')",
                 expected_error="RuntimeError", expected_message=r"Tensor\.item\(\) cannot be called on meta tensors",
                 requires=requires),
        Scenario(patch_id, "device-unchanged-when-not-offloaded", f"{__name__}:device_unchanged_when_not_offloaded",
                 f"{release}model.device of in-memory, dispatched-not-offloaded and init_empty_weights models is "
                 "upstream's (passes with and without metapatch)", requires=requires,
                 in_selftest=False),  # a no-regression guard: the test suite runs it, selftest with --include-slow
    ]


SCENARIOS = scenarios(PATCH_ID, TRANSFORMERS_5)
