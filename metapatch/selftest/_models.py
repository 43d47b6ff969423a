"""Tiny random checkpoints of real architectures, built on the fly (no hub access), and the
comparisons the reproducers share. Imported only inside scenario functions: torch is heavy.

Models are built and saved on the CPU (the same random weights on every machine); a scenario then
places the in-memory reference and the non-offloaded part of its map on the execution device
(``_device``), and feeds both :func:`device_input_ids`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    # 64/128 keep bitsandbytes' CPU repacking (out % 32, in % 64) on the real code path.
    values: Dict[str, Any] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=False)
    values.update(overrides)
    return LlamaConfig(**values)


def save_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random LlamaForCausalLM saved as safetensors in ``path``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    model.save_pretrained(path)
    return path


def input_ids(vocab_size: int = 128, length: int = 8, seed: int = 1) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=generator)


def device_input_ids(vocab_size: int = 128, length: int = 8, seed: int = 1) -> Any:
    """:func:`input_ids` (drawn on the CPU: the same ids everywhere) on the execution device."""
    from ._device import to_device

    return to_device(input_ids(vocab_size, length, seed))


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference, read on the CPU (the two may live on different devices)."""
    return float((a.detach().float().cpu() - b.detach().float().cpu()).abs().max())


def meta_parameters(model: Any) -> list:
    """Parameters left on meta that no accelerate offload hook will fill."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    covered = set()
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
        if any(isinstance(h, AlignDevicesHook) and h.offload for h in hooks if h is not None):
            covered.update(f"{name}.{n}" if name else n for n, _ in module.named_parameters())
    return [n for n, p in model.named_parameters() if p.is_meta and n not in covered]


@contextlib.contextmanager
def nan_sentinel() -> Iterator[None]:
    """``torch.empty_like`` memory filled with NaN while active: a buffer nobody wrote shows as NaN."""
    import torch

    original = torch.empty_like

    def empty_like(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        if value.is_floating_point() and not value.is_meta:
            value.fill_(float("nan"))
        return value

    torch.empty_like = empty_like
    try:
        yield
    finally:
        torch.empty_like = original
