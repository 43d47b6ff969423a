"""Holding an offloaded module's weights in memory across calls: an operation over it, or a PEFT tuner
layer's forward over its offloaded base layer, onloads it once and offloads it at the end. Holds are counted
(an operation and a tuner layer's forward nest). :func:`stood_in` is the cheap cousin for code that reads only
where and what the weights are: uninitialised stand-ins instead of the stored values."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from metapatch._framework.records import MetapatchError
from metapatch._offload.store import HOOK_LOADED


def held(hook: Any) -> bool:
    return getattr(hook, "_metapatch_held", 0) > 0


def hold(base_layer: Any, hook: Any) -> None:
    """Onload ``base_layer``'s weights and keep them until :func:`release`: its hook's own
    pre/post-forward then only move inputs and outputs (``offload`` is off while held). Nested holds
    are counted."""
    if not held(hook):
        hook.pre_forward(base_layer)
        hook.offload = False
    hook._metapatch_held = getattr(hook, "_metapatch_held", 0) + 1


def release(base_layer: Any, hook: Any) -> None:
    import torch

    hook._metapatch_held -= 1
    if hook._metapatch_held == 0:
        if torch.is_grad_enabled():
            keep_quant_states_for_backward(base_layer)
        hook.offload = True
        hook.post_forward(base_layer, torch.empty(0))


def keep_quant_states_for_backward(base_layer: Any) -> None:
    """bitsandbytes' 4-bit matmul keeps the weight's ``QuantState`` object for its backward, and
    offloading the weight moves that very object to meta in place (``Params4bit.to``): the backward
    then dequantizes garbage (NaN gradients). The parameter about to be offloaded gets its own copy,
    so the one autograd holds keeps its values."""
    import copy

    for module in base_layer.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(weight, "requires_grad", False) is False:
            weight.quant_state = copy.deepcopy(state)


@contextlib.contextmanager
def stood_in(base_layer: Any, device: Any, what: str) -> Iterator[None]:
    """Inside the block, the ``meta`` placeholders of ``base_layer`` (offloaded) are replaced by
    uninitialised tensors of the same shape and dtype on ``device``; the offloaded values are never
    read, and the placeholders are put back afterwards. For code that reads only where and what the
    weights are: a stand-in that was replaced or written holds a value computed from no real weight,
    and is refused (nothing could keep it)."""
    import torch

    placeholders = [(sub, store, name, tensor) for sub in base_layer.modules() for store in (sub._parameters, sub._buffers)
                    for name, tensor in store.items() if tensor is not None and tensor.device.type == "meta"]
    stand_ins = []
    for sub, store, name, tensor in placeholders:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        store[name] = torch.nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else empty
        store[name].__dict__[HOOK_LOADED] = True
        stand_ins.append((store[name], store[name].data_ptr(), store[name]._version))
    try:
        yield
    finally:
        written = [f"{type(sub).__name__}.{name}" for (sub, store, name, _), (stand_in, pointer, version)
                   in zip(placeholders, stand_ins)
                   if store.get(name) is not stand_in or stand_in.data_ptr() != pointer or stand_in._version != version]
        for sub, store, name, tensor in placeholders:
            store[name] = tensor
    if written:
        raise MetapatchError(
            f"metapatch: {what} wrote {written[:4]} of an offloaded base layer that metapatch stood in for "
            f"(it reads no base value, it was assumed); the written value cannot be kept. Please report this; "
            f"meanwhile keep that layer in memory (device_map).")


def innermost_base_layer(layer: Any) -> Any:
    """``layer``'s innermost ``base_layer`` (what PEFT's ``get_base_layer`` returns), found through
    ``_modules`` only: no PEFT code runs for a layer that turns out not to be offloaded."""
    for _ in range(64):
        inner = getattr(layer, "__dict__", {}).get("_modules", {}).get("base_layer")
        if inner is None:
            return layer
        layer = inner
    return layer
