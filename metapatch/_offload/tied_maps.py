"""Checking a device map against tied groups and budgets, and running upstream's allocator on the
tie-free problem (part of metapatch._offload.tied_groups, which re-exports everything here).

Import-cheap: nothing from torch or the Hugging Face stack at module level.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .tied_members import Group, tied_groups
from .tied_placement import entry_of


# ---------------------------------------------------------------------------------------------
# Checking a map (used by the reproducers and tests)


def bytes_per_device(model: Any, device_map: Mapping[str, Any], groups: Optional[Sequence[Group]] = None,
                     include_buffers: bool = True) -> Dict[Any, int]:
    """Bytes each device holds under ``device_map``, each tied tensor counted once (where its anchor is)."""
    groups = tied_groups(model) if groups is None else groups
    non_anchor = {m for g in groups for m in g[1:]}
    totals: Dict[Any, int] = defaultdict(int)
    tensors = [(n, t, True) for n, t in model.named_parameters(remove_duplicate=False)]
    if include_buffers:
        tensors += [(n, t, False) for n, t in model.named_buffers(remove_duplicate=False)]
    seen = set()
    for name, tensor, is_param in tensors:
        if name in non_anchor or name in seen:
            continue
        seen.add(name)
        key = entry_of(device_map, name)
        if key is None:
            if is_param:
                raise KeyError(f"{name} is not placed by the device map")
            continue  # accelerate leaves the buffers of split modules out of its maps
        totals[device_map[key]] += tensor.numel() * tensor.element_size()
    return dict(totals)


def map_is_sound(model: Any, device_map: Mapping[str, Any], groups: Sequence[Group],
                 budgets: Optional[Mapping[Any, int]]) -> bool:
    """Every tied group on one device and no device past its budget (tied tensors counted once).
    Used to keep upstream's own map wherever upstream got it right."""
    if split_groups(model, device_map, groups):
        return False
    try:
        used = bytes_per_device(model, device_map, groups)
    except KeyError:  # parameters deliberately left out of the map (transformers' no_placement_params)
        return True
    return all(used.get(device, 0) <= budget for device, budget in (budgets or {}).items() if device != "disk")


def upstream_map_if_sound(wrapped: Callable, args: tuple, kwargs: dict, max_memory: Any, model: Any,
                          groups: Sequence[Group]) -> Optional[Dict[str, Any]]:
    """Upstream's own map where it is right (every tied group on one device, every budget kept),
    else None - also when upstream raises IndexError in get_module_size_with_ties, which it does
    once a group member is placed before its source."""
    try:
        device_map = wrapped(*args, **kwargs)
    except IndexError:
        return None
    budgets = wrapped.__globals__["get_max_memory"](dict(max_memory) if max_memory else None)
    return device_map if map_is_sound(model, device_map, groups, budgets) else None


def sources_come_first(groups: Sequence[Group], parameters: Mapping[str, Any]) -> bool:
    """Each group's source is the first of its names in module order: upstream's allocators then count
    it once and meet it before its copies (otherwise they raise IndexError or count it 0 times)."""
    position = {name: i for i, name in enumerate(parameters)}
    return all(position[g[0]] < min(position[m] for m in g[1:]) for g in groups)


def all_tied_identically(model: Any, groups: Sequence[Group], parameters: Mapping[str, Any]) -> bool:
    """Every group is already one tensor (what identity-based tie handling sees correctly)."""
    return all(all(parameters[m] is parameters[g[0]] for m in g[1:]) for g in groups)


def unplaced_parameters(model: Any, device_map: Mapping[str, Any]) -> List[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False) if entry_of(device_map, n) is None]


def split_groups(model: Any, device_map: Mapping[str, Any], groups: Optional[Sequence[Group]] = None) -> List[Group]:
    groups = tied_groups(model) if groups is None else groups
    return [g for g in groups if len({device_map[entry_of(device_map, m)] for m in g
                                      if entry_of(device_map, m) is not None}) > 1]


def ordered(device_map: Mapping[str, Any]) -> "OrderedDict[str, Any]":
    return OrderedDict(device_map)


# ---------------------------------------------------------------------------------------------
# Running upstream's allocator on the tie-free problem


def clone_with_globals(func: Callable, overrides: Mapping[str, Any], also_clone: Sequence[str] = ()) -> Callable:
    """A private copy of ``func`` (and of the module functions named in ``also_clone``) that sees
    ``overrides`` instead of its module's globals. Nothing in the module changes, so concurrent
    callers of the real functions are unaffected."""
    import types

    namespace = dict(func.__globals__)
    namespace.update(overrides)

    def copy(f: Callable) -> Callable:
        new = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__, f.__closure__)
        new.__kwdefaults__ = dict(f.__kwdefaults__) if f.__kwdefaults__ else None
        new.__qualname__ = f.__qualname__
        return new

    for name in also_clone:
        namespace[name] = copy(namespace[name])
    return copy(func)


def speed_order(devices: Iterable[Any]) -> List[Any]:
    """Accelerators (in index order) before mps, cpu, then disk."""
    def key(device: Any) -> Tuple[int, str]:
        text = str(device)
        if text == "disk":
            return (3, text)
        if text == "cpu":
            return (2, text)
        if text == "mps":
            return (1, text)
        return (0, text.rjust(8))
    unique: List[Any] = []
    for device in devices:
        if device not in unique:
            unique.append(device)
    return sorted(unique, key=key)
