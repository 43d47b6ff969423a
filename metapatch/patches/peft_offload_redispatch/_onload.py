"""merge/unmerge/unload over an offloaded base: PEFT's ``onload_layer`` without its dead disk-rewrite set-up."""

from __future__ import annotations

from typing import Any, Iterator


def onload_layer_replacement(original: Any) -> Any:
    """Upstream's ``onload_layer`` (used by merge/unmerge/unload) minus its dead disk-rewrite set-up:
    before loading anything it builds ``dict(weights_map.dataset)`` (every offloaded tensor of the
    model, read from disk) to look one of them up in the offload index for a file name it never uses
    (its rewrite branch tests ``hasattr(dict, "dataset")``), and fails with a KeyError when the index
    does not hold that first key, as after a re-dispatch whose weights map reads through a state
    dict. Merged weights of an offloaded layer stay in its weights map in CPU memory, as upstream."""
    from contextlib import contextmanager

    @contextmanager
    def onload_layer(layer: Any) -> Iterator[None]:
        import torch
        from accelerate.utils import named_module_tensors

        from metapatch._adapter_offload import offload_hook  # also inside a SequentialHook (4-bit layers)

        offloaded_modules = []
        for name, module in layer.named_modules():
            hook = offload_hook(module)
            if name not in ("", "base_layer") and hook is not None:
                hook.pre_forward(module)
                offloaded_modules.append((module, hook))
        base_layer = getattr(layer, "base_layer", None)
        base_hook = offload_hook(base_layer) if base_layer is not None else None
        if base_hook is not None:
            base_hook.pre_forward(base_layer)
        yield
        for module, hook in offloaded_modules:
            hook.post_forward(module, torch.tensor([]))
        if base_hook is not None:
            base_hook.weights_map = {name: param.to("cpu") for name, param in named_module_tensors(base_layer)}
            base_hook.post_forward(base_layer, torch.tensor([]))

    onload_layer.__doc__ = original.__doc__
    return onload_layer

