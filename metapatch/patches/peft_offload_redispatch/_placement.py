"""The device map of a re-dispatch: the base's current placement re-keyed for the PEFT wrapper, a
user's explicit map, or one inferred from ``max_memory`` as PEFT documents it."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from metapatch._framework.records import MetapatchError

OFFLOADED_DEVICES = {"cpu", "disk"}

def base_model_of(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (``PeftMixedModel`` has no ``get_base_model``:
    its attribute lookup forwards to the base model, which has none either)."""
    get_base_model = getattr(type(model), "get_base_model", None)
    return get_base_model(model) if callable(get_base_model) else model.base_model.model


def is_offloaded(base: Any) -> bool:
    device_map = getattr(base, "__dict__", {}).get("hf_device_map")
    return isinstance(device_map, dict) and bool(OFFLOADED_DEVICES & set(map(str, device_map.values())))


def _prefixed(base_map: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    return {(f"{prefix}.{k}" if k else prefix): v for k, v in base_map.items()}


def _base_prefix(model: Any, base: Any) -> str:
    # Where PEFT keeps it (PeftModel/PeftMixedModel: base_model.model; prompt learning: base_model), read
    # through _modules; any other wrapper by a walk.
    tuner = model.__dict__.get("_modules", {}).get("base_model")
    if tuner is base:
        return "base_model"
    if getattr(tuner, "__dict__", {}).get("_modules", {}).get("model") is base:
        return "base_model.model"
    from metapatch._offload.adapter_offload import named_modules

    for name, module in named_modules(model):
        if module is base:
            return name
    raise MetapatchError("metapatch (peft-offload-redispatch): the PEFT model does not contain its base model")


def _user_map(model: Any, base: Any, prefix: str, device_map: Dict[str, Any],
              module_names: Optional[List[str]] = None) -> Dict[str, Any]:
    """A user's map in the wrapper's names: the base's own names (what the seed passed) are re-keyed.
    ``module_names``: ``named_modules(model)``'s names, where the caller has walked the model."""
    from metapatch._offload.adapter_offload import named_modules

    if module_names is None:
        module_names = [name for name, _ in named_modules(model)]
    wrapper_names = set(module_names)
    named = [k for k in device_map if k]
    if named and all(k in wrapper_names for k in named):
        return dict(device_map)
    if prefix in wrapper_names:  # the base's names: the wrapper's below the base, the prefix cut off
        base_names = {name[len(prefix) + 1:] for name in module_names if name.startswith(prefix + ".")}
        base_names.add("")
    else:
        base_names = {name for name, _ in named_modules(base)}
    if all(k in base_names for k in named):
        return _prefixed(device_map, prefix)
    unknown = [k for k in named if k not in wrapper_names and k not in base_names]
    raise MetapatchError(
        f"metapatch (peft-offload-redispatch): device_map names modules found neither in the PEFT model nor in "
        f"its base model: {unknown[:5]}. Use the base model's names (as for from_pretrained) or the PEFT "
        f"model's ('{prefix}.…').")


def _inferred_map(model: Any, strategy: str, max_memory: Any) -> Dict[str, Any]:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None)
    no_split = sorted(no_split) if isinstance(no_split, (set, frozenset)) else no_split
    if strategy != "sequential":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         low_zero=(strategy == "balanced_low_0"))
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)


def _placement_of(name: str, device_map: Dict[str, Any]) -> Any:
    """Where ``device_map`` places ``name`` (its longest dotted prefix, as accelerate reads maps), or None."""
    from metapatch._offload.tied_placement import entry_of

    key = entry_of(device_map, name)
    return None if key is None else device_map[key]


def _cover_the_rest(model: Any, device_map: Dict[str, Any], main: Any, names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Modules outside the base (prompt encoders, shared banks) go to the main device, as upstream's
    freshly inferred map would put them. ``names``: the model's tensor names under every path, where
    the caller has them (its walk of the unchanged model); else ``state_dict``'s."""
    from metapatch._offload.tied_placement import entry_of

    # accelerate checks coverage against state_dict's names, which list a shared module under every
    # path (VeRA's vera_A/vera_B buffers: in each layer and on the tuner model itself).
    for name in (names if names is not None else model.state_dict(keep_vars=True)):
        if entry_of(device_map, name) is None:
            device_map[name.rpartition(".")[0]] = main
    return device_map


def _main_device(device_map: Dict[str, Any]) -> Any:
    values = set(map(str, device_map.values()))
    if values <= {"cpu", "disk"}:
        return "cpu"
    return next(v for v in device_map.values() if str(v) not in OFFLOADED_DEVICES)


def new_placement(model: Any, base: Any, options: Dict[str, Any], known: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The map ``options`` ask for. ``known``: a dictionary kept by a caller that asks for several maps
    of one unchanged model; what is read of the model (the base's name, its tensor names) is read once."""
    known = {} if known is None else known
    if "prefix" not in known:
        known["prefix"] = _base_prefix(model, base)
    prefix = known["prefix"]
    device_map, max_memory = options.get("device_map"), options.get("max_memory")
    if device_map is None and max_memory is None:
        current = model.__dict__.get("hf_device_map")  # an earlier re-dispatch of this wrapper
        chosen = dict(current) if isinstance(current, dict) else _prefixed(base.hf_device_map, prefix)
    elif isinstance(device_map, dict):
        walk = known.get("walk")
        chosen = _user_map(model, base, prefix, device_map,
                           None if walk is None else [name for name, _ in walk.modules.values()])
    else:
        chosen = _inferred_map(model, device_map or "auto", max_memory)
    if "names" not in known:
        known["names"] = list(model.state_dict(keep_vars=True))
    return _cover_the_rest(model, chosen, _main_device(chosen), known["names"])
