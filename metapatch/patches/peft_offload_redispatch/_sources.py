"""Where the offloaded tensors of a model are read from, captured from accelerate's hooks before
anyone removes them, and a state dict that reads through those same sources (nothing is copied)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

# -- where offloaded tensors live ------------------------------------------------------------------


class OffloadedTensors(Mapping):
    """A state dict whose values are read on access: an in-memory tensor, or a key of an earlier
    accelerate weights map (which reads the same safetensors/.dat file it always read). Handed to
    ``dispatch_model`` as ``state_dict``, so the hooks read through it and no file is written."""

    def __init__(self) -> None:
        self.entries: Dict[str, Tuple[Any, Optional[str]]] = {}  # name -> (tensor, None) | (mapping, key)

    def add_tensor(self, name: str, tensor: Any) -> None:
        self.entries[name] = (tensor, None)

    def __getitem__(self, name: str) -> Any:
        holder, key = self.entries[name]
        return holder if key is None else holder[key]

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _source(weights_map: Any, key: str) -> Optional[Tuple[Any, Optional[str]]]:
    """What really holds ``key`` of an accelerate weights map (:func:`metapatch._offload.hook_state.locate`,
    which reads nothing from disk): (tensor, None) in memory, (loader, key) on disk."""
    from metapatch._offload.hook_state import DISK, locate

    found = locate(weights_map, key)
    if found is None:
        return None
    if isinstance(found.holder, OffloadedTensors):  # an earlier re-dispatch's sources: read through them
        return found.holder.entries.get(found.key)
    return (found.holder, found.key) if found.store == DISK else (found.holder[found.key], None)


def capture_sources(root: Any) -> Dict[int, Tuple[Any, Dict[str, Any]]]:
    """Where every tensor offloaded by an accelerate hook under ``root`` is read from, keyed by the
    module object (names change when PEFT wraps a layer; the module does not)."""
    from metapatch._offload.hook_state import hooked, offload_hooks, weights_map_of
    from metapatch._offload.module_walk import modules

    found: Dict[int, Tuple[Any, Dict[str, Any]]] = {}
    for module in modules(root):
        if not hooked(module):
            continue
        for hook in offload_hooks(module):
            served = weights_map_of(hook)
            if served is None:
                continue
            tensors = {}
            for name in getattr(hook, "original_devices", {}) or {}:
                source = _source(served, name)
                if source is not None:
                    tensors[name] = source
            if tensors:
                found.setdefault(id(module), (module, {}))[1].update(tensors)
    return found


def _sources_by_name(model: Any, captured: Dict[int, Tuple[Any, Dict[str, Any]]],
                     modules: Optional[Iterable[Tuple[str, Any]]] = None) -> Dict[str, Any]:
    """The captured sources under the tensors' current names. ``modules``: ``named_modules(model)``,
    where the caller has walked the model already."""
    from metapatch._offload.adapter_offload import named_modules

    named = {}
    for module_name, module in (named_modules(model) if modules is None else modules):
        entry = captured.get(id(module))
        if entry is not None:
            for tensor_name, source in entry[1].items():
                named[f"{module_name}.{tensor_name}" if module_name else tensor_name] = source
    return named


def _value(source: Tuple[Any, Optional[str]]) -> Any:
    holder, key = source
    return holder if key is None else holder[key]



def values_of(sources: Sequence[Tuple[Any, Optional[str]]]) -> List[Any]:
    """The values of several sources, in order. Those accelerate's loader reads from a safetensors file
    (the checkpoint itself, for a base offloaded by ``from_pretrained``) are read with each file opened
    once: the loader opens the file again for every tensor, which was most of what bringing a disk
    layer into memory cost. The same bytes, cast as the loader casts them; anything else (a ``.dat``
    file, a tensor in memory, another loader, another device) is read through its holder."""
    values: List[Any] = [None] * len(sources)
    by_file: Dict[str, List[Tuple[int, str, Dict[str, Any]]]] = {}
    for index, source in enumerate(sources):
        info = _checkpoint_entry(*source)
        if info is None:
            values[index] = _value(source)
        else:
            by_file.setdefault(info["safetensors_file"], []).append((index, source[1], info))
    if by_file:
        import torch
        from safetensors import safe_open

        for path, entries in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as handle:
                for index, key, info in entries:
                    tensor = handle.get_tensor(info.get("weight_name", key))
                    if "dtype" in info:
                        tensor = tensor.to(getattr(torch, info["dtype"]))
                    values[index] = tensor
    return values


def _checkpoint_entry(holder: Any, key: Optional[str]) -> Optional[Dict[str, Any]]:
    """The index entry of ``key`` where ``holder`` is accelerate's own loader reading it, onto the CPU,
    from a safetensors file; None otherwise."""
    from accelerate.utils import OffloadedWeightsLoader

    if key is None or type(holder) is not OffloadedWeightsLoader \
            or (holder.device is not None and str(holder.device) != "cpu") or key in holder.state_dict:
        return None
    info = holder.index.get(key)
    return info if isinstance(info, dict) and info.get("safetensors_file") is not None else None
