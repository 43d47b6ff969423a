"""Where a re-dispatch's tensors are and where their values come from: every parameter and buffer of the PEFT
model with whether it is an adapter's (:func:`module_tensors`, one walk), and the values placed under a new
map (:func:`_place_tensors`: offloaded ones served from their old source or their current value, in-memory
ones read back; only tensors newly sent to disk with an ``offload_dir`` are written, there). Shared by the
whole re-dispatch (:mod:`._redispatch`) and the one that re-hooks only what moves (:mod:`._incremental`)."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple

from metapatch._framework.records import MetapatchError

from ._placement import _placement_of
from ._sources import OffloadedTensors, values_of


def _write_new_disk_tensors(tensors: Dict[str, Any], offload_dir: str, weights: OffloadedTensors) -> None:
    from accelerate.utils import OffloadedWeightsLoader, offload_state_dict

    offload_state_dict(offload_dir, {k: v.detach().cpu() for k, v in tensors.items()})
    loader = OffloadedWeightsLoader(save_folder=offload_dir)
    for name in tensors:
        weights.entries[name] = (loader, name)


def _adapter_tensor_names(model: Any) -> set:
    """Names of the tuner layers' own tensors (``lora_A.<adapter>.weight``, ...): small, kept with
    their layer's weights map in memory rather than written to an offload file of their own."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            for attr in tuple(module.adapter_layer_names) + tuple(module.other_param_names):
                part = getattr(module, attr, None)
                if isinstance(part, torch.nn.Module):
                    names.update(f"{module_name}.{attr}.{n}" for n, _ in part.named_parameters())
                    names.update(f"{module_name}.{attr}.{n}" for n, _ in part.named_buffers())
    return names


def module_tensors(model: Any, remove_duplicate: bool = True,
                   modules: Optional[Dict[int, Tuple[str, Any]]] = None) -> Iterator[Tuple[str, Any, bool]]:
    """(name, tensor, whether it is a tuner layer's own tensor) for every parameter and buffer slot of
    ``model``'s modules (``named_modules(remove_duplicate=...)``'s order and names), in one walk of the
    module tree; a tensor held by several modules comes once per holder. A module is an adapter's when
    its path, or an earlier path to it, passes through a tuner layer's adapter container (``lora_A``,
    ``ia3_l``, ...). ``modules``, where given, gets every module under its first name (id -> (name, module)),
    in ``named_modules()`` order."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    seen: set = set()
    adapters: set = set()  # modules met under an adapter container: adapters' on every later path too
    tuners: Dict[type, bool] = {}
    stack = [("", model, False)]
    while stack:
        name, module, is_adapter = stack.pop()
        if remove_duplicate:
            if id(module) in seen:
                continue
            seen.add(id(module))
        if modules is not None and id(module) not in modules:
            modules[id(module)] = (name, module)
        if is_adapter:
            adapters.add(id(module))
        elif adapters and id(module) in adapters:
            is_adapter = True
        prefix = f"{name}." if name else ""
        for store in (module._parameters, module._buffers):
            for tensor_name, tensor in store.items():
                if tensor is not None:
                    yield prefix + tensor_name, tensor, is_adapter
        children = module._modules
        if not children:
            continue
        parts: Any = ()
        if not is_adapter:
            tuner = tuners.get(type(module))
            if tuner is None:
                tuner = tuners[type(module)] = issubclass(type(module), BaseTunerLayer)  # an ABC: asked once per class
            if tuner:
                parts = set(module.adapter_layer_names) | set(module.other_param_names)
        stack.extend(reversed([(prefix + child_name, child, is_adapter or child_name in parts)
                               for child_name, child in children.items() if child is not None]))


def _place_tensors(model: Any, device_map: Dict[str, Any], sources: Dict[str, Any], offloaded_devices: set,
                   offload_dir: Optional[str], tensors: Optional[list] = None) -> OffloadedTensors:
    """Decide where every tensor's value comes from under the new map (or only ``tensors``'s:
    (name, tensor, whether it is an adapter's) of the entries that move): offloaded ones are served by
    the returned mapping (their old source, or their current value), in-memory ones are read back
    from their offload source when they are on meta. Only tensors newly sent to disk with an
    ``offload_dir`` are written, there."""
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    weights, new_disk, kept_in_memory, onloaded = OffloadedTensors(), {}, [], []
    full = tensors is None
    if full:
        adapters = _adapter_tensor_names(model)
        tensors = [(name, tensor, name in adapters)
                   for name, tensor in named_module_tensors(model, include_buffers=True, recurse=True)]
    for name, tensor, is_adapter in tensors:
        where = _placement_of(name, device_map)
        if tensor.device.type == "meta" and name not in sources:
            raise MetapatchError(f"metapatch (peft-offload-redispatch): {name} is on meta and no offload hook knows "
                                 "where its value is; refusing to dispatch a model with missing values")
        if str(where) not in offloaded_devices:
            if tensor.device.type == "meta":
                onloaded.append((name, where))
        elif name in sources:
            weights.entries[name] = sources[name]
        elif str(where) == "disk" and offload_dir is not None:
            new_disk[name] = tensor
        else:
            # offloaded from now on: held in CPU memory, as accelerate's store is (a tensor on a GPU would keep its
            # GPU memory; on the CPU this is the tensor itself)
            weights.add_tensor(name, tensor.detach().to("cpu"))
            if str(where) == "disk" and not is_adapter:
                kept_in_memory.append(name)
    if full:
        _serve_tied_aliases(model, device_map, sources, offloaded_devices, weights)
    # Read together: the tensors of one checkpoint file with the file opened once.
    for (name, where), value in zip(onloaded, values_of([sources[name] for name, _ in onloaded])):
        set_module_tensor_to_device(model, name, where, value=value)
    if new_disk:
        _write_new_disk_tensors(new_disk, offload_dir, weights)
    if kept_in_memory:
        import logging

        logging.getLogger("metapatch").warning(
            "metapatch: %d tensors newly placed on disk (%s, …) stay in CPU memory: pass offload_dir "
            "to PeftModel.from_pretrained/load_adapter to write them there", len(kept_in_memory), kept_in_memory[0])
    return weights


def _serve_tied_aliases(model: Any, device_map: Dict[str, Any], sources: Dict[str, Any], offloaded_devices: set,
                        weights: OffloadedTensors) -> None:
    """Give every further name of a tensor held by several modules (a tied head: ``lm_head.weight`` is
    ``embed_tokens.weight``) its own entry where its module is offloaded. The walk above names each tensor once,
    under its first name; ``dispatch_model`` then hooks every module holding it, and each hook looks its own
    name up in the weights map (a re-dispatch that kept no entry for the head failed its first forward with
    ``KeyError: 'base_model.model.lm_head.weight'``). The entry is the name's own captured source, else the
    first name's: the same tensor, read from where it was."""
    first: Dict[int, str] = {}
    for name, tensor, _ in module_tensors(model, remove_duplicate=False):
        if id(tensor) not in first:
            first[id(tensor)] = name
            continue
        if name in weights.entries or str(_placement_of(name, device_map)) not in offloaded_devices:
            continue
        if name in sources:
            weights.entries[name] = sources[name]
        elif first[id(tensor)] in weights.entries:
            weights.entries[name] = weights.entries[first[id(tensor)]]


def _device_of(placement: Any) -> Any:
    import torch

    wanted = torch.device("cuda", placement) if isinstance(placement, int) else torch.device(str(placement))
    if wanted.type != "cpu" and wanted.index is None:
        wanted = torch.device(wanted.type, 0)
    return wanted


def _same_device(device: Any, placement: Any) -> bool:
    return device == _device_of(placement)
