"""The wrappers around PEFT's entry points (see the package docstring for what each one changes)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Dict, Iterator

from metapatch._offload import adapter_offload, holds, hook_state, model_placement, operations, store as offload_store

from ._placement import is_offloaded
from ._redispatch import redispatch
from ._sources import capture_sources

_PEFT_DISPATCH_KWARGS = ("device_map", "max_memory", "offload_dir", "offload_folder", "offload_index")

# Set (an _Adding) while an adapter is being added to an offloaded base.
_ADDING = contextvars.ContextVar("metapatch_peft_offload_adding", default=None)


@contextlib.contextmanager
def _hidden_device_map(*holders: Any) -> Iterator[None]:
    """Upstream decides from ``hf_device_map`` to remove the base's hooks and to re-dispatch:
    without it, the hooks stay (the adapters are created next to them) and placement is left to us."""
    saved = [(h, h.__dict__.pop("hf_device_map")) for h in holders if "hf_device_map" in h.__dict__]
    try:
        yield
    finally:
        for holder, value in saved:
            holder.__dict__["hf_device_map"] = value


def _options(kwargs: dict) -> Dict[str, Any]:
    options = {k: kwargs.pop(k) for k in _PEFT_DISPATCH_KWARGS if k in kwargs}
    options.pop("offload_index", None)  # upstream's own re-keyed copy of the index: not used
    folder, directory = options.pop("offload_folder", None), options.get("offload_dir")
    if folder is not None and directory is not None:
        raise ValueError("Cannot use `offload_folder` when `offload_dir` is specified.")  # upstream's message
    if directory is None and folder is not None:
        options["offload_dir"] = folder
    if "offload_buffers" in kwargs:
        options["offload_buffers"] = kwargs["offload_buffers"]
    return options


class _Adding:
    """What is known while an adapter is added to an offloaded base: where its offloaded tensors
    are read from (captured from accelerate's hooks before anything changes them), and the PEFT
    dispatch options ``load_adapter`` was given, for the re-dispatch that follows."""

    def __init__(self, captured: Dict[int, Any]) -> None:
        self.captured = captured
        self.options: Dict[str, Any] = {}


def from_pretrained(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``PeftModel.from_pretrained`` / ``PeftMixedModel.from_pretrained``: the base keeps its hooks
    while the adapter is created and loaded (upstream would remove them first); metapatch
    re-dispatches once the model is complete."""
    model = args[0] if args else kwargs.get("model")
    if model is None or not is_offloaded(model) or _ADDING.get() is not None:
        return wrapped(*args, **kwargs)
    adding = _Adding(capture_sources(model))
    token = _ADDING.set(adding)
    try:
        with _hidden_device_map(model):
            result = _keeping_writes(model, "PeftModel.from_pretrained", wrapped, args, kwargs)
    finally:
        _ADDING.reset(token)
    offload_store.refresh_sources(adding.captured)
    redispatch(result, adding.captured, adding.options)
    return result


def _keeping_writes(model: Any, what: str, wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """``wrapped`` as one store operation over ``model``: a tensor it loads into an offloaded module
    (a saved embedding layer, ``modules_to_save``) is kept for that module's hook to serve."""
    with operations.Operation(what) as operation:
        operation.watch_loads(model)
        result = wrapped(*args, **kwargs)
        operation.adopt_materialised(model)
    return result


def _base_of_wrapper(instance: Any) -> Any:
    """The transformers model inside a PEFT wrapper, found through ``_modules`` only (no PEFT code
    runs: a model with nothing offloaded sees exactly upstream's calls). ``PeftModel.base_model`` is
    the tuner (its ``model`` the base) or, for prompt learning, the base itself."""
    tuner = instance.__dict__.get("_modules", {}).get("base_model")
    inner = getattr(tuner, "__dict__", {}).get("_modules", {}).get("model")
    return inner if inner is not None else tuner


def load_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if instance is None:  # called through the class: PeftMixedModel.load_adapter does PeftModel.load_adapter(self, ...)
        return load_adapter(lambda *a, **k: wrapped(args[0], *a, **k), args[0], args[1:], kwargs)
    adding = _ADDING.get()
    if adding is not None:  # inside from_pretrained, which re-dispatches when the model is complete
        adding.options.update(_options(kwargs))
        return wrapped(*args, **kwargs)
    base = _base_of_wrapper(instance)
    if base is None or not is_offloaded(base):
        return wrapped(*args, **kwargs)
    adding = _Adding(capture_sources(instance))
    options = _options(kwargs)
    token = _ADDING.set(adding)
    try:
        with _hidden_device_map(base, instance):
            result = _keeping_writes(instance, "PeftModel.load_adapter", wrapped, args, kwargs)
    finally:
        _ADDING.reset(token)
    offload_store.refresh_sources(adding.captured)
    redispatch(instance, adding.captured, options)
    return result


def inject_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``BaseTuner.inject_adapter`` (every tuner, every entry point that creates an adapter): each
    target's base layer is onloaded while its tuner layer is created (initialisations that read the
    base weight, DoRA's norm for one, see real values; the adapter is placed on the execution
    device), then every tuner layer over an offloaded base follows its hook. Where the creation
    provably reads no base value, the base layer is only stood in for (no read of a disk-offloaded
    weight: a third of what an adapter load over an offloaded base cost on top of upstream). What a
    creation writes into an onloaded base layer (PiSSA's and OLoRA's residual) is kept for its hook
    to serve (:mod:`metapatch._offload.store`). A model with nothing offloaded is left to upstream
    untouched: no walk, no attribute read."""
    model = args[0] if args else kwargs.get("model")
    if not _may_be_offloaded(model):
        return wrapped(*args, **kwargs)
    offload_store.mark_tied(model)  # before any tuner layer wraps a tied module
    tuner_create = instance._create_and_replace

    def create_and_replace(*c_args: Any, **c_kwargs: Any) -> Any:
        target = c_kwargs.get("target", c_args[2] if len(c_args) > 2 else None)
        if target is None:
            return tuner_create(*c_args, **c_kwargs)
        config = c_args[0] if c_args else next((v for k, v in c_kwargs.items() if k.endswith("config")), None)
        what = f"creating the {type(instance).__name__} adapter over {type(target).__name__}"
        if _reads_no_base_value(instance, config, target):
            with adapter_offload.base_layer_stood_in(target, what):
                return tuner_create(*c_args, **c_kwargs)
        with adapter_offload.base_layer_onloaded(target, what):
            return tuner_create(*c_args, **c_kwargs)

    instance.__dict__["_create_and_replace"] = create_and_replace
    try:
        result = wrapped(*args, **kwargs)
    finally:
        instance.__dict__.pop("_create_and_replace", None)
    adapter_offload.follow_base_layer_hooks(instance.model, allow_meta=_created_empty(args, kwargs))
    return result


def _may_be_offloaded(model: Any) -> bool:
    """Whether accelerate may offload part of ``model``, from the model object alone: a device map
    with an offloaded entry (as ``dispatch_model`` decides: ``disk``, or ``cpu`` beside an
    accelerator), or an accelerate hook on the model itself without a map (``cpu_offload``), or an
    entry point that found it offloaded is running."""
    if operations.current() is not None or _ADDING.get() is not None:
        return True  # inside an entry point that found the model offloaded (and hid its map)
    state = getattr(model, "__dict__", {})
    device_map = state.get("hf_device_map")
    if isinstance(device_map, dict):
        return model_placement.map_offloads(device_map)
    if hook_state.hooked(model):
        return True
    # PeftMixedModel.add_adapter/load_adapter/set_adapter pass the mixed wrapper itself, whose __dict__ holds
    # neither the base's map nor its hook (its attribute look-ups forward them): ask the base inside it.
    base = _base_of_wrapper(model) if isinstance(state.get("_modules"), dict) else None
    if base is None or base is model:
        return False
    base_map = getattr(base, "__dict__", {}).get("hf_device_map")
    if isinstance(base_map, dict):
        return model_placement.map_offloads(base_map)
    return hook_state.hooked(base)


# LoRA's initialisations that draw or zero the adapter without looking at the base weight; every
# other one (PiSSA, OLoRA, CorDA, LoftQ, orthogonal, LoRA-GA, ...) and every variant (DoRA, aLoRA,
# Arrow, ...) may read it, as may every other tuner: those get the real weights.
_VALUE_FREE_LORA_INITS = (True, False, "gaussian")
_LORA_VARIANT_FIELDS = ("use_dora", "alora_invocation_tokens", "arrow_config", "target_parameters")


def _reads_no_base_value(tuner: Any, config: Any, target: Any) -> bool:
    """Whether creating ``config``'s tuner layer on ``target`` reads nothing but the base layer's
    shape, dtype and device: a plain LoRA (not a subclass: AdaLoRA and the rest initialise
    otherwise) with a value-free initialisation and no variant, over a plain ``Linear`` or
    ``Embedding`` (a quantized base reads its quantization state)."""
    import torch
    from peft.tuners.lora import LoraConfig, LoraModel

    if type(tuner) is not LoraModel or type(config) is not LoraConfig:
        return False
    init = config.init_lora_weights
    if not any(init is value or (isinstance(value, str) and init == value) for value in _VALUE_FREE_LORA_INITS):
        return False
    if any(getattr(config, name, None) for name in _LORA_VARIANT_FIELDS):
        return False
    if any(getattr(config, name, None) for name in _variant_fields(type(config))):
        return False
    return type(adapter_offload.base_layer_of(target)) in (torch.nn.Linear, torch.nn.Embedding)


_VARIANT_FIELDS: Dict[type, tuple] = {}


def _variant_fields(config_class: type) -> tuple:
    """The dataclass fields of ``config_class`` marked as a LoRA variant, read once per class (a class's
    fields are fixed; the check runs for every target module of every adapter load)."""
    found = _VARIANT_FIELDS.get(config_class)
    if found is None:
        import dataclasses

        found = _VARIANT_FIELDS[config_class] = tuple(
            field.name for field in dataclasses.fields(config_class) if field.metadata.get("is_lora_variant"))
    return found


def _created_empty(args: tuple, kwargs: dict) -> bool:
    """PEFT's ``low_cpu_mem_usage``: the adapter is created on meta on purpose and its values are
    assigned by the load that follows. ``add_adapter``/``load_adapter`` pass it to
    ``inject_adapter(model, adapter_name, autocast_adapter_dtype, low_cpu_mem_usage, ...)``;
    ``PeftModel.__init__`` instead creates the tuner inside accelerate's ``init_empty_weights``,
    recognisable by the ``register_parameter`` it installs for the duration."""
    if kwargs.get("low_cpu_mem_usage", args[3] if len(args) > 3 else False):
        return True
    import torch

    return getattr(torch.nn.Module.register_parameter, "__name__", "") == "register_empty_parameter"


def move_adapter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``BaseTunerLayer._move_adapter_to_device_of_base_layer``: over an offloaded base layer the
    adapter goes to the hook's execution device, not onto the base weight's meta device (where its
    values would be lost, and where loading it would be a no-op)."""
    device = args[1] if len(args) > 1 else kwargs.get("device")
    adapter_name = args[0] if args else kwargs.get("adapter_name")
    if hook_state.offload_hook(holds.innermost_base_layer(instance)) is None:
        return wrapped(*args, **kwargs)  # the base layer is not offloaded: upstream, untouched
    if device is None and adapter_name is not None \
            and adapter_offload.move_adapter_to_execution_device(instance, adapter_name):
        return None
    return wrapped(*args, **kwargs)
