"""Give non-persistent buffers that a load left on meta or uninitialised the value their module's
own constructor computes.

A non-persistent buffer is never in a checkpoint: its value exists only as the constructor computes
it. When a model is built with its buffers on meta (transformers 5 ``from_pretrained``, accelerate
``init_empty_weights(include_buffers=True)``) that computation ran on meta, and the loaders fill the
buffer with ``empty_like`` / ``zeros_like`` / ``to_empty`` memory unless ``_init_weights`` recomputes it.
The only faithful source of the value is the constructor again, run on a real device with the
parameters kept on meta (so it costs no weight memory): once for the owning module where its
constructor arguments were captured, else once for the whole model from its ``config``.

Detection is by identity and ``Tensor._version``, never by value: the patch records each buffer
tensor the loader materialised (and its version) and refills those whose module still holds that very
tensor, unwritten (same version), after the step that should have written it. Imported only by
patches, once torch is in.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from metapatch._framework.records import MetapatchError

# (qualified name, owning module, local name, tensor, its _version when materialised)
Pending = Tuple[str, Any, str, Any, int]

# module -> (args, kwargs) of its constructor call, for modules built while a capture is active.
CONSTRUCTED: "weakref.WeakKeyDictionary[Any, Tuple[tuple, dict]]" = weakref.WeakKeyDictionary()
_capture_depth = [0]


def non_persistent(model: Any) -> Iterator[Tuple[str, Any, str, Any]]:
    """(qualified name, owner, local name, tensor) of every non-persistent buffer, each tensor once."""
    seen = set()
    for module_name, module in model.named_modules():
        names = module._non_persistent_buffers_set
        if not names:
            continue
        for name in names:
            tensor = module._buffers.get(name)
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                yield (f"{module_name}.{name}" if module_name else name), module, name, tensor


def record(model: Any, only_meta: bool = False) -> List[Pending]:
    return [(q, owner, name, t, t._version) for q, owner, name, t in non_persistent(model)
            if not only_meta or t.is_meta]


def unset(pending: List[Pending]) -> List[Pending]:
    """The recorded buffers still in place and never written since (or still on meta)."""
    return [p for p in pending if p[1]._buffers.get(p[2]) is p[3] and (p[3].is_meta or p[3]._version == p[4])]


def real_values(model: Any) -> List[Tuple[Any, str, Any]]:
    """(owner, local name, tensor) of every non-persistent buffer that holds a real value (not on meta):
    what :func:`restore` gives back after an operation that empties tensors (``to_empty``)."""
    # every holder (not each tensor once, as non_persistent): an operation gives each module its own new tensor
    return [(module, name, module._buffers[name]) for module in model.modules()
            for name in module._non_persistent_buffers_set
            if module._buffers.get(name) is not None and not module._buffers[name].is_meta]


def restore(held: List[Tuple[Any, str, Any]]) -> None:
    """Copy each held value into the tensor its module holds now, where an operation replaced it."""
    import torch

    with torch.no_grad():
        for owner, name, value in held:
            now = owner._buffers.get(name)
            if now is not None and now is not value and not now.is_meta and now.shape == value.shape:
                now.copy_(value)


@contextlib.contextmanager
def capture_constructors() -> Iterator[None]:
    """Record each module's constructor arguments while active. ``nn.Module.__init__`` (which every
    module calls through ``super().__init__()``) reads them from the frame of the module's own
    ``__init__``, the outermost frame of the chain working on that object. (``nn.Module.__new__`` would
    see them directly, but CPython cannot take a ``__new__`` off a class again once set.)"""
    import torch

    module_cls = torch.nn.Module
    _capture_depth[0] += 1
    if _capture_depth[0] == 1:
        original = module_cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            _capture(self)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        module_cls.__init__ = __init__
    try:
        yield
    finally:
        _capture_depth[0] -= 1
        if _capture_depth[0] == 0:
            module_cls.__init__ = module_cls.__init__.__wrapped__


def _capture(module: Any) -> None:
    import inspect
    import sys

    code = getattr(getattr(type(module).__init__, "__func__", type(module).__init__), "__code__", None)
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return  # a wrapped or C-level __init__: not captured, refill falls back to the config
    names = frame.f_code.co_varnames
    count, kwonly = frame.f_code.co_argcount, frame.f_code.co_kwonlyargcount
    local = frame.f_locals
    positional = [local[name] for name in names[:count]]
    kwargs = {name: local[name] for name in names[count:count + kwonly]}
    extra = count + kwonly
    if frame.f_code.co_flags & inspect.CO_VARARGS:
        positional.extend(local[names[extra]])  # a decorated __init__(*args, **kwargs) gets self here
        extra += 1
    if frame.f_code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local[names[extra]])
    if not positional or positional[0] is not module:
        return
    args = positional[1:]
    try:
        CONSTRUCTED[module] = (tuple(args), kwargs)
    except TypeError:  # not weak-referenceable: simply not captured
        pass


@contextlib.contextmanager
def _parameters_on_meta(dtype: Any) -> Iterator[None]:
    import torch

    module_cls = torch.nn.Module
    original = module_cls.register_parameter

    def register_parameter(module: Any, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    previous = torch.get_default_dtype()
    module_cls.register_parameter = register_parameter
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        # the rebuild must not move the user's random stream (constructors draw from it)
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        module_cls.register_parameter = original
        torch.set_default_dtype(previous)


def _default_dtype(model: Any) -> Any:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype if param.dtype.itemsize >= 2 else None
    return None


def _buffers_by_constructor(owner: Any, dtype: Any) -> Optional[Dict[str, Any]]:
    call = CONSTRUCTED.get(owner)
    if call is None:
        return None
    with _parameters_on_meta(dtype):
        built = type(owner)(*call[0], **call[1])
    return dict(built._buffers)


def _buffers_by_config(model: Any, dtype: Any) -> Optional[Dict[str, Any]]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "post_init"):
        return None
    import copy

    with _parameters_on_meta(dtype):
        built = type(model)(copy.deepcopy(config))
    return {q: t for q, _, _, t in non_persistent(built)}


def _mapped_device(device_map: Optional[Mapping[str, Any]], qualname: str) -> Any:
    """Where ``device_map`` (a loader's map) puts the tensor ``qualname``, as the in-memory model would hold it: its
    device (accelerate names GPU ``i`` by the int ``i``); the CPU for "cpu"/"disk" entries and without a map."""
    from metapatch._offload.device_names import norm_device
    from metapatch._offload.tied_placement import entry_of

    key = entry_of(device_map, qualname) if isinstance(device_map, Mapping) else None
    device = norm_device(device_map[key]) if key is not None else "cpu"
    return "cpu" if device in ("cpu", "disk", "meta") else device


def refill(model: Any, pending: List[Pending], how: str, device_map: Optional[Mapping[str, Any]] = None) -> int:
    """Give each unset buffer in ``pending`` its constructor's value; ``MetapatchError`` naming the
    buffers that cannot be recomputed. ``how`` says what left them unset (for the message). A buffer still on meta
    gets a new tensor where ``device_map`` puts it (the loader's map: ``{"": 0}`` is GPU 0, as the in-memory model
    holds it); one the loader materialised is written in place, where it is."""
    import torch

    left = unset(pending)
    if not left:
        return 0
    dtype = _default_dtype(model)
    skeleton: List[Optional[Dict[str, Any]]] = []
    by_owner: Dict[int, Optional[Dict[str, Any]]] = {}
    failed: List[str] = []
    for qualname, owner, name, tensor, _ in left:
        reason = ""
        value = None
        try:
            if id(owner) not in by_owner:
                by_owner[id(owner)] = _buffers_by_constructor(owner, dtype)
            values = by_owner[id(owner)]
            if values is not None:
                value = values.get(name)
            else:
                if not skeleton:
                    skeleton.append(_buffers_by_config(model, dtype))
                value = skeleton[0].get(qualname) if skeleton[0] is not None else None
                if skeleton[0] is None:
                    reason = "its constructor arguments were not recorded and the model has no config to rebuild it"
        except Exception as exc:  # the constructor itself failed off meta: say so, never leave garbage
            reason = f"rebuilding it raised {type(exc).__name__}: {exc}"
        if value is None or value.is_meta or tuple(value.shape) != tuple(tensor.shape):
            failed.append(f"{qualname} ({type(owner).__name__}){': ' + reason if reason else ''}")
            continue
        value = value.to(dtype=tensor.dtype)
        if tensor.is_meta:
            owner._buffers[name] = value.to(_mapped_device(device_map, qualname))
        else:
            with torch.no_grad():
                tensor.copy_(value)
    if failed:
        raise MetapatchError(
            f"metapatch: {how} left {len(failed)} non-persistent buffer(s) without a value and their module's "
            f"constructor could not recompute them: {'; '.join(failed[:5])}{' and more' if len(failed) > 5 else ''}. "
            "A non-persistent buffer is never in a checkpoint; set it after loading (or recompute it in the "
            "model's _init_weights), or build the model with init_empty_weights(include_buffers=False).")
    return len(left)

