"""Saving an adapter of an offloaded model: the base tensors peft saves with it are read from where the
hook serves them.

``get_peft_model_state_dict`` starts from ``model.state_dict()``, where every offloaded tensor is a
``meta`` placeholder, and keeps some base tensors beside the adapter's own: the embedding layers
(``save_embedding_layers``: an embedding or head is a target, or the vocabulary was resized), biases
(``bias="all"``), ... Over an offloaded module those are placeholders: the save then fails with
``Cannot copy out of meta tensor`` or, where the base's hooks were removed first, writes garbage. Here
each placeholder peft returns is replaced by the value the module's offload hook serves (the weights
map, including what metapatch's store kept there: a PiSSA residual, a resized embedding), read only:
nothing is written into the offload folder, nothing is onloaded, and only what peft keeps is read.
"""

from __future__ import annotations

from typing import Any, Dict

from metapatch._offload import hook_state, model_placement
from metapatch._framework.records import MetapatchError


def _offloaded(model: Any) -> bool:
    """From the model object alone (``__dict__`` reads only): a device map that offloads, or a hook on
    the model itself (``cpu_offload``), on the model or, for a PEFT wrapper, its base."""
    from ._wrappers import _base_of_wrapper

    for holder in (model, _base_of_wrapper(model)):
        state = getattr(holder, "__dict__", None)
        if state is None:
            continue
        device_map = state.get("hf_device_map")
        if isinstance(device_map, dict) and model_placement.map_offloads(device_map):
            return True
        if hook_state.hooked(holder):
            return True
    return False


def get_peft_model_state_dict(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    model = args[0] if args else kwargs.get("model")
    given = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
    if given is not None or model is None or not _offloaded(model):
        return wrapped(*args, **kwargs)
    unwrap = kwargs.get("unwrap_compiled", args[3] if len(args) > 3 else False)
    owner = getattr(model, "_orig_mod", model) if unwrap else model
    placeholders: Dict[int, str] = {}
    produced = []
    own_state_dict = owner.state_dict

    def state_dict(*a: Any, **k: Any) -> Any:
        result = own_state_dict(*a, **k)
        if not a and not k:
            produced.append(result)  # keeps the placeholders alive: their ids stay theirs
            for key, value in result.items():
                if getattr(value, "is_meta", False):
                    placeholders[id(value)] = key
        return result

    had = "state_dict" in owner.__dict__
    previous = owner.__dict__.get("state_dict")
    owner.__dict__["state_dict"] = state_dict
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if had:
            owner.__dict__["state_dict"] = previous
        else:
            owner.__dict__.pop("state_dict", None)
    if not placeholders:
        return result
    for key, value in list(result.items()):
        name = placeholders.get(id(value))
        if name is not None:
            result[key] = served_value(owner, name, value)
    return result


def served_value(model: Any, name: str, placeholder: Any) -> Any:
    """The value ``model``'s offload hooks serve for the tensor ``name`` (a CPU copy, in the
    placeholder's dtype, as the hook's onload casts it), or the placeholder itself when no hook
    serves it (upstream then reports the meta tensor, as without metapatch)."""
    path, _, local = name.rpartition(".")
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        try:
            owner = model.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            return placeholder
        hook = hook_state.offload_hook(owner)
        if hook is None:
            continue
        if depth < len(parts) and not hook.place_submodules:
            return placeholder
        key = ".".join(parts[depth:] + [local])
        served = hook_state.weights_map_of(hook)
        if key not in served:
            return placeholder
        value = served[key]
        return _as_placeholder(value, placeholder, name)
    return placeholder


def _as_placeholder(value: Any, placeholder: Any, name: str) -> Any:
    if value.shape != placeholder.shape or (value.dtype != placeholder.dtype and not (
            value.dtype.is_floating_point and placeholder.dtype.is_floating_point)):
        raise MetapatchError(
            f"metapatch: saving the adapter reads {name} of a module accelerate offloads, and its offloaded form "
            f"({value.dtype}, {tuple(value.shape)}) is not the tensor the module holds ({placeholder.dtype}, "
            f"{tuple(placeholder.shape)}: a quantized layer?); saving it would silently write another value. Keep "
            f"that module in memory (device_map) to save it, or pass save_embedding_layers=False.")
    return value.detach().to("cpu", dtype=placeholder.dtype, copy=True)
