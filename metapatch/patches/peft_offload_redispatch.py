"""peft-offload-redispatch: a PEFT adapter loaded onto a base model offloaded to cpu/disk keeps the
base's placement, its offloaded weights where they are, and the model's ``skip_keys``.

Upstream ``PeftModel.load_adapter`` (peft <= 0.21.2, unfixed on main) re-dispatches the wrapped
model whenever the base's ``hf_device_map`` holds ``cpu`` or ``disk``: it infers a brand-new map
(everything fits in memory on a CPU-only machine, so ``dispatch_model`` calls ``model.to`` on meta
weights), has ``_update_offload`` rewrite the base's safetensors file with the wrapper's key names to
``os.path.join(*fname.split(os.sep))`` (an absolute path made relative to the working directory: run
from ``/`` it overwrites the user's checkpoint, elsewhere it copies it), and dispatches without
``skip_keys`` (Gemma 4's shared KV is then written into copies). The LoRA weights of offloaded layers
are moved onto meta on creation and only survive through that rewritten file.

Here, while an adapter is being added to such a model:

* the adapter's loaded tensors are assigned (PEFT's ``low_cpu_mem_usage`` path) and stay on the CPU
  instead of following their offloaded base layer onto meta, where loading them is a no-op;
* upstream's re-dispatch is skipped (``hf_device_map`` is hidden from ``load_adapter`` for the
  call), and metapatch re-dispatches instead: the current placement re-keyed for the wrapper, the
  offloaded base weights read from where accelerate already reads them (the same index entries,
  the same files; nothing is copied or re-saved), the adapter weights of an offloaded layer kept in
  that layer's weights map, ``skip_keys`` from the model. ``_update_offload`` is not called, so
  nothing is written anywhere;
* an explicit ``device_map`` (the wrapper's module names, or the base's as the seed passed them),
  ``device_map="auto"``-style strategies, ``max_memory`` and ``offload_dir``/``offload_folder`` are
  honoured as PEFT documents them: weights the new map brings into memory are read back from their
  offload files, tensors it newly sends to disk are written to ``offload_dir`` only (without one
  they stay in CPU memory, with a warning);
* ``merge_and_unload`` (and merge/unmerge) work on such a model: ``onload_layer`` no longer reads
  every offloaded tensor to look up a file name it never uses (a KeyError with this weights map).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Optional, Tuple

from metapatch._records import MetapatchError, Patch, Target, Upstream

from .accelerate_dispatch_skip_keys import model_skip_keys

PATCH_ID = "peft-offload-redispatch"

_OFFLOADED = {"cpu", "disk"}
_PEFT_DISPATCH_KWARGS = ("device_map", "max_memory", "offload_dir", "offload_folder", "offload_index")

# Set while an adapter is being added to an offloaded base: {id(module): (module, {tensor: source})}
# captured from accelerate's hooks before anyone removes them.
_ADDING = contextvars.ContextVar("metapatch_peft_offload_adding", default=None)


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
    """Unwrap accelerate's PrefixedDataset/OffloadedWeightsLoader down to what really holds ``key``,
    without loading it (Mapping's ``in`` would read the file)."""
    from accelerate.utils import OffloadedWeightsLoader, PrefixedDataset

    for _ in range(32):
        if isinstance(weights_map, PrefixedDataset):
            weights_map, key = weights_map.dataset, weights_map.prefix + key
        elif isinstance(weights_map, OffloadedWeightsLoader):
            if key in weights_map.state_dict:
                inner = weights_map.state_dict
                if isinstance(inner, OffloadedTensors):
                    return inner.entries[key]
                return inner[key], None
            if key in weights_map.index:
                return weights_map, key
            return None
        elif isinstance(weights_map, OffloadedTensors):
            return weights_map.entries.get(key)
        elif isinstance(weights_map, Mapping):
            return (weights_map[key], None) if key in weights_map else None
        else:
            return None
    return None


def _hooks(module: Any) -> list:
    from accelerate.hooks import SequentialHook

    hook = module.__dict__.get("_hf_hook")
    if hook is None:
        return []
    return list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]


def capture_sources(root: Any) -> Dict[int, Tuple[Any, Dict[str, Any]]]:
    """Where every tensor offloaded by an accelerate hook under ``root`` is read from, keyed by the
    module object (names change when PEFT wraps a layer; the module does not)."""
    from accelerate.hooks import AlignDevicesHook

    found: Dict[int, Tuple[Any, Dict[str, Any]]] = {}
    for module in root.modules():
        for hook in _hooks(module):
            if not (isinstance(hook, AlignDevicesHook) and hook.offload and hook.weights_map is not None):
                continue
            tensors = {}
            for name in getattr(hook, "original_devices", {}) or {}:
                source = _source(hook.weights_map, name)
                if source is not None:
                    tensors[name] = source
            if tensors:
                found.setdefault(id(module), (module, {}))[1].update(tensors)
    return found


def _sources_by_name(model: Any, captured: Dict[int, Tuple[Any, Dict[str, Any]]]) -> Dict[str, Any]:
    named = {}
    for module_name, module in model.named_modules():
        entry = captured.get(id(module))
        if entry is not None:
            for tensor_name, source in entry[1].items():
                named[f"{module_name}.{tensor_name}" if module_name else tensor_name] = source
    return named


def _value(source: Tuple[Any, Optional[str]]) -> Any:
    holder, key = source
    return holder if key is None else holder[key]


# -- placement ---------------------------------------------------------------------------------------


def _is_offloaded(base: Any) -> bool:
    device_map = getattr(base, "__dict__", {}).get("hf_device_map")
    return isinstance(device_map, dict) and bool(_OFFLOADED & set(map(str, device_map.values())))


def _prefixed(base_map: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    return {(f"{prefix}.{k}" if k else prefix): v for k, v in base_map.items()}


def _base_prefix(model: Any, base: Any) -> str:
    for name, module in model.named_modules():
        if module is base:
            return name
    raise MetapatchError("metapatch (peft-offload-redispatch): the PEFT model does not contain its base model")


def _user_map(model: Any, base: Any, prefix: str, device_map: Dict[str, Any]) -> Dict[str, Any]:
    """A user's map in the wrapper's names: the base's own names (what the seed passed) are re-keyed."""
    wrapper_names = set(dict(model.named_modules()))
    named = [k for k in device_map if k]
    if named and all(k in wrapper_names for k in named):
        return dict(device_map)
    base_names = set(dict(base.named_modules()))
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
    best = None
    for key in device_map:
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > len(best):
                best = key
    return None if best is None else device_map[best]


def _cover_the_rest(model: Any, device_map: Dict[str, Any], main: Any) -> Dict[str, Any]:
    """Modules outside the base (prompt encoders, shared banks) go to the main device, as upstream's
    freshly inferred map would put them."""
    from accelerate.utils import named_module_tensors

    for name, _ in named_module_tensors(model, include_buffers=False, recurse=True):
        if _placement_of(name, device_map) is None:
            device_map[name.rpartition(".")[0]] = main
    return device_map


def _main_device(device_map: Dict[str, Any]) -> Any:
    values = set(map(str, device_map.values()))
    if values <= {"cpu", "disk"}:
        return "cpu"
    return next(v for v in device_map.values() if str(v) not in _OFFLOADED)


def new_placement(model: Any, base: Any, options: Dict[str, Any]) -> Dict[str, Any]:
    prefix = _base_prefix(model, base)
    device_map, max_memory = options.get("device_map"), options.get("max_memory")
    if device_map is None and max_memory is None:
        current = model.__dict__.get("hf_device_map")  # an earlier re-dispatch of this wrapper
        chosen = dict(current) if isinstance(current, dict) else _prefixed(base.hf_device_map, prefix)
    elif isinstance(device_map, dict):
        chosen = _user_map(model, base, prefix, device_map)
    else:
        chosen = _inferred_map(model, device_map or "auto", max_memory)
    return _cover_the_rest(model, chosen, _main_device(chosen))


# -- the re-dispatch ---------------------------------------------------------------------------------


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


def _place_tensors(model: Any, device_map: Dict[str, Any], sources: Dict[str, Any], offloaded_devices: set,
                   offload_dir: Optional[str]) -> OffloadedTensors:
    """Decide where every tensor's value comes from under the new map: offloaded ones are served by
    the returned mapping (their old source, or their current value), in-memory ones are read back
    from their offload source when they are on meta. Only tensors newly sent to disk with an
    ``offload_dir`` are written, there."""
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    weights, new_disk, kept_in_memory = OffloadedTensors(), {}, []
    adapters = _adapter_tensor_names(model)
    for name, tensor in named_module_tensors(model, include_buffers=True, recurse=True):
        where = _placement_of(name, device_map)
        if tensor.device.type == "meta" and name not in sources:
            raise MetapatchError(f"metapatch (peft-offload-redispatch): {name} is on meta and no offload hook knows "
                                 "where its value is; refusing to dispatch a model with missing values")
        if str(where) not in offloaded_devices:
            if tensor.device.type == "meta":
                set_module_tensor_to_device(model, name, where, value=_value(sources[name]))
        elif name in sources:
            weights.entries[name] = sources[name]
        elif str(where) == "disk" and offload_dir is not None:
            new_disk[name] = tensor
        else:
            weights.add_tensor(name, tensor.detach())
            if str(where) == "disk" and name not in adapters:
                kept_in_memory.append(name)
    if new_disk:
        _write_new_disk_tensors(new_disk, offload_dir, weights)
    if kept_in_memory:
        import logging

        logging.getLogger("metapatch").warning(
            "metapatch: %d tensors newly placed on disk (%s, …) stay in CPU memory: pass offload_dir "
            "to PeftModel.from_pretrained/load_adapter to write them there", len(kept_in_memory), kept_in_memory[0])
    return weights


def redispatch(model: Any, captured: Dict[int, Tuple[Any, Dict[str, Any]]], options: Dict[str, Any]) -> None:
    import torch
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules

    base = model.get_base_model()
    sources = _sources_by_name(model, captured)
    _remove_hooks(model)
    device_map = new_placement(model, base, options)
    main = _main_device(device_map)
    offloaded_devices = {"disk"} if str(main) in ("cpu", "mps") else {"cpu", "disk"}  # as dispatch_model decides
    weights = _place_tensors(model, device_map, sources, offloaded_devices, options.get("offload_dir"))
    has_disk = "disk" in set(map(str, device_map.values()))
    # An (empty) offload_index tells dispatch_model the weights are offloaded already: it saves none.
    dispatch_model(model, device_map=device_map, main_device=main, state_dict=weights,
                   offload_index={} if has_disk else None, skip_keys=model_skip_keys(model),
                   offload_buffers=bool(options.get("offload_buffers", False)))
    if any(getattr(c, "is_prompt_learning", False) for c in getattr(model, "peft_config", {}).values()) \
            and isinstance(getattr(model, "prompt_encoder", None), torch.nn.Module):
        remove_hook_from_submodules(model.prompt_encoder)  # as upstream: the prompt encoder runs unhooked
    # As upstream: outputs come back on the inputs' device.
    add_hook_to_module(base, AlignDevicesHook(io_same_device=True), append="_hf_hook" in base.__dict__)


def _remove_hooks(model: Any) -> None:
    """accelerate's remove_hook_from_submodules asks ``hasattr(module, "_hf_hook")``, which PEFT's
    wrappers answer by forwarding to the base model, and then fails to delete it from the wrapper:
    only modules that hold a hook themselves are unhooked."""
    from accelerate.hooks import remove_hook_from_module

    for module in list(model.modules()):
        if "_hf_hook" in module.__dict__:
            remove_hook_from_module(module)


# -- wrappers ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _hidden_device_map(*holders: Any) -> Iterator[None]:
    """Upstream decides to re-dispatch from ``hf_device_map``: without it, it leaves placement to us."""
    saved = [(h, h.__dict__.pop("hf_device_map")) for h in holders if "hf_device_map" in h.__dict__]
    try:
        yield
    finally:
        for holder, value in saved:
            holder.__dict__["hf_device_map"] = value


def _options(kwargs: dict) -> Dict[str, Any]:
    options = {k: kwargs.pop(k) for k in _PEFT_DISPATCH_KWARGS if k in kwargs}
    kwargs.pop("offload_index", None)  # upstream's own re-keyed copy of the index: not used
    options.pop("offload_index", None)
    folder, directory = options.pop("offload_folder", None), options.get("offload_dir")
    if folder is not None and directory is not None:
        raise ValueError("Cannot use `offload_folder` when `offload_dir` is specified.")  # upstream's message
    if directory is None and folder is not None:
        options["offload_dir"] = folder
    if "offload_buffers" in kwargs:
        options["offload_buffers"] = kwargs["offload_buffers"]
    return options


def _from_pretrained(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    model = args[0] if args else kwargs.get("model")
    if model is None or not _is_offloaded(model) or _ADDING.get() is not None:
        return wrapped(*args, **kwargs)
    # Upstream removes the hooks before wrapping; what they know about the offloaded weights is
    # read first.
    token = _ADDING.set(capture_sources(model))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _ADDING.reset(token)


def _load_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    base = instance.get_base_model()
    if not _is_offloaded(base):
        return wrapped(*args, **kwargs)
    captured = _ADDING.get()
    if captured is None:
        captured = capture_sources(instance)
    options = _options(kwargs)
    if len(args) < 7:  # not given positionally
        # PEFT moves the adapter of an offloaded layer onto its base layer's meta device when it
        # creates it, so a plain load would be a no-op there; assigning the loaded tensors keeps them
        # (the guard on _move_adapter_to_device_of_base_layer keeps them off meta afterwards).
        kwargs["low_cpu_mem_usage"] = True
    token = _ADDING.set(captured)
    try:
        with _hidden_device_map(base, instance):
            result = wrapped(*args, **kwargs)
    finally:
        _ADDING.reset(token)
    redispatch(instance, captured, options)
    return result


def _move_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """While an adapter is added to an offloaded base, a fresh adapter must not follow its base
    layer's meta weight: that would drop its values before they are loaded."""
    if _ADDING.get() is None:
        return wrapped(*args, **kwargs)
    device = args[1] if len(args) > 1 else kwargs.get("device")
    if device is None:
        import torch

        base_layer = instance.get_base_layer()
        if isinstance(base_layer, torch.nn.MultiheadAttention):
            base_layer = base_layer.out_proj
        base_device, _ = instance._get_base_layer_device_and_dtype(base_layer)
        if base_device is not None and base_device.type == "meta":
            adapter_name = args[0] if args else kwargs["adapter_name"]
            return wrapped(adapter_name, device=torch.device("cpu"))
    return wrapped(*args, **kwargs)


def _onload_layer(original: Any) -> Any:
    """Upstream's ``onload_layer`` (used by merge/unmerge/unload) minus its dead disk-rewrite set-up:
    before loading anything it builds ``dict(weights_map.dataset)`` (every offloaded tensor of the
    model, read from disk) to look one of them up in the offload index for a file name it never uses
    (its rewrite branch tests ``hasattr(dict, "dataset")``), and fails with a KeyError when the index
    does not hold that first key, as after a re-dispatch whose weights map reads through a state
    dict. Merged weights of an offloaded layer stay in its weights map in CPU memory, as upstream."""
    from contextlib import contextmanager

    @contextmanager
    def onload_layer(layer: Any) -> Iterator[None]:
        import torch
        from accelerate.hooks import AlignDevicesHook
        from accelerate.utils import named_module_tensors

        def offloaded(module: Any) -> bool:
            hook = module.__dict__.get("_hf_hook")
            return isinstance(hook, AlignDevicesHook) and hook.offload

        offloaded_modules = []
        for name, module in layer.named_modules():
            if name not in ("", "base_layer") and offloaded(module):
                module._hf_hook.pre_forward(module)
                offloaded_modules.append(module)
        base_layer = getattr(layer, "base_layer", None)
        base_layer_offload = base_layer is not None and offloaded(base_layer)
        if base_layer_offload:
            base_layer._hf_hook.pre_forward(base_layer)
        yield
        for module in offloaded_modules:
            module._hf_hook.post_forward(module, torch.tensor([]))
        if base_layer_offload:
            base_layer._hf_hook.weights_map = {name: param.to("cpu")
                                               for name, param in named_module_tensors(base_layer)}
            base_layer._hf_hook.post_forward(base_layer, torch.tensor([]))

    onload_layer.__doc__ = original.__doc__
    return onload_layer


PATCH = Patch(
    id=PATCH_ID,
    title="PEFT adapters on a cpu/disk-offloaded base keep its placement and checkpoint files (no write "
          "outside the offload folder) and the model's skip_keys",
    # _update_offload (the checkpoint rewrite) and the re-inferred map are both in 0.11.0 onwards;
    # not fixed on peft main (checked 2026-11-29): the range stays open, the fingerprints guard it.
    affects={"peft": ">=0.11.0"},
    targets=(
        Target("peft.peft_model", "PeftModel.from_pretrained", fingerprints=("fa080cb27757e067",),  # peft 0.21.2
               wrapper=_from_pretrained),
        Target("peft.peft_model", "PeftModel.load_adapter", fingerprints=("4c289775b0a6ae1b",),  # peft 0.21.2
               wrapper=_load_adapter),
        Target("peft.tuners.tuners_utils", "BaseTunerLayer._move_adapter_to_device_of_base_layer",
               fingerprints=("5ae3d49c5476a73f",), wrapper=_move_adapter),  # peft 0.21.2
        Target("peft.tuners.tuners_utils", "onload_layer", fingerprints=("607acfd87f017a8a",),
               replacement=_onload_layer),  # peft 0.21.2
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/peft/issues?q=load_adapter+offload+hf_device_map",
             "https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522"),
        forwarded="no",
        note="peft: load_adapter keeps the base placement and passes skip_keys; _update_offload writes nothing "
             "outside the offload folder",
    ),
    diffs=("upstream_diffs/peft-offload-redispatch/peft.diff",),
    selftest="metapatch.selftest.peft_offload",
)
