"""Reproducers for gemma4-offloaded-embeddings: Gemma 4 with per-layer inputs and its embedding offloaded.

A tiny random Gemma 4 with per-layer inputs (``hidden_size_per_layer_input``, as in the E2B/E4B sizes) is
saved and loaded with a real ``from_pretrained(device_map=..., offload_folder=...)`` that puts the text
embedding ``embed_tokens`` on disk and everything else in memory. Gemma 4 reads ``embed_tokens.weight``
directly (the pad embedding in ``Gemma4Model.forward``; the reverse lookup of ``inputs_embeds`` in
``Gemma4TextModel.get_per_layer_inputs``), so upstream meets the meta placeholder: ``RuntimeError: Tensor
on device meta is not on the expected device cpu!``. Fixed means: logits and greedy ``generate()`` equal
the in-memory model's (torch.equal). "In memory" is the execution device (``_device``), for the loaded
model's map and the reference alike.

Untied embeddings and no KV-shared layers keep other offload bugs (accelerate-dispatch-skip-keys, the
tied-device-map patches) out of these scenarios, so the unpatched run fails on this bug alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from . import NotApplicable
from ._device import main_device, to_device
from ._harness import Scenario
from ._models import input_ids, max_abs_diff

PATCH_ID = "gemma4-offloaded-embeddings"
_NEW_TOKENS = 4


def _require(class_name: str) -> Any:
    import transformers

    if not hasattr(transformers, class_name):
        raise NotApplicable(f"needs a transformers with Gemma 4 ({class_name}); installed {transformers.__version__}")
    return getattr(transformers, class_name)


def tiny_text_config() -> Any:
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, num_kv_shared_layers=0, sliding_window=16,
        max_position_embeddings=64, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)


def tiny_multimodal_config() -> Any:
    from transformers import Gemma4Config, Gemma4VisionConfig

    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4,
                                pooling_kernel_size=2)
    # special tokens inside the tiny vocabulary, above the ids the prompts use
    return Gemma4Config(text_config=tiny_text_config(), vision_config=vision, audio_config=None, boi_token_id=120,
                        eoi_token_id=121, image_token_id=122, video_token_id=123, boa_token_id=124,
                        eoa_token_index=125, audio_token_id=126, tie_word_embeddings=False)


def _embedding_on_disk(model: Any, text_model_path: str) -> Dict[str, Any]:
    """Every child of the text model in memory (the execution device) but embed_tokens, which goes to disk;
    the rest in memory."""
    memory = main_device()
    device_map: Dict[str, Any] = {}
    text_model = model.get_submodule(text_model_path)
    for name, _ in text_model.named_children():
        device_map[f"{text_model_path}.{name}"] = "disk" if name == "embed_tokens" else memory
    parent, _, _ = text_model_path.rpartition(".")
    for owner in (parent, ""):
        module = model.get_submodule(owner)
        for name, _ in module.named_children():
            path = f"{owner}.{name}" if owner else name
            if not any(key == path or key.startswith(path + ".") or path.startswith(key + ".") for key in device_map):
                device_map[path] = memory
    return device_map


def _save_and_reload(workdir: Path, cls: Any, config: Any, text_model_path: str) -> "tuple[Any, Any]":
    import torch

    torch.manual_seed(0)
    reference = cls(config).eval()
    reference.save_pretrained(workdir / "ckpt")
    loaded = cls.from_pretrained(workdir / "ckpt", device_map=_embedding_on_disk(reference, text_model_path),
                                 offload_folder=str(workdir / "offload")).eval()
    if not loaded.get_submodule(f"{text_model_path}.embed_tokens").weight.is_meta:
        raise AssertionError("the device map was meant to offload embed_tokens to disk; it is in memory")
    return to_device(reference), loaded


def _prompt() -> Any:
    return to_device(input_ids(vocab_size=100, length=8))  # ids below the special tokens


def _check_equal(what: str, got: Any, expected: Any) -> None:
    import torch

    if not torch.equal(got.cpu(), expected.cpu()):
        detail = got.tolist() if got.dtype == torch.long else f"max abs diff {max_abs_diff(got, expected)}"
        raise AssertionError(f"{what} with the embedding offloaded differs from the in-memory model: {detail}")


def conditional_generation(workdir: Path) -> Dict[str, Any]:
    """Gemma4ForConditionalGeneration, text prompt: Gemma4Model.forward reads the pad embedding."""
    import torch

    cls = _require("Gemma4ForConditionalGeneration")
    reference, loaded = _save_and_reload(workdir, cls, tiny_multimodal_config(), "model.language_model")
    ids = _prompt()
    with torch.no_grad():
        _check_equal("logits", loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
        expected = reference.generate(ids, max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False)
        _check_equal("generate()", loaded.generate(ids, max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS,
                                                   do_sample=False), expected)
    return {"max_abs_diff": 0.0}


def causal_lm_inputs_embeds(workdir: Path) -> Dict[str, Any]:
    """Gemma4ForCausalLM called with inputs_embeds: get_per_layer_inputs compares them with the weight."""
    import torch

    cls = _require("Gemma4ForCausalLM")
    reference, loaded = _save_and_reload(workdir, cls, tiny_text_config(), "model")
    ids = _prompt()
    with torch.no_grad():
        embeds = loaded.get_input_embeddings()(ids)  # through the embedding's own hook: the real weight
        expected_embeds = reference.get_input_embeddings()(ids)
        _check_equal("inputs_embeds", embeds, expected_embeds)
        _check_equal("logits", loaded(inputs_embeds=embeds).logits, reference(inputs_embeds=expected_embeds).logits)
        kwargs = dict(max_new_tokens=_NEW_TOKENS, min_new_tokens=_NEW_TOKENS, do_sample=False)
        _check_equal("generate(inputs_embeds=...)", loaded.generate(inputs_embeds=embeds, **kwargs),
                     reference.generate(inputs_embeds=expected_embeds, **kwargs))
    return {"max_abs_diff": 0.0}


_META_DEVICE = "Tensor on device meta is not on the expected device"  # measured: 5.11.0, 5.17.0, 5.24.0

SCENARIOS = [
    Scenario(PATCH_ID, "conditional-generation-embedding-on-disk", f"{__name__}:conditional_generation",
             "Gemma4ForConditionalGeneration with per-layer inputs, embed_tokens on disk: logits and greedy generate() "
             "equal the in-memory model (unpatched: RuntimeError 'Tensor on device meta is not on the expected device')",
             expected_error="RuntimeError", expected_message=_META_DEVICE),
    Scenario(PATCH_ID, "causal-lm-inputs-embeds-embedding-on-disk", f"{__name__}:causal_lm_inputs_embeds",
             "Gemma4ForCausalLM with per-layer inputs, embed_tokens on disk, called with inputs_embeds: logits and "
             "generate(inputs_embeds=...) equal the in-memory model",
             expected_error="RuntimeError", expected_message=_META_DEVICE),
]
