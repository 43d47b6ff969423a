"""metapatch's re-dispatch of a PEFT model over an offloaded base: the offloaded base weights read
from where accelerate already reads them, adapters following their base layer's hook, nothing
written outside ``offload_dir``."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ..accelerate_dispatch_skip_keys import model_skip_keys
from metapatch._offload import hook_state
from metapatch._offload.adapter_offload import follow_base_layer_hooks

from . import _incremental
from ._placement import base_model_of, _main_device, new_placement
from ._sources import _sources_by_name
from ._tensors import _device_of, _place_tensors


_NOT_A_PLACEMENT = {"offload_dir"}


def placement_options(options: Dict[str, Any]) -> Dict[str, Any]:
    """The PEFT call's options with ``device_map="auto"`` dropped where it comes without ``max_memory``:
    that is what upstream's ``load_adapter`` uses when no ``device_map`` is given
    (``kwargs.get("device_map", "auto")``), so upstream treats the two calls alike, and so does metapatch,
    which keeps the base's dispatch for both. A budget (``max_memory``), an explicit map or another
    strategy (``"balanced"``, ``"balanced_low_0"``, ``"sequential"``) is kept: a request for a placement."""
    if options.get("device_map") == "auto" and options.get("max_memory") is None:
        options = {key: value for key, value in options.items() if key not in ("device_map", "max_memory")}
    return options


def asks_for_placement(options: Dict[str, Any]) -> bool:
    """Whether ``options`` (after :func:`placement_options`) ask for another placement than the base's
    current dispatch. ``offload_dir`` alone does not: it names where tensors newly sent to disk would
    go, and keeping the base's dispatch sends none there (peft's own error message tells users to pass
    it)."""
    return bool(set(options) - _NOT_A_PLACEMENT)


def redispatch(model: Any, captured: Dict[int, Tuple[Any, Dict[str, Any]]], options: Dict[str, Any]) -> None:
    import torch
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules

    base = base_model_of(model)
    # The model is read once (one walk) for the sources and both maps: nothing changes it in between.
    walk = _incremental._walk(model)
    known: Dict[str, Any] = {"walk": walk, "names": walk.names}
    sources = _sources_by_name(model, captured, walk.modules.values())
    options = placement_options(options)
    asked = asks_for_placement(options)
    current = _served_placement(model, base, sources, known)
    if current is not None and not asked:
        model.hf_device_map = current  # the adapters already follow their layers' hooks (inject_adapter)
        return
    device_map = new_placement(model, base, options, known)
    # A placement asked for (max_memory, an explicit map, ...): where it equals the current one
    # nothing moves; elsewhere only the entries whose tensors move are re-hooked.
    if current is not None and _incremental.apply(model, base, current, device_map, sources, options,
                                                  known.get("walk")):
        return
    _remove_hooks(model)
    main = _main_device(device_map)
    offloaded_devices = {"disk"} if str(main) in ("cpu", "mps") else {"cpu", "disk"}  # as dispatch_model decides
    weights = _place_tensors(model, device_map, sources, offloaded_devices, options.get("offload_dir"))
    has_disk = "disk" in set(map(str, device_map.values()))
    # An (empty) offload_index tells dispatch_model the weights are offloaded already: it saves none.
    # A map that names disk only (a small max_memory) is dispatched with hooks, as accelerate 1.15
    # does; accelerate 1.10-1.14 would otherwise call model.to("disk") and refuse ("offload the whole
    # model to the disk"), advice a PEFT user cannot follow.
    single_disk = set(map(str, device_map.values())) == {"disk"}
    dispatch_model(model, device_map=device_map, main_device=main, state_dict=weights,
                   offload_index={} if has_disk else None, skip_keys=model_skip_keys(model),
                   force_hooks=single_disk,
                   offload_buffers=bool(options.get("offload_buffers", False)))
    if any(getattr(c, "is_prompt_learning", False) for c in getattr(model, "peft_config", {}).values()) \
            and isinstance(getattr(model, "prompt_encoder", None), torch.nn.Module):
        remove_hook_from_submodules(model.prompt_encoder)  # as upstream: the prompt encoder runs unhooked
    # As upstream: outputs come back on the inputs' device.
    add_hook_to_module(base, AlignDevicesHook(io_same_device=True), append=hook_state.hooked(base))
    # The adapter containers of offloaded layers were hooked like any module with parameters; their
    # forward may never run (IA3 reads ``ia3_l[adapter]``): they follow their base layer instead.
    follow_base_layer_hooks(model)


def _served_placement(model: Any, base: Any, sources: Dict[str, Any],
                      known: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """The current placement (the base's map re-keyed for the wrapper) where the base's hooks
    already serve the model as it now is: every meta tensor is one an offload hook reads, every other
    tensor sits where that map puts it, or is an adapter tensor following its offloaded base layer.
    Then the dispatch can be kept as it is (no hook removed and re-attached, no weights map rebuilt:
    most of the cost of adding an adapter to an offloaded base), or changed only where a new
    placement differs. None for anything else (a tensor outside the base on another device, a meta
    tensor no hook knows): the full re-dispatch."""
    from metapatch._offload.tied_placement import entry_of

    if known is None:
        known = {}
    # Every tensor under its first name (named_parameters' and named_buffers' names), from the walk the in-place
    # re-placement needs too (kept for it), which also names every path for the map's coverage.
    if "walk" not in known:
        known["walk"] = _incremental._walk(model)
        known.setdefault("names", known["walk"].names)
    tensors = known["walk"].tensors
    device_map = new_placement(model, base, {}, known)
    main = _main_device(device_map)
    offloaded_devices = {"disk"} if str(main) in ("cpu", "mps") else {"cpu", "disk"}
    wanted: Dict[Any, Any] = {}  # placement -> its torch.device, made once (there are a few, and ~10 tensors per module)
    for name, tensor, is_adapter in tensors:
        key = entry_of(device_map, name)  # the longest prefix, by dictionary look-ups
        where = None if key is None else device_map[key]
        device = tensor.device
        if str(where) in offloaded_devices:
            if device.type == "meta":
                if name not in sources:
                    return None
                continue
            where = main
            if not is_adapter:
                return None
        if where not in wanted:
            wanted[where] = _device_of(where)
        if device != wanted[where]:
            return None
    return device_map


def _remove_hooks(model: Any) -> None:
    """accelerate's remove_hook_from_submodules asks ``hasattr(module, "_hf_hook")``, which PEFT's
    wrappers answer by forwarding to the base model, and then fails to delete it from the wrapper:
    only modules that hold a hook themselves are unhooked."""
    from accelerate.hooks import remove_hook_from_module

    for module in list(model.modules()):
        if hook_state.hooked(module):
            remove_hook_from_module(module)

