"""An adapter's own tensors follow its base layer's accelerate offload hook.

PEFT tuner layers (LoRA, DoRA, IA3, LoHa, LoKr, AdaLoRA, OFT, BOFT, VeRA, ...) wrap a base layer and
keep their own tensors beside it, in ``ModuleDict``/``ParameterDict``/``BufferDict`` containers that
they read directly (``self.ia3_l[adapter]``, ``self.lora_magnitude_vector[adapter]``), often without
calling those containers' ``forward``. Several also read the base layer's weight directly (DoRA's
weight norm, OFT/BOFT's rotated weight, merging) instead of calling the base layer. When the base
layer is offloaded by accelerate (an ``AlignDevicesHook`` with ``offload=True``: its weights are on
``meta`` between forwards), upstream PEFT moves the adapter onto ``meta`` too, and a re-dispatch
hooks the adapter containers, whose ``forward`` never runs.

The one mechanism here, whatever the tuner:

* while a tuner layer is created over an offloaded base layer, the base layer is onloaded
  (:func:`base_layer_onloaded`), so the tuner's initialisation reads real weights and its tensors
  are placed on the hook's execution device, never on ``meta``; a creation that provably reads
  only the base weight's shape, dtype and device has it stood in for instead
  (:func:`base_layer_stood_in`: empty tensors on the execution device, no offloaded value read);
* an adapter's tensors live on the execution device of its base layer's hook
  (:func:`move_adapter_to_execution_device`): they are small and trainable, so they are kept as the
  same ``Parameter`` objects (an optimizer holding them keeps working) rather than offloaded;
* :func:`follow_base_layer_hooks` takes any offload hook off the adapter containers (restoring
  their values from its weights map), and hangs a :class:`HoldBaseLayerHook` on the tuner layer: the
  base layer stays onloaded for the whole forward of the tuner layer, so every direct read of its
  weight sees the real value. Anything still on ``meta`` afterwards is refused with a
  :class:`~metapatch._framework.records.MetapatchError` naming the layer.

Imports of torch/accelerate/peft happen inside functions: ``import metapatch`` stays light.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, List, Optional, Tuple

from metapatch._offload import holds, hook_state, operations, store as offload_store
from metapatch._offload.module_walk import named_modules  # noqa: F401  (the shared walk; callers import it from here too)
from metapatch._framework.records import MetapatchError


def offload_hook(module: Any) -> Optional[Any]:
    """The accelerate ``AlignDevicesHook`` that offloads ``module``'s own weights, if any (also found
    inside a ``SequentialHook``): :func:`metapatch._offload.hook_state.offload_hook`, the one reader."""
    return hook_state.offload_hook(module)


@contextlib.contextmanager
def base_layer_onloaded(module: Any, what: str = "creating an adapter") -> Iterator[None]:
    """The base layer of ``module`` (a tuner layer or a plain layer) holds its real weights inside
    the block, if it is offloaded; otherwise nothing happens. What the block writes into them
    (PiSSA's and OLoRA's residual, a merge) is kept for the offload hook to serve, or refused
    (:class:`metapatch._offload.operations.Operation`)."""
    base_layer = base_layer_of(module)
    offloaded = [(sub, hook) for sub in base_layer.modules() for hook in (offload_hook(sub),) if hook is not None]
    if not offloaded:
        yield
        return
    with operations.Operation(what) as operation:
        for sub, hook in offloaded:
            operation.onload(sub, hook)
        yield


@contextlib.contextmanager
def base_layer_stood_in(module: Any, what: str = "creating an adapter") -> Iterator[None]:
    """The offloaded tensors of ``module``'s base layer are stood in for, inside the block, by
    uninitialised tensors of the same shape and dtype on the hook's execution device
    (:func:`metapatch._offload.holds.stood_in`: the offloaded values are never read, a write into a
    stand-in is refused). Only for code that reads where and what the base weight is, never its
    values (a LoRA layer created with a value-free initialisation): anything else must use
    :func:`base_layer_onloaded`. Falls back to it for tensors of a class other than ``Parameter``
    and ``Tensor`` (quantized weights carry state an empty tensor lacks)."""
    base_layer = base_layer_of(module)
    hook = offload_hook(base_layer)
    if hook is None or holds.held(hook):
        yield
        return
    tensors = [tensor for sub in base_layer.modules() for store in (sub._parameters, sub._buffers)
               for tensor in store.values() if tensor is not None and tensor.device.type == "meta"]
    if not all(offload_store.plain_tensor(tensor) for tensor in tensors):
        with base_layer_onloaded(module, what):
            yield
        return
    with holds.stood_in(base_layer, execution_device(module), what):
        yield


def base_layer_of(module: Any) -> Any:
    """PEFT's ``module.get_base_layer()`` (the innermost ``base_layer``), or ``module`` itself when it
    has none. PEFT's own method asks ``hasattr(layer, "base_layer")`` down to the plain layer, whose
    failing lookup costs an AttributeError; where a tuner layer uses that method unchanged, the chain is
    read from ``_modules``, where PEFT registers it (this runs several times per tuner layer per load)."""
    get_base_layer = getattr(type(module), "get_base_layer", None)
    if get_base_layer is None:
        return module
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    if tuners_utils is not None and get_base_layer is getattr(tuners_utils.BaseTunerLayer, "get_base_layer", None):
        return holds.innermost_base_layer(module)
    get_base_layer = getattr(module, "get_base_layer", None)
    return get_base_layer() if callable(get_base_layer) else module


def execution_device(module: Any) -> Optional[Any]:
    """Where an offloaded base layer runs, or None when it is not offloaded."""
    hook = offload_hook(base_layer_of(module))
    return hook_state.compute_device(hook) if hook is not None else None


def _is_on_meta(base_layer: Any) -> bool:
    import torch

    if isinstance(base_layer, torch.nn.MultiheadAttention):
        base_layer = base_layer.out_proj
    for name in ("weight", "qweight"):
        weight = getattr(base_layer, name, None)
        if isinstance(weight, torch.Tensor):
            return weight.device.type == "meta"
    return False


def move_adapter_to_execution_device(layer: Any, adapter_name: str) -> bool:
    """When ``layer``'s base layer is offloaded (its weight on meta, an offload hook holding the
    value), place ``adapter_name``'s tensors on the hook's execution device, in the base weight's
    floating dtype, instead of on meta. Returns False when the base layer is not offloaded (the
    caller then does what upstream does)."""
    import torch

    base_layer = base_layer_of(layer)
    device = execution_device(layer)
    if device is None or not _is_on_meta(base_layer):
        return False
    reference = base_layer.out_proj if isinstance(base_layer, torch.nn.MultiheadAttention) else base_layer
    weight = getattr(reference, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point else None
    for container in _adapter_containers(layer):
        if adapter_name not in container:
            continue
        item = container[adapter_name]
        tensors = list(item.parameters()) + list(item.buffers()) if isinstance(item, torch.nn.Module) else [item]
        if any(t.device.type == "meta" for t in tensors):
            continue  # created empty (low_cpu_mem_usage): its values are assigned when loaded
        item_dtype = getattr(item, "dtype", None)
        cast = dtype is not None and (item_dtype is None or item_dtype.is_floating_point)
        # A moved tensor is a new one, and a ParameterDict makes it a new Parameter that requires grad: keep what
        # the adapter had (a frozen adapter stays frozen; peft 0.22 does the same in its own move).
        requires_grad = getattr(item, "requires_grad", None) if isinstance(item, torch.Tensor) else None
        container[adapter_name] = item.to(device, dtype=dtype) if cast else item.to(device)
        if requires_grad is not None:
            container[adapter_name].requires_grad_(requires_grad)
    return True


def _adapter_containers(layer: Any) -> List[Any]:
    import torch

    names = tuple(getattr(layer, "adapter_layer_names", ())) + tuple(getattr(layer, "other_param_names", ()))
    found = []
    for name in names:
        container = getattr(layer, name, None)
        if isinstance(container, torch.nn.Module) and hasattr(container, "__contains__"):
            found.append(container)
    return found


def _adapter_modules(layer: Any) -> List[Any]:
    """(name, module) of everything under a tuner layer except its base layer, in ``named_modules``
    order: one walk that does not enter the base layer (this runs for every tuner layer at every
    adapter load)."""
    base_layer = base_layer_of(layer)
    if base_layer is layer:
        return []
    return named_modules(layer, exclude=(base_layer,))


def _own_tensors(module: Any) -> List[Tuple[str, Any]]:
    """``named_parameters(recurse=False)`` then ``named_buffers(recurse=False)``, read from the stores."""
    found = []
    for store in (module._parameters, module._buffers):
        seen: set = set()
        for name, tensor in store.items():
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                found.append((name, tensor))
    return found


# -- after a dispatch: adapter containers unhooked, base layer held during the tuner's forward --


class HoldBaseLayerHook:
    """Hung on a tuner layer: its base layer keeps its real weights for the whole forward of the
    tuner layer (base forward, adapter forward, and every direct read of ``base_layer.weight``)."""

    no_grad = False  # read by accelerate's add_hook_to_module (the ModelHook interface, duck-typed)

    def __init__(self, base_layer: Any) -> None:
        self.base_layer = base_layer
        self._holding = []

    def init_hook(self, module: Any) -> Any:
        return module

    def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        hook = offload_hook(self.base_layer)
        self._holding.append(hook)
        if hook is not None:
            holds.hold(self.base_layer, hook)
        return args, kwargs

    def post_forward(self, module: Any, output: Any) -> Any:
        hook = self._holding.pop() if self._holding else None
        if hook is not None:
            holds.release(self.base_layer, hook)
        return output

    def detach_hook(self, module: Any) -> Any:
        return module


def _restore_from_hook(module: Any, device: Any) -> None:
    """Take an offload hook off an adapter container, its tensors put back with their values."""
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import set_module_tensor_to_device

    hook = offload_hook(module)
    if hook is not None:
        served = hook_state.weights_map_of(hook)
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor.device.type == "meta" and name in served:
                set_module_tensor_to_device(module, name, device, value=served[name])
    if hook_state.hooked(module):
        remove_hook_from_module(module)


class KeepQuantStateHook:
    """Put in front of the offload hook of a 4-bit layer: before the weight goes back to meta after
    a forward with autograd on, the quant state autograd holds is left out of the move
    (:func:`metapatch._offload.store.keep_quant_states_for_backward`); gradients through offloaded 4-bit layers stay real."""

    no_grad = False

    def init_hook(self, module: Any) -> Any:
        return module

    def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        return args, kwargs

    def post_forward(self, module: Any, output: Any) -> Any:
        import torch

        if torch.is_grad_enabled():
            holds.keep_quant_states_for_backward(module)
        return output

    def detach_hook(self, module: Any) -> Any:
        return module


def _keep_quant_state_of(module: Any) -> None:
    """An offloaded 4-bit layer gets a :class:`KeepQuantStateHook` in front of its offload hook."""
    from accelerate.hooks import SequentialHook

    # A registered 4-bit weight first (a dictionary read, asked of every hooked module at every adapter
    # load), then the hook; never ``module.weight``, which may be a property that computes (a
    # TrainableTokensWrapper merges its delta).
    if getattr(module._parameters.get("weight"), "quant_state", None) is None or offload_hook(module) is None:
        return
    hook = hook_state.attached_hook(module)
    hooks = list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]
    if not any(isinstance(h, KeepQuantStateHook) for h in hooks):
        hook_state.attach(module, SequentialHook(KeepQuantStateHook(), *hooks))


def _hold_hook_of(layer: Any) -> Optional[HoldBaseLayerHook]:
    return next((h for h in hook_state.hooks_on(layer) if isinstance(h, HoldBaseLayerHook)), None)


def _trainable_copies_in_memory(wrappers: List[Tuple[str, Any]]) -> int:
    """``modules_to_save`` copies PEFT makes of an offloaded module (``copy.deepcopy``, hook included)
    are the adapter's own trainable weights: they get their values back from the copied hook's
    weights map, lose the hook (an optimizer must keep the same parameters) and stay in memory on the
    execution device. The original module stays offloaded. ``wrappers``: the (name,
    ``ModulesToSaveWrapper``) pairs of the model."""
    adjusted = 0
    for wrapper_name, wrapper in wrappers:
        for adapter, copy in getattr(wrapper, "modules_to_save", {}).items():
            for name, module in copy.named_modules():
                hook = offload_hook(module)
                if hook is not None:
                    _restore_from_hook(module, hook_state.compute_device(hook))
                    adjusted += 1
            missing = [n for n, t in list(copy.named_parameters()) + list(copy.named_buffers()) if t.device.type == "meta"]
            if missing:
                raise MetapatchError(
                    f"metapatch: modules_to_save copy {wrapper_name}.modules_to_save.{adapter} of an offloaded module has "
                    f"{missing[:4]} on the meta device and nothing holds their values. Keep that module in memory "
                    f"(device_map) or load the adapter onto the model before offloading it.")
    return adjusted


def follow_base_layer_hooks(model: Any, allow_meta: bool = False) -> int:
    """For every tuner layer of ``model`` over an offloaded base layer: adapter tensors real and on
    the execution device, no hook on the adapter containers, the base layer held during the tuner's
    forward. Returns how many tuner layers were adjusted; raises when an adapter tensor has no value,
    unless ``allow_meta``: PEFT's ``low_cpu_mem_usage`` creates adapters on meta on purpose, and the
    load that follows assigns their values (the load's own call, without ``allow_meta``, checks)."""
    import torch
    from accelerate.hooks import add_hook_to_module
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # pragma: no cover - every supported peft has it
        ModulesToSaveWrapper = ()
    tuner_layers, wrappers = [], []
    kinds: dict = {}  # class -> (a tuner layer, a modules_to_save wrapper): ABC checks, asked once per class
    for name, module in named_modules(model):  # one walk: this runs at every adapter load
        if hook_state.hooked(module):
            _keep_quant_state_of(module)
        kind = kinds.get(type(module))
        if kind is None:
            kind = kinds[type(module)] = (issubclass(type(module), BaseTunerLayer),
                                          bool(ModulesToSaveWrapper) and issubclass(type(module), ModulesToSaveWrapper))
        if kind[0]:
            tuner_layers.append((name, module))
        if kind[1]:
            wrappers.append((name, module))
    adjusted = _trainable_copies_in_memory(wrappers)
    for layer_name, layer in tuner_layers:
        device = execution_device(layer)
        adapter_modules = _adapter_modules(layer)
        for _, module in adapter_modules:
            if hook_state.hooked(module) and module is not layer:
                _restore_from_hook(module, device if device is not None else torch.device("cpu"))
        if device is None:
            continue
        missing = []
        with torch.no_grad():
            for name, module in adapter_modules:
                for tensor_name, tensor in _own_tensors(module):
                    if tensor.device.type == "meta":
                        if not allow_meta:
                            missing.append(f"{name}.{tensor_name}" if name else tensor_name)
                    elif tensor.device != device:
                        tensor.data = tensor.data.to(device)
        if missing:
            raise MetapatchError(
                f"metapatch: the adapter tensors {missing[:4]} of {layer_name or type(layer).__name__} (its base layer "
                f"is offloaded by accelerate) are on the meta device and nothing holds their values. Load the adapter "
                f"onto the base model before offloading it, or keep this layer in memory (device_map).")
        if _hold_hook_of(layer) is None:
            add_hook_to_module(layer, HoldBaseLayerHook(base_layer_of(layer)), append=hook_state.hooked(layer))
        adjusted += 1
    return adjusted
