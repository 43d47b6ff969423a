"""The one reader of accelerate's hook state: which hook offloads a module, and where its weights live.

Patches, :mod:`metapatch.diagnose`, the move guard and the offload store all ask the same questions of
accelerate's objects; the answers differed while each of them read ``_hf_hook`` on its own (the move
guard called a hook without a ``weights_map`` "the offload store", diagnose called it "cpu"; both
called a disk-offloaded module "cpu" once an :class:`metapatch._offload.store.Overlay` stood in front
of its loader). Here each answer is written once:

* :func:`hooks_on`, :func:`align_hooks`, :func:`offload_hooks`, :func:`offload_hook`: the hooks on a
  module itself (a ``SequentialHook`` flattened), read from ``module.__dict__`` only, so no attribute
  of the module (a property that computes) runs;
* :func:`locate`: where one key of a ``weights_map`` is held (memory or the offload folder), through
  ``PrefixedDataset``, ``OffloadedWeightsLoader`` and metapatch's ``Overlay``, without loading it
  (``Mapping.__contains__`` of accelerate's loader would read the file);
* :func:`storage`: "disk", "cpu" or "the offload store" for an offload hook;
* :func:`execution_device`, :func:`compute_device`: the ``torch.device`` a hook names as its execution device
  (accelerate's int ``i`` is the accelerator's device ``i``), and the one it loads its module's tensors onto for a
  forward (the CPU where it names none), where the in-memory model holds them;
* :func:`attached_hook`, :func:`hooked` (``hooked_as_accelerate_asks``: ``hasattr``, as accelerate asks;
  :func:`hooked_modules_alive`: every hooked module of the process, for a patch applied late),
  :func:`weights_map_of`: the raw reads everyone else makes through here, and the two writes metapatch
  makes to a hook's state, :func:`attach` (a ``SequentialHook`` in place of the attached hook) and
  :func:`serve_from` (an ``Overlay`` in front of its weights map).

No other module reads ``_hf_hook``, a hook's ``weights_map`` or its ``execution_device``
(``tests/test_hook_state.py`` checks).

Nothing here imports accelerate: a process that never imported ``accelerate.hooks`` has no hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, List, NamedTuple, Optional

DISK, CPU, UNKNOWN = "disk", "cpu", "the offload store"


def _hooks_module() -> Any:
    return sys.modules.get("accelerate.hooks")


def attached_hook(module: Any) -> Optional[Any]:
    """The hook accelerate attached to ``module`` itself (a ``SequentialHook`` as it is), or None."""
    return getattr(module, "__dict__", {}).get("_hf_hook") if module is not None else None


def hooked(module: Any) -> bool:
    """Whether accelerate attached a hook to ``module`` itself (asked of every module on hot walks)."""
    return "_hf_hook" in getattr(module, "__dict__", {})


def hooked_as_accelerate_asks(module: Any) -> bool:
    """``hasattr(module, "_hf_hook")``, accelerate's own question: unlike :func:`hooked`, a wrapper that
    forwards attribute look-ups (PEFT's models) answers for the model it wraps. For code that must decide
    as accelerate decides."""
    return hasattr(module, "_hf_hook")


def hooked_modules_alive(modules: Optional[List[Any]] = None) -> List[Any]:
    """Every live torch module accelerate attached a hook to itself (among ``modules``, or every live one: a walk of
    the garbage collector's objects), for a patch applied after models were dispatched (``import metapatch`` after
    ``from_pretrained(device_map=...)``), whose hooks it never saw attached. Asked once per late application, never
    on a hot path."""
    if _hooks_module() is None:
        return []
    if modules is None:
        from metapatch._offload.module_walk import live_modules

        modules = live_modules()
    return [module for module in modules if hooked(module)]


def attach(module: Any, hook: Any) -> None:
    """Make ``hook`` the one accelerate runs for ``module`` (in place of what was attached: the caller
    wraps that in a ``SequentialHook`` when it keeps it); accelerate's ``add_hook_to_module`` also
    initialises the hook and wraps ``forward``, which a replacement of an attached hook must not repeat."""
    module._hf_hook = hook


def weights_map_of(hook: Any) -> Any:
    """The mapping ``hook`` loads its module's tensors from (None: it serves none)."""
    return getattr(hook, "weights_map", None)


def serve_from(hook: Any, mapping: Any) -> None:
    """From now on ``hook`` loads its module's tensors from ``mapping`` (an :class:`Overlay` in front of the
    map it served)."""
    hook.weights_map = mapping


def hooks_on(module: Any) -> List[Any]:
    """Every accelerate hook attached to ``module`` itself, a ``SequentialHook``'s members in order."""
    hook = attached_hook(module)
    if hook is None:
        return []
    hooks_module = _hooks_module()
    if hooks_module is not None and isinstance(hook, hooks_module.SequentialHook):
        return list(hook.hooks)
    return [hook]


def align_hooks(module: Any) -> List[Any]:
    """The ``AlignDevicesHook``\\ s on ``module`` itself (offloading or not)."""
    hooks = hooks_on(module)
    hooks_module = _hooks_module() if hooks else None
    if hooks_module is None:
        return []
    return [h for h in hooks if isinstance(h, hooks_module.AlignDevicesHook)]


def offload_hooks(module: Any) -> List[Any]:
    """The hooks on ``module`` itself that offload its weights right now (``offload`` on)."""
    return [h for h in align_hooks(module) if h.offload]


def offload_hook(module: Any) -> Optional[Any]:
    """The hook that offloads ``module``'s own tensors and serves them from a ``weights_map``, or None."""
    hook = attached_hook(module)
    if hook is None:
        return None  # asked of every module at every adapter load: most carry no hook
    hooks_module = _hooks_module()
    if hooks_module is not None and type(hook) is hooks_module.AlignDevicesHook:  # the common case, directly
        return hook if hook.offload and hook.weights_map is not None else None
    return next((h for h in offload_hooks(module) if h.weights_map is not None), None)


def execution_device(hook: Any) -> Optional[Any]:
    """The ``torch.device`` ``hook`` names as its execution device, or None where it names none. accelerate's int
    ``i`` is read as ``tensor.to(i)`` reads it (the accelerator's device ``i``: GPU ``i`` on a CUDA machine)."""
    device = getattr(hook, "execution_device", None)
    if device is None:
        return None
    import torch

    if isinstance(device, int):
        try:
            return torch.device(device)  # the current accelerator's device i (older torch: always CUDA's)
        except RuntimeError:  # no accelerator here: the hook could not run anyway; name what it means
            return torch.device("cuda", device)
    return torch.device(device)


def compute_device(hook: Any) -> Any:
    """The ``torch.device`` ``hook`` loads its module's tensors onto for a forward: where the in-memory model would
    hold them (:func:`execution_device`; the CPU where the hook names none)."""
    device = execution_device(hook)
    if device is None:
        import torch

        return torch.device("cpu")
    return device


class Located(NamedTuple):
    """Where one key of a weights map is held."""

    store: str  # DISK (an index entry of accelerate's loader) or CPU (a tensor in memory)
    holder: Any  # the mapping that holds it: a state dict, an Overlay's kept tensors, the loader
    key: str  # its key in ``holder``
    folder: Optional[str]  # the offload folder, for DISK

    @property
    def entry(self) -> Any:
        """The held object without loading from disk: the tensor, or the loader's index entry."""
        return self.holder.index[self.key] if self.store == DISK else self.holder[self.key]


_OPAQUE = object()  # a store this reader cannot look into


def _is_overlay(weights_map: Any) -> bool:
    """metapatch's :class:`metapatch._offload.store.Overlay` (kept tensors in front of the previous map), known
    by its two attributes as accelerate's maps are known by theirs: the store builds on this reader."""
    return hasattr(weights_map, "kept") and hasattr(weights_map, "previous")


def _find(weights_map: Any, key: str) -> Any:
    for _ in range(32):
        if weights_map is None:
            return None
        if _is_overlay(weights_map):  # what an operation wrote, in front of the old map
            if key in weights_map.kept:
                return Located(CPU, weights_map.kept, key, None)
            if key in getattr(weights_map, "conversions", ()):
                return _OPAQUE  # served converted: what the store below holds is not what is served
            weights_map = weights_map.previous
        elif hasattr(weights_map, "prefix") and hasattr(weights_map, "dataset"):  # PrefixedDataset
            weights_map, key = weights_map.dataset, weights_map.prefix + key
        elif hasattr(weights_map, "index") and hasattr(weights_map, "state_dict") \
                and hasattr(weights_map, "save_folder"):  # OffloadedWeightsLoader: RAM state dict + disk index
            if key in weights_map.state_dict:
                return Located(CPU, weights_map.state_dict, key, None)
            if key in (weights_map.index or {}):
                return Located(DISK, weights_map, key, weights_map.save_folder)
            return None
        elif isinstance(weights_map, Mapping):
            return Located(CPU, weights_map, key, None) if key in weights_map else None
        else:
            return _OPAQUE
    return _OPAQUE


def locate(weights_map: Any, key: str) -> Optional[Located]:
    """Where ``key`` of ``weights_map`` is held, or None when it holds no such key or is a store this
    reader cannot look into (a custom ``Mapping`` is asked with ``in``)."""
    found = _find(weights_map, key)
    return None if found is _OPAQUE else found


def holds(weights_map: Any, key: str) -> bool:
    """Whether ``weights_map`` serves ``key``; a store this reader cannot look into is trusted to."""
    return _find(weights_map, key) is not None


def storage(hook: Any) -> str:
    """Where an offload hook keeps its module's weights: DISK when any of them is in the offload folder,
    CPU when they are in memory, UNKNOWN when the hook serves no weights map this reader can look into."""
    weights_map = weights_map_of(hook)
    if weights_map is None:
        return UNKNOWN
    names = list(getattr(hook, "original_devices", None) or ())
    places = {found.store for found in (locate(weights_map, n) for n in names) if found is not None}
    if places:
        return DISK if DISK in places else CPU
    # No tensor names recorded (a hook built by hand): any index entry under the map's prefix.
    inner, prefix = _unwrapped(weights_map)
    index = getattr(inner, "index", None) or {}
    return DISK if any(k.startswith(prefix) for k in index) else CPU


def _unwrapped(weights_map: Any) -> "tuple[Any, str]":
    """The store under a weights map's overlays and ``PrefixedDataset`` views, and the key prefix the views add
    in front of its module's tensor names."""
    prefix = ""
    for _ in range(32):
        if _is_overlay(weights_map):
            weights_map = weights_map.previous
        elif hasattr(weights_map, "prefix") and hasattr(weights_map, "dataset"):
            prefix, weights_map = prefix + weights_map.prefix, weights_map.dataset
        else:
            break
    return weights_map, prefix


def _prefix(weights_map: Any) -> str:
    """The key prefix a weights map adds in front of its module's tensor names (``PrefixedDataset``)."""
    return _unwrapped(weights_map)[1]


def served_placeholders(module: Any) -> List[Any]:
    """``(name, parameter)`` for each parameter of ``module`` that is a meta placeholder its offload hook serves
    from a weights map (with ``place_submodules``, those of its submodules too); ``name`` is the key the weights
    map stores it under (the checkpoint name where accelerate's ``PrefixedDataset`` gives one)."""
    hook = offload_hook(module)
    if hook is None:
        return []
    weights_map = weights_map_of(hook)
    prefix = _prefix(weights_map)
    recurse = bool(getattr(hook, "place_submodules", False))
    return [(prefix + name, param) for name, param in module.named_parameters(recurse=recurse)
            if param.is_meta and holds(weights_map, name)]
