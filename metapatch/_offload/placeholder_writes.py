"""Writes into an offloaded weight's ``meta`` placeholder reach the offload store, or raise.

Between forwards accelerate keeps an offloaded parameter as a placeholder on the meta device and serves
its value from the hook's ``weights_map``. torch accepts any write into a meta tensor and does nothing:
``embedding.weight.data[token] = learned`` (textual inversion), ``torch.nn.init.zeros_(model.score.weight)``
(re-initialising a head after loading), ``weight.data.copy_(...)`` or ``weight.mul_(0.5)`` under
``no_grad`` all return normally, and the next forward computes with the old value. ``.data`` writes do
not even move the parameter's ``_version``. The in-memory model would have the new values.

Here the placeholders an offload hook creates (its ``init_hook`` and every ``post_forward``) are marked:
their class becomes :func:`placeholder_class` (an ``nn.Parameter`` subclass, still ``meta``, which turns
back into a plain ``nn.Parameter`` the moment accelerate builds one around a loaded value, so a forward
runs on plain parameters), remembering the module and name they stand for; with ``offload_buffers=True`` a
buffer's placeholder is marked the same way (a ``torch.Tensor`` subclass: BatchNorm's
``reset_running_stats()``). A write into a marked placeholder, directly (in place, ``out=``, ``__setitem__``,
under ``no_grad`` or ``inference_mode``), through ``.data`` and views of it (``weight.data[3]``,
``weight.data[:, :8]``), through a ``state_dict()`` entry, or by a torch function given it (``torch.relu_(w)``,
``out=w``, ``torch._foreach_mul_(params, s)``, ``torch.nn.init.trunc_normal_(w)``), is replayed on the stored
value, copied into CPU memory once, and kept in the hook's :class:`~metapatch._offload.store.Overlay` (the user's
offload folder and checkpoint are never written):
the next forward, ``save_pretrained`` and every later write read it from there, as they read the
in-memory model's tensor. A write whose value is itself unknown (a meta source), that would change the
tensor's shape or dtype, that aims at a tied weight (each tied copy is served by its own hook) or at a
placeholder whose module no longer serves it raises
:class:`~metapatch._offload.offloaded_weights.OffloadedWriteError` naming the tensor; nothing is kept
then. Reads through ``.data`` stay meta, as upstream.

Replacing the placeholder (``module.weight = nn.Parameter(v)``) is :mod:`metapatch._offload.replaced_weights`.

Nothing here imports torch or accelerate at import time.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

from metapatch._framework.records import MetapatchError
from metapatch._offload.hook_state import offload_hook, weights_map_of
from metapatch._offload.offloaded_weights import OffloadedWriteError
from metapatch._offload.store import TIED_MARK, convert, overlay_of

SLOT = "_metapatch_placeholder_of"  # in a marked placeholder's __dict__: (weakref to module, local dotted name)
ALIAS = "_metapatch_entry_of"  # in a state_dict() entry's __dict__: the marked placeholder it aliases
PARTNERS = "_metapatch_tie_partners"  # in a module's __dict__: {name: (weakref to the tied module, its name)}

_CLASSES: Dict[str, Any] = {}

# In-place methods that are no write of values (torch's names): left to torch.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad", "record_stream",
                         "pin_memory", "_fix_weakref", "register_hook"})
# aten in-place ops that change a tensor's shape, strides or storage: replayed on a copy, so a refused
# change leaves the kept value as it was.
_RESHAPING = frozenset({"set_", "resize_", "resize_as_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
                        "transpose_", "swapdims_", "swapaxes_", "detach_"})
# Functions that return a view of the placeholder (``weight[3]``, ``weight[:, :8]``, ``weight.t()``, each part of
# ``weight.split(8)``, ``unbind``, ``chunk``): under ``no_grad`` their result carries the write rule (an in-place
# init of a row goes through one). ``detach`` is not among them: it is ``.data`` (an alias under any grad mode),
# except for ``state_dict()``, whose entries stay plain meta tensors.
_VIEWS = frozenset({"__getitem__", "select", "narrow", "view", "view_as", "reshape", "reshape_as", "flatten",
                    "unflatten", "t", "transpose", "swapaxes", "swapdims", "permute", "squeeze", "unsqueeze",
                    "expand", "expand_as", "diagonal", "movedim", "moveaxis", "as_strided", "unfold",
                    "split", "split_with_sizes", "tensor_split", "unbind", "chunk", "hsplit", "vsplit", "dsplit"})


def placeholder_class() -> Any:
    """The class of a marked placeholder (built on first use: torch is imported by then)."""
    if "placeholder" not in _CLASSES:
        import torch

        _CLASSES["parameter"], _CLASSES["tensor"] = torch.nn.Parameter, torch.Tensor
        _CLASSES["placeholder"], _CLASSES["buffer"], _CLASSES["data"] = _build_classes()
    return _CLASSES["placeholder"]


_SEEN: List[Any] = []  # [WeakIdKeyDictionary: tensor -> (weakref to module, name)], built on first use


def note_ties(module: Any, hook: Any) -> None:
    """Before ``hook`` offloads ``module`` (its ``init_hook``): a parameter object another offloaded module held when
    its hook was attached is a tied weight (a tied head and input embedding are one object until their hooks put a
    placeholder in each). Both modules are marked (``TIED_MARK``): a write into either placeholder raises, since each
    hook serves its own copy and the in-memory model would change both."""
    if not getattr(hook, "offload", False):
        return
    from torch.utils.weak import WeakIdKeyDictionary

    if not _SEEN:
        _SEEN.append(WeakIdKeyDictionary())
    seen = _SEEN[0]
    named = module.named_parameters() if getattr(hook, "place_submodules", False) else module._parameters.items()
    for name, tensor in list(named):
        if tensor is None:
            continue
        earlier = seen.get(tensor)
        other = earlier[0]() if earlier is not None else None
        if other is None:
            seen[tensor] = (weakref.ref(module), name)
        elif other is not module:
            record_tie(other, earlier[1], module, name)


def record_tie(module: Any, name: str, other: Any, other_name: str) -> None:
    """``module.<name>`` and ``other.<other_name>`` are one tied weight served by two hooks: writes into either are
    refused, and their placeholders are one object between forwards (:func:`mark`)."""
    for (owner, local), (partner, partner_name) in (((module, name), (other, other_name)),
                                                   ((other, other_name), (module, name))):
        owner.__dict__[TIED_MARK] = frozenset(owner.__dict__.get(TIED_MARK, ())) | {local}
        owner.__dict__.setdefault(PARTNERS, _Partners())[local] = (weakref.ref(partner), partner_name)


class _Partners(dict):
    """A module's tie partners (:data:`PARTNERS`). A deep copy of the model maps them to the partners' copies (copied
    before this module), and leaves out the others: a copy must never share a placeholder with the original."""

    def __deepcopy__(self, memo: Any) -> "_Partners":
        copied = _Partners()
        for name, (ref, partner_name) in self.items():
            partner = ref()
            partner_copy = memo.get(id(partner)) if partner is not None else None
            if partner_copy is not None:
                copied[name] = (weakref.ref(partner_copy), partner_name)
        return copied


def mark(module: Any, hook: Any) -> None:
    """Mark the meta placeholders ``hook`` just put on ``module`` (after ``init_hook``/``post_forward``)."""
    if weights_map_of(hook) is None:
        return
    cls = _CLASSES.get("placeholder") or placeholder_class()
    parameter = _CLASSES["parameter"]
    if hook.place_submodules:
        items = [(name, p) for name, p in module.named_parameters()]
    else:
        items = list(module._parameters.items())
    for name, param in items:
        if param is not None and type(param) is parameter and param.is_meta:
            param.__class__ = cls
            param.__dict__[SLOT] = (weakref.ref(module), name)
    if hook.offload_buffers:  # BatchNorm's statistics: reset_running_stats() between forwards writes into them
        buffer_cls, plain = _CLASSES["buffer"], _CLASSES["tensor"]
        buffers = module.named_buffers() if hook.place_submodules else module._buffers.items()
        for name, buffer in list(buffers):
            if buffer is not None and type(buffer) is plain and buffer.is_meta:
                buffer.__class__ = buffer_cls
                buffer.__dict__[SLOT] = (weakref.ref(module), name)
    partners = module.__dict__.get(PARTNERS)
    if partners:
        _share_tied_placeholders(module, partners, cls)


def _share_tied_placeholders(module: Any, partners: Dict[str, Any], cls: Any) -> None:
    """Tied weights are one object until their hooks split them (each ``post_forward`` puts a new placeholder in its
    own module). While both are placeholders they are one object again, as after dispatch: transformers'
    ``save_pretrained`` finds ties among offloaded tensors by that identity (split, it saves the tied head under both
    names, and after a resize, whose kept tensors the tied hooks share, safetensors refuses the shared storage)."""
    for name, (ref, other_name) in partners.items():
        other = ref()
        mine = module._parameters.get(name)
        theirs = other._parameters.get(other_name) if other is not None else None
        if type(mine) is cls and type(theirs) is cls and mine is not theirs and mine.shape == theirs.shape \
                and mine.dtype == theirs.dtype:
            module._parameters[name] = theirs


# -- the write ------------------------------------------------------------------------------------


def write_error(message: str) -> Exception:
    return OffloadedWriteError(message)


def describe(module: Any, name: str) -> str:
    return f"{type(module).__name__}.{name}"


def _owner(placeholder: Any, tied_ok: bool = False) -> Tuple[Any, str, Any]:
    """(module, name as its weights map names it, hook) a marked placeholder stands for; raises when its
    module no longer holds it (a copy of the model, the module loaded back) or serves it from no store."""
    ref, name = placeholder.__dict__.get(SLOT, (None, ""))
    module = ref() if ref is not None else None
    holder = module
    *path, local = name.split(".") if name else [""]
    for part in path:
        holder = getattr(holder, "_modules", {}).get(part)
    if holder is None or (holder._parameters.get(local) is not placeholder
                          and holder._buffers.get(local) is not placeholder):
        raise write_error(f"metapatch: a write into an offloaded weight's meta placeholder ({tuple(placeholder.shape)}) "
                     f"whose module no longer serves it: the value would go nowhere. Write into the parameter the "
                     f"model holds now (getattr(module, name)).")
    hook = offload_hook(module)
    if hook is None:
        raise write_error(f"metapatch: a write into {describe(module, name)}, a meta placeholder no accelerate offload "
                     f"hook serves any more: the value would go nowhere.")
    tied = set(getattr(hook, "tied_params_names", None) or ())
    if not tied_ok and (name in tied or name in module.__dict__.get(TIED_MARK, ())):
        raise write_error(f"metapatch: a write into {describe(module, name)}, an offloaded weight tied to another "
                     f"module's: accelerate serves each tied copy from its own hook, so keeping the write here "
                     f"would leave the other with the old value. Write before dispatching the model, or keep the "
                     f"tied modules in memory (device_map).")
    return module, name, hook


class _Materialised:
    """The stored values of the placeholders one write touches, in CPU memory, and where to keep them."""

    def __init__(self) -> None:
        self.values: Dict[int, Tuple[Any, Any, str, Any, bool]] = {}

    def of(self, placeholder: Any, copy: bool) -> Any:
        entry = self.values.get(id(placeholder))
        if entry is None:
            module, name, hook = _owner(placeholder)
            overlay = overlay_of(hook)
            kept = overlay.kept.get(name)
            if not copy and kept is not None and kept.device.type == "cpu" and kept.dtype == placeholder.dtype \
                    and kept.shape == placeholder.shape:
                value, own = kept, True  # written in place: a training loop writes one row per step
            else:
                value = overlay[name].detach().to(device="cpu", dtype=placeholder.dtype, copy=True)
                own = False
            entry = (placeholder, value, name, hook, own)
            self.values[id(placeholder)] = entry
        return entry[1]

    def keep(self) -> None:
        for placeholder, value, name, hook, _ in self.values.values():
            if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
                raise write_error(f"metapatch: a write that changes the shape or dtype of an offloaded weight's "
                             f"placeholder ({name}: {tuple(placeholder.shape)} {placeholder.dtype} -> "
                             f"{tuple(value.shape)} {value.dtype}); the offload hook serves the placeholder's shape. "
                             f"Replace the module (or keep it in memory with the device_map) instead.")
        for placeholder, value, name, hook, _ in self.values.values():
            overlay_of(hook).kept[name] = value


def _converted(placeholder: Any) -> None:
    """A dtype conversion reached a marked placeholder (``module.half()``, ``.to(torch.bfloat16)`` of the model or of
    any submodule: torch's ``Module._apply`` sets ``.data``): the store serves the stored value converted as the
    in-memory tensor was, step by step (a chain keeps its lossy step), not cast straight to the last dtype."""
    try:
        module, name, hook = _owner(placeholder, tied_ok=True)
    except MetapatchError:
        return  # a placeholder nothing serves any more: nothing to convert
    convert(hook, name, placeholder.dtype)
    # A tied weight is one object in memory (and one placeholder here, :func:`mark`): its partner's hook serves the
    # same converted value.
    ref, partner_name = module.__dict__.get(PARTNERS, {}).get(name, (None, ""))
    partner = ref() if ref is not None else None
    partner_hook = offload_hook(partner) if partner is not None else None
    if partner_hook is not None and partner._parameters.get(partner_name) is placeholder:
        convert(partner_hook, partner_name, placeholder.dtype)


def _assign(placeholder: Any, value: Any) -> None:
    """``weight.data = value`` on a marked placeholder: in memory the parameter takes ``value``'s storage (it
    aliases it); here ``value`` (a CPU tensor as it is, so later writes into it show as in memory; another device's
    copied to CPU) is kept for the hook to serve. Another shape or dtype would change the parameter: refused."""
    module, name, hook = _owner(placeholder)
    if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
        raise write_error(f"metapatch: {describe(module, name)}.data = a tensor of another shape or dtype "
                     f"({tuple(value.shape)} {value.dtype}, the offloaded weight is {tuple(placeholder.shape)} "
                     f"{placeholder.dtype}); the offload hook serves the placeholder's shape. Replace the module (or "
                     f"keep it in memory with the device_map) instead.")
    import torch

    if value.is_inference():  # accelerate could not make a parameter of it at the next forward: a normal copy
        with torch.inference_mode(False):
            value = value.to("cpu", copy=True)
    overlay_of(hook).kept[name] = value.detach() if value.device.type == "cpu" else value.detach().to("cpu")


def _write(func: Any, args: tuple, kwargs: dict) -> Any:
    """Replay one aten write whose written argument is a :func:`placeholder_class` view on the stored
    values, and keep them."""
    import torch
    from torch.utils._pytree import tree_map

    data_cls = _CLASSES["data"]
    reshaping = func._schema.name.split("::")[-1] in _RESHAPING
    store = _Materialised()

    def real(value: Any) -> Any:
        if isinstance(value, data_cls):
            view = store.of(value._root, copy=reshaping)
            for step, rest, kw in value._chain:
                view = step(view, *rest, **kw)
            return view
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                raise write_error("metapatch: a write into an offloaded weight's placeholder from a tensor on the meta "
                             "device (itself a placeholder, or computed from one): its values are unknown here. "
                             "Read the value inside a forward, or from the in-memory model.")
            return value.to("cpu") if value.device.type != "cpu" and value.dim() > 0 else value
        return value

    # Outside inference mode: a value copied under it would be an inference tensor, which accelerate cannot make
    # a parameter of at the next forward (the in-memory model's tensor stays a normal one too).
    with torch.inference_mode(False), torch.no_grad():
        real_args, real_kwargs = tree_map(real, args), tree_map(real, kwargs)
        func(*real_args, **real_kwargs)
    store.keep()


_NOT_ROUTED = object()  # a torch function the marked placeholder leaves to torch


def _replay_call(function: Any, frame: Any, placeholder: Any) -> None:
    """Call ``function`` with the arguments ``frame`` (its own call, stopped at its first line's meta check) was
    given, ``placeholder`` replaced by its stored value in CPU memory, and keep the value."""
    import torch

    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    store = _Materialised()
    # Outside inference mode, as in _write: a value copied under it could not be written by the next call outside.
    with torch.inference_mode(False), torch.no_grad():
        arguments = {}
        for name in names:
            value = frame.f_locals[name]
            arguments[name] = store.of(value, copy=False) if value is placeholder else value
        positional = [arguments.pop(name) for name in code.co_varnames[:code.co_argcount]]
        function(*positional, **arguments)
    store.keep()


def _part(func: Any, index: int, view: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``index``-th view ``func`` (``split``, ``unbind``, ``chunk``...) makes of ``view``: one step of a chain."""
    return func(view, *args, **kwargs)[index]


def _writes_into(func: Any, args: tuple, kwargs: dict) -> bool:
    data_cls = _CLASSES["data"]
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, data_cls) or (isinstance(value, (list, tuple))
                                           and any(isinstance(v, data_cls) for v in value)):
            return True
    return False


def _build_classes() -> Tuple[Any, Any, Any]:
    import torch
    from torch.utils._pytree import tree_map

    disabled = torch._C._disabled_torch_function_impl
    data_getter = torch._C.TensorBase.data.__get__
    data_setter = torch._C.TensorBase.data.__set__
    tensor_detach = torch.Tensor.detach
    parameter_new_code = getattr(torch.nn.Parameter.__new__, "__code__", None)
    save_to_state_dict_code = torch.nn.Module._save_to_state_dict.__code__

    class PlaceholderData(torch.Tensor):
        """``placeholder.data`` (and views of it): the meta tensor upstream gives, whose writes are replayed on the
        stored value."""

        @staticmethod
        def __new__(cls, inner: Any, root: Any, chain: Tuple[Any, ...], itself: bool = False) -> Any:
            made = torch.Tensor._make_wrapper_subclass(
                cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
                device=inner.device, requires_grad=False)
            # itself: stands for the parameter object (a direct call on it), not for an alias (.data, a view)
            made._inner, made._root, made._chain, made._itself = inner, root, chain, itself
            return made

        def __repr__(self) -> str:
            return repr(self._inner)

        def __reduce_ex__(self, protocol: Any) -> Any:
            return self._inner.__reduce_ex__(protocol)

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            kwargs = kwargs or {}
            if _writes_into(func, args, kwargs):
                if func._schema.name.split("::")[-1] in _RESHAPING and not (args and getattr(args[0], "_itself", 0)):
                    # set_/resize_/squeeze_ on an alias (``weight.data.set_(t)``) re-points that alias only: the
                    # parameter keeps its value in memory too
                    return args[0]
                _write(func, args, kwargs)
                return _first_data(list(args) + list(kwargs.values()))
            unwrapped_args = tree_map(lambda v: v._inner if isinstance(v, PlaceholderData) else v, args)
            unwrapped_kwargs = tree_map(lambda v: v._inner if isinstance(v, PlaceholderData) else v, kwargs)
            out = func(*unwrapped_args, **unwrapped_kwargs)
            returns = func._schema.returns
            if not (args and isinstance(args[0], PlaceholderData) and returns and returns[0].alias_info is not None):
                return out
            # a view: writes into it are writes into the root
            rest, root, chain = unwrapped_args[1:], args[0]._root, args[0]._chain
            if isinstance(out, torch.Tensor):
                return PlaceholderData(out, root, chain + ((func, rest, unwrapped_kwargs),))
            if isinstance(out, (list, tuple)):  # views of parts (split, unbind, chunk): each replays as its part
                return type(out)(PlaceholderData(part, root, chain + ((functools.partial(_part, func, index), rest,
                                                                       unwrapped_kwargs),))
                                 for index, part in enumerate(out))
            return out

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            return disabled(func, types, _scalar_as_tensor(func, args), kwargs or {})

    def _first_data(values: List[Any]) -> Any:
        """What an in-place aten write returns: the written tensor (``None`` for a ``_foreach_`` list)."""
        for value in values:
            if isinstance(value, PlaceholderData):
                return value
        return None

    def _scalar_as_tensor(func: Any, args: tuple) -> tuple:
        """``weight[3] = 1.0``: torch would wrap the number in a tensor on the target's device (meta), which looks
        like a source of unknown value; a CPU tensor of the target's dtype holds the same number."""
        if getattr(func, "__name__", "") == "__setitem__" and len(args) == 3 and isinstance(args[2], (int, float,
                                                                                                       bool)):
            return (args[0], args[1], torch.tensor(args[2], dtype=args[0].dtype))
        return args

    is_meta_attribute = torch._C.TensorBase.__dict__["is_meta"]  # torch hands __torch_function__ its __get__

    def _writable(value: Any) -> bool:
        """A marked placeholder (or a ``state_dict()`` entry of one) torch lets a call write (no autograd recording
        it): the call writes its data."""
        return isinstance(value, _Marked) and (SLOT in value.__dict__ or ALIAS in value.__dict__) \
            and value.is_meta and not (value.requires_grad and torch.is_grad_enabled())

    def _data_of(value: Any) -> Any:
        """The :class:`PlaceholderData` a call on ``value`` writes through: the placeholder itself, or what its
        ``state_dict()`` entry aliases (set_ on an entry re-points the entry only, as in memory)."""
        root = value.__dict__.get(ALIAS)
        return PlaceholderData(data_getter(value), root if root is not None else value, (), itself=root is None)

    def _as_data(value: Any) -> Any:
        return _data_of(value) if _writable(value) else value

    def _route_write(func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` with the placeholder it writes (its first argument, each placeholder of a ``_foreach_`` list,
        ``out=``) as its :class:`PlaceholderData`: the write is replayed on the stored value. Sources stay
        placeholders (a write from one is refused: its values are unknown here)."""
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            return _route_foreach(func, args, kwargs)
        if "out" in kwargs:
            out = kwargs["out"]
            routed_out = type(out)(_as_data(v) for v in out) if isinstance(out, (list, tuple)) else _as_data(out)
            if routed_out is out or (isinstance(out, (list, tuple)) and all(a is b for a, b in zip(routed_out, out))):
                return _NOT_ROUTED
            result = func(*args, **{**kwargs, "out": routed_out})
            return out if isinstance(result, PlaceholderData) or isinstance(out, (list, tuple)) else result
        if not args or not _writable(args[0]) or not _is_write_method(name):
            return _NOT_ROUTED
        data = _as_data(args[0])
        result = func(data, *args[1:], **kwargs)
        return args[0] if result is data else result

    def _route_foreach(func: Any, args: tuple, kwargs: dict) -> Any:
        """A ``_foreach_`` write over a list holding marked placeholders: each placeholder's entry is its own call
        (the lists are aligned by index, so the entries are independent), the rest one call, as torch's."""
        written = args[0]
        marked = [i for i, value in enumerate(written) if _writable(value)]
        if not marked or not _is_write_method(getattr(func, "__name__", "")):
            return _NOT_ROUTED
        aligned = [isinstance(a, (list, tuple)) and len(a) == len(written) for a in args]

        def entries(indices: List[int], routed: bool) -> tuple:
            picked = []
            for position, argument in enumerate(args):
                if not aligned[position]:
                    picked.append(argument)
                    continue
                part = [argument[i] for i in indices]
                picked.append([_as_data(v) for v in part] if routed and position == 0 else part)
            return tuple(picked)

        rest = [i for i in range(len(written)) if i not in set(marked)]
        if rest:
            disabled(func, (), entries(rest, False), kwargs)
        for index in marked:
            func(*entries([index], True), **kwargs)
        return None  # torch's in-place _foreach_ functions return None

    def _is_meta_asked(tensor: Any, caller: Any) -> bool:
        """``tensor.is_meta``. Since torch 2.13, ``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``,
        ``dirac_`` and ``sparse_`` return at once on a meta tensor, before any write: asked by one of them about a
        writable marked placeholder, the function runs here on the stored value (its own arguments, the
        placeholder's value in its place), the result is kept, and the answer (meta) lets the call on the
        placeholder return unchanged, as it did."""
        if caller.f_globals.get("__name__") == "torch.nn.init" and caller.f_code.co_name.endswith("_") \
                and _writable(tensor):  # an in-place init (torch's naming), not a reader such as a fan count
            function = caller.f_globals.get(caller.f_code.co_name)
            if getattr(function, "__code__", None) is caller.f_code:
                _replay_call(function, caller, tensor)
        return True

    class _Marked:
        """What a marked placeholder (a parameter's or a buffer's) overrides: writes into it reach the offload
        store."""

        _metapatch_placeholder = True

        def _plain(self, tensor: Any) -> Any:  # a plain tensor of this placeholder's kind holding ``tensor``
            raise NotImplementedError

        def __deepcopy__(self, memo: Any) -> Any:
            copied = self._plain(torch.empty_like(tensor_detach(self)))
            memo[id(self)] = copied
            # A deep copy of the model (a reference model for DPO/PPO): the copy of the module this placeholder
            # stands for is in memo already (copy makes the module before its tensors), and its copied hook serves
            # the copy. Marked for it, a write into the copy reaches the copy's store, as in memory.
            ref, name = self.__dict__.get(SLOT, (None, ""))
            module = ref() if ref is not None else None
            module_copy = memo.get(id(module)) if module is not None else None
            if module_copy is not None:
                copied.__class__ = type(self)
                copied.__dict__[SLOT] = (weakref.ref(module_copy), name)
            return copied

        def __reduce_ex__(self, protocol: Any) -> Any:
            plain = self._plain(tensor_detach(self))
            return type(plain).__reduce_ex__(plain, protocol)

        def detach(self) -> Any:
            """``weight.detach()`` aliases the weight, as ``weight.data`` does: on a marked placeholder it is the same
            :class:`PlaceholderData`, so a write into it (``weight.detach().copy_(v)``) reaches the store, as in memory
            it reaches the weight. ``state_dict()``'s entries stay torch's plain meta tensors."""
            if SLOT not in self.__dict__:
                return tensor_detach(self)
            caller = sys._getframe(1).f_code
            if caller is parameter_new_code:
                # ``nn.Parameter(placeholder)`` (a parametrization's original: ``weight_norm``) would hold the meta
                # placeholder, not the offloaded values, and torch refuses it anyway, in a line about detach()
                # semantics (a subclass whose detach returns a plain tensor): refused here, in words.
                ref, name = self.__dict__[SLOT]
                module = ref()
                raise write_error(
                    f"metapatch: a new nn.Parameter made from "
                    f"{describe(module, name) if module is not None else 'an offloaded weight'}, an offloaded "
                    f"weight's meta placeholder (a parametrization such as weight_norm makes one of its original), "
                    f"would hold no values: accelerate serves the weight from its offload store. Register the "
                    f"parametrization before dispatching the model, or keep that module in memory (device_map).")
            data = data_getter(self)
            if not data.is_meta:
                return tensor_detach(self)
            if caller is save_to_state_dict_code:
                # A state_dict() entry aliases the weight in memory (``model.state_dict()[k].copy_(v)``, an EMA's
                # update): a plain meta tensor, as torch's, which every reader of a state dict takes as one (storage,
                # pickling, safetensors), but whose writes reach the store, as the placeholder's do.
                entry = tensor_detach(self)
                entry.__class__ = _CLASSES["entry"]
                entry.__dict__[ALIAS] = self
                return entry
            return PlaceholderData(data, self, ())

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            """torch's in-place *functions* given a marked placeholder (``torch.relu_(w)``, ``torch.fill_(w, v)``,
            ``torch.add(a, b, out=w)``, ``torch._foreach_mul_(params, s)``, ``torch.nn.init.eye_``) write it as its
            methods do: they run on its :class:`PlaceholderData`. Every other call is torch's, on plain tensors, as
            ``nn.Parameter``'s disabled override gives (a Python call per attribute read: about 1 us, measured)."""
            kwargs = kwargs or {}
            if getattr(func, "__self__", None) is is_meta_attribute:
                return _is_meta_asked(args[0], sys._getframe(1))
            if "out" in kwargs or _is_write_method(getattr(func, "__name__", "")):
                routed = _route_write(func, args, kwargs)
                if routed is not _NOT_ROUTED:
                    return routed
            return disabled(func, types, args, kwargs)

        @property
        def data(self) -> Any:
            data = data_getter(self)
            if not data.is_meta:
                return data
            root = self if SLOT in self.__dict__ else self.__dict__.get(ALIAS)
            return PlaceholderData(data, root, ()) if root is not None else data

        @data.setter
        def data(self, value: Any) -> None:
            if not value.is_meta and data_getter(self).is_meta and SLOT in self.__dict__:
                _assign(self, value)  # ``weight.data = t``: torch refuses a meta tensor a CPU value
                return
            before = self.dtype
            data_setter(self, value)
            if value.is_meta and value.dtype != before and SLOT in self.__dict__:
                _converted(self)  # Module._apply (.half(), .to(dtype) of any submodule) sets .data

    class OffloadedPlaceholder(_Marked, torch.nn.Parameter):
        """A parameter's meta placeholder an accelerate offload hook serves."""

        def __new__(cls, data: Any = None, requires_grad: bool = True) -> Any:
            if data is None or not data.is_meta:  # accelerate loading a value for a forward: a plain parameter
                return torch.nn.Parameter(data, requires_grad)
            return super().__new__(cls, data, requires_grad)

        def _plain(self, tensor: Any) -> Any:
            return torch.nn.Parameter(tensor, self.requires_grad)

    class OffloadedEntry(_Marked, torch.Tensor):
        """A ``state_dict()`` entry of a marked placeholder (a meta tensor): writes into it are writes into the
        placeholder, as a state dict's entries alias the model's tensors in memory."""

        def _plain(self, tensor: Any) -> Any:
            return tensor

    _CLASSES["entry"] = OffloadedEntry

    class OffloadedBuffer(_Marked, torch.Tensor):
        """A buffer's meta placeholder an offload hook serves (``offload_buffers=True``): BatchNorm's running
        statistics, reset between forwards by ``reset_running_stats()``."""

        def _plain(self, tensor: Any) -> Any:
            return tensor

    def _redirected(name: str) -> Any:
        """``OffloadedPlaceholder.<name>``: on a marked placeholder where torch allows the write (no autograd
        recording it), the call runs on its :class:`PlaceholderData` (writes replayed into the store, views
        carrying the rule); otherwise torch's own method."""
        original = getattr(torch.Tensor, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _writable(self):
                data = _data_of(self)
                if name == "__setitem__":
                    args = _scalar_as_tensor(original, (data, *args))[1:]
                result = getattr(data, name)(*args, **kwargs)
                return self if result is data else result
            return original(self, *args, **kwargs)

        method.__name__ = method.__qualname__ = name
        return method

    names = {name for name in dir(torch.Tensor) if _is_write_method(name) or name in _VIEWS}
    for name in sorted(names):
        if callable(getattr(torch.Tensor, name, None)):
            setattr(_Marked, name, _redirected(name))

    return OffloadedPlaceholder, OffloadedBuffer, PlaceholderData


def _is_write_method(name: str) -> bool:
    """Whether ``torch.Tensor.<name>`` writes its tensor's values (``__setitem__``, ``__iadd__``..., ``mul_``...)."""
    if name == "__setitem__":
        return True
    if name.startswith("__i") and name.endswith("__"):  # __iadd__, __imul__, ...
        return name not in ("__init__", "__index__", "__invert__", "__iter__")
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES

