"""Tiny vision-language models with real image inputs, for scenarios whose bug needs images to show: built from
the installed transformers' classes on first use (torch and transformers are imported inside the functions)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

IMAGE_TOKEN = 250


def tiny_llava_next() -> Tuple[Any, Any]:
    """(LlavaNextForConditionalGeneration, a tiny config of it): a Llama text model and a CLIP vision tower, images
    of 32x32."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    text = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                             image_grid_pinpoints=[[32, 32], [32, 64], [64, 32], [64, 64]])
    return LlavaNextForConditionalGeneration, config


def llava_next_inputs() -> Dict[str, Any]:
    """One 32x32 image (its base and one tile) and a prompt holding its 36 image tokens, on the CPU."""
    import torch

    ids = torch.tensor([[1] + [IMAGE_TOKEN] * 36 + [5, 6, 7, 8]])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                pixel_values=torch.randn(1, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                image_sizes=torch.tensor([[32, 32]]))


def tensors(value: Any) -> List[Any]:
    """The tensors in ``value`` (a tensor, a list or tuple of them, a ModelOutput), in order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):  # ModelOutput
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors(item)]
    return []
