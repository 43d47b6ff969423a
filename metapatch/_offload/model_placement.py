"""Where a loaded model's tensors are, read for :mod:`metapatch.diagnose`: which meta tensors an offload
hook will fill, each parameter's placement (device map entry, offload storage, tensor device), tied
groups, and names collapsed to the highest module that stands for them. Reads only; no torch import."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from .hook_state import holds, offload_hooks, weights_map_of
from .hook_state import storage as _storage

def _module_tensors(module: Any, recurse: bool, buffers: bool) -> Iterator[Tuple[str, Any]]:
    yield from module.named_parameters(recurse=recurse)
    if buffers:
        yield from module.named_buffers(recurse=recurse)


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def covered_meta(model: Any) -> Tuple[set, Dict[str, Any]]:
    """(names of meta tensors an offload hook will fill, {offloaded module name: hook})."""
    covered, offloaded = set(), {}
    for module_name, module in model.named_modules():
        for hook in offload_hooks(module):
            recurse = bool(hook.place_submodules)
            hits = [n for n, t in _module_tensors(module, recurse, bool(hook.offload_buffers))
                    if t.is_meta and holds(weights_map_of(hook), n)]
            if hits:
                offloaded[module_name] = hook
                covered.update(join_name(module_name, n) for n in hits)
    return covered, offloaded


def collapse(names: Iterable[str]) -> List[str]:
    """Drop names whose parent module is listed too: "model.layers.2" stands for its linears."""
    names = set(names)
    if "" in names:
        return [""]  # the model itself covers everything below it
    ordered = sorted(names, key=lambda n: (n.count("."), n))
    kept: List[str] = []
    for name in ordered:
        if not any(name == k or name.startswith(k + ".") for k in kept):
            kept.append(name)
    return sorted(kept, key=_natural)


def _natural(name: str) -> List[Any]:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def device_map_owner(model: Any) -> Tuple[str, Optional[Mapping[str, Any]]]:
    """(prefix, hf_device_map) of the outermost module carrying one (a PeftModel's base model has it)."""
    for prefix, module in model.named_modules():
        device_map = module.__dict__.get("hf_device_map")
        if isinstance(device_map, Mapping):
            return prefix, device_map
    return "", None


def _entry_of(device_map: Mapping[str, Any], name: str) -> Optional[str]:
    from metapatch._offload.tied_placement import entry_of

    return entry_of(device_map, name)


def tensor_placements(model: Any) -> Dict[str, str]:
    """Where each parameter lives for computation: its hf_device_map entry when there is one,
    otherwise its offload hook's storage, otherwise its tensor's device."""
    prefix, device_map = device_map_owner(model)
    _, offloaded = covered_meta(model)
    result = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        place = None
        if device_map is not None and (not prefix or name.startswith(prefix + ".")):
            key = _entry_of(device_map, name[len(prefix) + 1:] if prefix else name)
            if key is not None:
                place = str(device_map[key])
        if place is None:
            owner = max((m for m in offloaded if not m or name.startswith(m + ".")), key=len, default=None)
            place = _storage(offloaded[owner]) if owner is not None else str(param.device)
        result[name] = place
    return result


def tied_groups_of(model: Any) -> List[Tuple[str, ...]]:
    try:
        from metapatch._offload.tied_members import tied_groups
    except ImportError:  # pragma: no cover - fallback: identity only
        by_id: Dict[int, List[str]] = defaultdict(list)
        for name, param in model.named_parameters(remove_duplicate=False):
            by_id[id(param)].append(name)
        return [tuple(v) for v in by_id.values() if len(v) > 1]
    return tied_groups(model)


def fully_offloaded_roots(model: Any, covered: set) -> List[str]:
    """The highest modules whose every tensor is an offloaded placeholder: "model.layers.2" rather
    than its nine linears and norms."""
    found: List[str] = []

    def visit(name: str, module: Any) -> None:
        tensors = [join_name(name, n) for n, _ in _module_tensors(module, True, True)]
        if tensors and all(t in covered for t in tensors):
            found.append(name or "(model)")
            return
        for child, sub in module.named_children():
            visit(join_name(name, child), sub)

    visit("", model)
    return found


def map_offloads(device_map: Dict[str, Any]) -> bool:
    """Whether ``dispatch_model`` offloads part of a model placed by ``device_map``: ``disk`` always,
    ``cpu`` when the main device is an accelerator (the first entry on neither cpu nor disk)."""
    values = [str(value) for value in device_map.values()]
    if "disk" in values:
        return True
    main = next((value for value in values if value not in ("cpu", "disk")), "cpu")
    return "cpu" in values and main not in ("cpu", "mps")
