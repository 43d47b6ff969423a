"""A second placement over an already dispatched base, applied in place: the map entries whose
tensors keep their placement keep their accelerate hooks (and their offloaded weights where they
are), and only the entries whose tensors move are unhooked, moved and hooked again. A full
re-dispatch would remove every hook, rebuild the weights map of the whole model and hook every
module again (most of the cost of ``PeftModel.from_pretrained(..., device_map="auto")`` over an
offloaded base: 1.8-2.0 times the in-memory load)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from metapatch._offload.tied_placement import entry_of

from ._placement import _main_device


def _offloaded(main: Any) -> set:
    return {"disk"} if str(main) in ("cpu", "mps") else {"cpu", "disk"}  # as dispatch_model decides


class Walk(NamedTuple):
    """One walk of a PEFT model's module tree, shared by the checks and the re-placement of a re-dispatch."""

    tensors: List[Tuple[str, Any, bool]]  # (name, tensor, whether a tuner layer's own) under each tensor's first name
    shared: set  # ids of tensors reachable under more than one name (tied parameters, shared modules)
    names: List[str]  # every tensor name under every path: what a device map must cover
    modules: Dict[int, Tuple[str, Any]]  # id -> (first name, module), in named_modules() order


def _walk(model: Any) -> Walk:
    """Every tensor under its first name (as ``named_parameters``/``named_buffers`` name it: a module's
    first visit comes at the same point with or without revisits), the tensors reachable under several names
    (left to the full re-dispatch, which re-ties them), every name, and every module under its first name."""
    from ._tensors import module_tensors

    seen: Dict[int, str] = {}
    shared: set = set()
    out: List[Tuple[str, Any, bool]] = []
    names: List[str] = []
    modules: Dict[int, Tuple[str, Any]] = {}
    for name, tensor, is_adapter in module_tensors(model, remove_duplicate=False, modules=modules):
        names.append(name)
        if id(tensor) in seen:
            shared.add(id(tensor))
            continue
        seen[id(tensor)] = name
        out.append((name, tensor, is_adapter))
    return Walk(out, shared, names, modules)


def _moving_entries(current: Dict[str, Any], device_map: Dict[str, Any],
                    tensors: List[Tuple[str, Any, bool]]) -> Optional[Dict[str, List[Tuple[str, Any, bool]]]]:
    """The entries of ``current`` whose tensors change placement under ``device_map``, each with
    its tensors; None when a tensor is placed by neither map."""
    moving: Dict[str, List[Tuple[str, Any, bool]]] = defaultdict(list)
    members: Dict[str, List[Tuple[str, Any, bool]]] = defaultdict(list)
    for item in tensors:
        old, new = entry_of(current, item[0]), entry_of(device_map, item[0])
        if old is None or new is None:
            return None
        members[old].append(item)
        if str(current[old]) != str(device_map[new]):
            moving[old] = members[old]
    return {key: members[key] for key in moving}


def _sub_map(key: str, device_map: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The new map restricted to the module ``key``: its own entry (from ``key`` or the entry above
    it) or the entries below it, never both (accelerate hooks a module once)."""
    below = {k: v for k, v in device_map.items() if k.startswith(key + ".")}
    above = entry_of(device_map, key)
    if below and above is not None:
        return None
    return below if below else {key: device_map[above]}


def apply(model: Any, base: Any, current: Dict[str, Any], device_map: Dict[str, Any], sources: Dict[str, Any],
          options: Dict[str, Any], walked: Optional[Walk] = None) -> bool:
    """Re-place ``model`` (dispatched as ``current`` says: the caller checked that its hooks serve
    it so) as ``device_map`` says, moving only what moves. False (nothing changed) where this
    cannot be done in place: another main device, a moving entry that is the model or its base, a
    tied tensor that moves; the caller then takes the full re-dispatch."""
    from accelerate.hooks import attach_align_device_hook_on_blocks, remove_hook_from_module

    from metapatch._offload.adapter_offload import follow_base_layer_hooks, named_modules
    from metapatch._offload.hook_state import hooked

    from ..accelerate_dispatch_skip_keys import model_skip_keys
    from ._tensors import _place_tensors

    main = _main_device(device_map)
    if str(main) != str(_main_device(current)):
        return False
    walked = walked if walked is not None else _walk(model)  # (the caller's walk of the unchanged model)
    tensors, shared = walked.tensors, walked.shared
    moving = _moving_entries(current, device_map, tensors)
    if moving is None:
        return False
    if not moving:  # the placement asked for is the current one: nothing to unhook or move
        model.hf_device_map = device_map
        return True
    modules = dict(named_modules(model))
    plans = []
    for key, members in moving.items():
        module, sub = modules.get(key), _sub_map(key, device_map)
        # accelerate hooks modules: a key naming a tensor (a split tied group) is left to the full path
        if module is None or module is model or module is base or sub is None \
                or any(k not in modules for k in sub) \
                or any(id(tensor) in shared for _, tensor, _ in members):
            return False
        plans.append((key, module, sub, members))
    offloaded = _offloaded(main)
    skip_keys = model_skip_keys(model)
    # A map onto one device (device_map="auto" where everything fits in memory): dispatch_model
    # hooks nothing then, it moves the model; the entries that move are moved and left unhooked.
    one_device = len({str(v) for v in device_map.values()}) == 1 and str(main) not in offloaded
    for key, module, sub, members in plans:
        for inner in list(module.modules()):
            if hooked(inner):
                remove_hook_from_module(inner)
        weights = _place_tensors(model, device_map, sources, offloaded, options.get("offload_dir"), tensors=members)
        if one_device:
            _move_to(model, members, main)
            continue
        attach_align_device_hook_on_blocks(
            module,
            execution_device={k: (main if str(v) in ("cpu", "disk") else v) for k, v in sub.items()},
            offload={k: str(v) in offloaded for k, v in sub.items()},
            weights_map=weights, offload_buffers=bool(options.get("offload_buffers", False)),
            module_name=key, skip_keys=skip_keys, tied_params_map={})
        follow_base_layer_hooks(module)
    model.hf_device_map = device_map
    return True


def _move_to(model: Any, members: List[Tuple[str, Any, bool]], device: Any) -> None:
    from accelerate.utils import set_module_tensor_to_device

    from ._tensors import _same_device

    for name, tensor, _ in members:
        if tensor.device.type == "meta" or _same_device(tensor.device, device):
            # on meta before: _place_tensors has just put it in memory, where a one-device map puts it
            continue
        current = model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)
        if not _same_device(current.device, device):
            set_module_tensor_to_device(model, name, device)


def _is_parameter(model: Any, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(owner)._parameters
