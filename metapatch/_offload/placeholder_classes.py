"""The torch classes of marked placeholders: where a write into an offloaded weight's meta placeholder is caught.

``OffloadedPlaceholder`` (a parameter's, an ``nn.Parameter`` subclass that turns back into a plain one when
accelerate builds a parameter around a loaded value), ``OffloadedBuffer`` (a buffer's, ``offload_buffers=True``)
and ``OffloadedEntry`` (a ``state_dict()`` entry of either, which aliases it as in memory) override ``.data``,
``detach()``, torch's writing and viewing methods, and ``__torch_function__`` for torch's in-place functions
(``torch.relu_(w)``, ``out=w``, ``torch._foreach_*``) and for the ``torch.nn.init`` functions that return at once on
a meta tensor. Each runs the call on a ``PlaceholderData`` (``_make_wrapper_subclass``, meta), whose
``__torch_dispatch__`` hands every aten write to :func:`metapatch._offload.write_replay.replay_write`.

A bitsandbytes ``Params4bit`` placeholder gets a ``Params4bit`` subclass of the same name
(:func:`quantized_placeholder_class`). Each marked class has a quiet sibling
(:mod:`metapatch._offload.placeholder_quiet`): what a placeholder is while its hook loads it.

The classes are built on first use (:func:`placeholder_class`), when torch is imported already; nothing here
imports torch or accelerate at import time.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Dict, List, Optional, Tuple

from metapatch._framework.calls import keyword_names
from metapatch._offload.placeholder_quiet import quiet_sibling
from metapatch._offload.write_replay import (ALIAS, RESHAPING, SLOT, assign, converted, describe, part, replay_call,
                                             replay_write, scratch_like, write_error, writes_into)

CLASSES: Dict[str, Any] = {}  # torch's and the marked classes, by role, once built

# In-place methods that are no write of values (torch's names): left to torch.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad", "record_stream",
                         "pin_memory", "_fix_weakref", "register_hook"})
# Python's augmented assignments (``weight += d``): the dunder methods that write their tensor.
_AUGMENTED_ASSIGNMENTS = frozenset(f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "div",
                                                             "mod", "pow", "lshift", "rshift", "and", "xor", "or"))
# Functions that return a view of the placeholder (``weight[3]``, ``weight[:, :8]``, ``weight.t()``, each part of
# ``weight.split(8)``, ``unbind``, ``chunk``): under ``no_grad`` their result carries the write rule (an in-place
# init of a row goes through one). ``detach`` is not among them: it is ``.data`` (an alias under any grad mode),
# and so is a ``state_dict()`` entry (:class:`OffloadedEntry`).
_VIEWS = frozenset({"__getitem__", "select", "narrow", "view", "view_as", "reshape", "reshape_as", "flatten",
                    "unflatten", "t", "transpose", "swapaxes", "swapdims", "permute", "squeeze", "unsqueeze",
                    "expand", "expand_as", "diagonal", "movedim", "moveaxis", "as_strided", "unfold",
                    "split", "split_with_sizes", "tensor_split", "unbind", "chunk", "hsplit", "vsplit", "dsplit"})


def placeholder_class() -> Any:
    """The class of a marked placeholder (built on first use: torch is imported by then)."""
    if "placeholder" not in CLASSES:
        import torch

        CLASSES["parameter"], CLASSES["tensor"] = torch.nn.Parameter, torch.Tensor
        CLASSES["placeholder"], CLASSES["buffer"], CLASSES["data"] = _build_classes()
    return CLASSES["placeholder"]


def quantized_placeholder_class(base: Any) -> Any:
    """The class of a marked placeholder of bitsandbytes' 4-bit parameter class ``base`` (``Params4bit``).

    In memory a write into a 4-bit weight writes its packed bytes (``weight.data.zero_()``, a row of them, a
    ``copy_`` of packed bytes); offloaded, it went into the meta placeholder and was lost. Marked, it is replayed on
    the stored packed bytes as any placeholder's write is, and the next forward loads them with the layer's quant
    state, which is not written. The class keeps ``base``'s name (accelerate rebuilds a parameter by its class name:
    ``Params4bit(value, **placeholder.__dict__)``; transformers counts 4-bit parameters by it), and building one
    (accelerate loading a value for a forward) gives a plain ``base``."""
    cls = CLASSES.get(base)
    if cls is not None:
        return cls
    placeholder_class()
    marked = CLASSES["marked"]
    ours = (SLOT, ALIAS)
    # bitsandbytes' own __torch_function__ (torch.chunk/torch.split of a 4-bit parameter stay 4-bit parameters), where
    # the release has one; else the disabled one nn.Parameter has
    own_torch_function = getattr(base.__torch_function__, "__func__", None)
    constructor_keywords = keyword_names(base.__new__) - {"cls", "data", "requires_grad"}

    class OffloadedPlaceholder4bit(marked, base):
        _metapatch_plain = False  # a quantized class: the offload store does not copy it as a plain tensor

        def __new__(cls, data: Any = None, requires_grad: bool = False, **fields: Any) -> Any:
            return base(data, requires_grad, **{k: v for k, v in fields.items() if k not in ours})

        def _plain(self, tensor: Any, memo: Optional[dict] = None) -> Any:
            fields = {k: v for k, v in self.__dict__.items() if k not in ours}
            if memo is not None:  # a deep copy of the model: its own quant state, its module's copy
                import copy

                fields = copy.deepcopy(fields, memo)
            # what other libraries set on the parameter (transformers 5.x: ``_is_hf_initialized``) is an attribute of
            # the copy, not an argument: bitsandbytes < 0.50 takes no keyword it does not name
            extra = {k: fields.pop(k) for k in list(fields) if k not in constructor_keywords}
            plain = base(tensor, self.requires_grad, **fields)
            plain.__dict__.update(extra)
            return plain

        @classmethod
        def _unrouted(cls, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
            if own_torch_function is not None:
                return own_torch_function(cls, func, types, args, kwargs)
            return marked._unrouted.__func__(cls, func, types, args, kwargs)

    OffloadedPlaceholder4bit.__name__ = OffloadedPlaceholder4bit.__qualname__ = base.__name__
    CLASSES[base] = OffloadedPlaceholder4bit
    quiet_sibling(OffloadedPlaceholder4bit, base.__dict__.get("__torch_function__"))
    return OffloadedPlaceholder4bit


def _build_classes() -> Tuple[Any, Any, Any]:
    import torch

    not_routed = object()  # what _route_write answers for a call it leaves to torch
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
            if writes_into(func, args, kwargs, PlaceholderData):
                if func._schema.name.split("::")[-1] in RESHAPING and not (args and getattr(args[0], "_itself", 0)):
                    # set_/resize_/squeeze_ on an alias (``weight.data.set_(t)``) re-points that alias only: the
                    # parameter keeps its value in memory too
                    return args[0]
                replay_write(func, args, kwargs, PlaceholderData)
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
                return type(out)(PlaceholderData(piece, root, chain + ((functools.partial(part, func, index), rest,
                                                                        unwrapped_kwargs),))
                                 for index, piece in enumerate(out))
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

    def _root(value: Any) -> Any:
        """The marked placeholder ``value`` stands for: itself, or what its ``state_dict()`` entry aliases."""
        return value if SLOT in value.__dict__ else value.__dict__.get(ALIAS)

    def _writable(value: Any) -> bool:
        """A marked placeholder (or a ``state_dict()`` entry of one) torch lets a call write (no autograd recording
        it): the call writes its data."""
        return isinstance(value, _Marked) and _root(value) is not None and value.is_meta \
            and not (value.requires_grad and torch.is_grad_enabled())

    def _data_of(value: Any) -> Any:
        """The :class:`PlaceholderData` a call on ``value`` writes through (set_ on a ``state_dict()`` entry
        re-points the entry only, as in memory)."""
        root = _root(value)
        return PlaceholderData(data_getter(value), root, (), itself=root is value)

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
            several = isinstance(out, (list, tuple))
            outs = tuple(out) if several else (out,)
            routed = [_as_data(v) for v in outs]
            if all(r is o for r, o in zip(routed, outs)):
                return not_routed
            result = func(*args, **{**kwargs, "out": type(out)(routed) if several else routed[0]})
            return out if several or isinstance(result, PlaceholderData) else result
        if not args or not _writable(args[0]) or not _is_write_method(name):
            return not_routed
        data = _as_data(args[0])
        result = func(data, *args[1:], **kwargs)
        return args[0] if result is data else result

    def _route_foreach(func: Any, args: tuple, kwargs: dict) -> Any:
        """A ``_foreach_`` write over a list holding marked placeholders: each placeholder's entry is its own call
        (the lists are aligned by index, so the entries are independent), the rest one call, as torch's."""
        written = args[0]
        marked = [i for i, value in enumerate(written) if _writable(value)]
        if not marked or not _is_write_method(getattr(func, "__name__", "")):
            return not_routed
        aligned = [isinstance(a, (list, tuple)) and len(a) == len(written) for a in args]

        def entries(indices: List[int], routed: bool) -> tuple:
            picked = []
            for position, argument in enumerate(args):
                if not aligned[position]:
                    picked.append(argument)
                    continue
                chosen = [argument[i] for i in indices]
                picked.append([_as_data(v) for v in chosen] if routed and position == 0 else chosen)
            return tuple(picked)

        rest = [i for i in range(len(written)) if i not in set(marked)]
        if rest:
            disabled(func, (), entries(rest, False), kwargs)
        for index in marked:
            func(*entries([index], True), **kwargs)
        return None  # torch's in-place _foreach_ functions return None

    def _is_meta_asked(tensor: Any, caller: Any, meta: bool) -> bool:
        """``tensor.is_meta``. Since torch 2.13, ``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``,
        ``dirac_`` and ``sparse_`` return at once on a meta tensor, before any write: asked by one of them about a
        writable marked placeholder, the function runs here on the stored value (its own arguments, the
        placeholder's value in its place), the result is kept, and the answer (meta) lets the call on the
        placeholder return unchanged, as it did."""
        if meta and _in_place_init(caller) and _writable(tensor):
            function = caller.f_globals.get(caller.f_code.co_name)
            if getattr(function, "__code__", None) is caller.f_code:
                replay_call(function, caller, tensor)
        return meta

    def _in_place_init(caller: Any) -> bool:
        """Whether ``caller`` is an in-place ``torch.nn.init`` function (torch's naming), not a reader such as a fan
        count."""
        return caller.f_globals.get("__name__") == "torch.nn.init" and caller.f_code.co_name.endswith("_")

    class _Marked:
        """What a marked placeholder (a parameter's or a buffer's) overrides: writes into it reach the offload
        store."""

        _metapatch_placeholder = True
        _metapatch_plain = True  # the offload store copies it as a plain tensor (not a quantized class)

        def _plain(self, tensor: Any, memo: Optional[dict] = None) -> Any:
            """A tensor of this placeholder's unmarked class holding ``tensor`` (``memo``: for a deep copy)."""
            raise NotImplementedError

        @classmethod
        def _unrouted(cls, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
            """A call no write rule takes: the unmarked class's own ``__torch_function__``."""
            return disabled(func, types, args, kwargs)

        def __deepcopy__(self, memo: Any) -> Any:
            copied = self._plain(torch.empty_like(tensor_detach(self)), memo)
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
            it reaches the weight. ``state_dict()`` takes an :class:`OffloadedEntry` (a meta tensor with storage, as
            torch's entries are, for the readers of a state dict), which aliases the weight the same way."""
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
                entry.__class__ = CLASSES["entry"]
                entry.__dict__[ALIAS] = self
                return entry
            return PlaceholderData(data, self, ())

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
            """torch's in-place *functions* given a marked placeholder (``torch.relu_(w)``, ``torch.fill_(w, v)``,
            ``torch.add(a, b, out=w)``, ``torch._foreach_mul_(params, s)``, ``torch.nn.init.eye_``) write it as its
            methods do: they run on its :class:`PlaceholderData`. Every other call is torch's, on plain tensors, as
            ``nn.Parameter``'s disabled override gives (a Python call per attribute read: 1.2 us, measured)."""
            name = getattr(func, "__name__", "")
            if name == "__get__":  # an attribute read: accelerate makes eight per placeholder and load, first
                value = disabled(func, types, args, kwargs or {})
                if func.__self__ is is_meta_attribute:
                    return _is_meta_asked(args[0], sys._getframe(1), value)
                return value
            kwargs = kwargs or {}
            if name == "new_empty" and _in_place_init(sys._getframe(1)) and _writable(args[0]):
                # torch < 2.13's orthogonal_ computes its value in weight.new_empty(...): a real one, where the
                # in-memory weight is, so that what it then copies into the weight is known (and the same numbers)
                return scratch_like(args[0], disabled(func, types, args, kwargs))
            if "out" in kwargs or _is_write_method(name):
                routed = _route_write(func, args, kwargs)
                if routed is not not_routed:
                    return routed
            return cls._unrouted(func, types, args, kwargs)

        @property
        def data(self) -> Any:
            data = data_getter(self)
            if not data.is_meta:
                return data
            root = _root(self)
            return PlaceholderData(data, root, ()) if root is not None else data

        @data.setter
        def data(self, value: Any) -> None:
            if not value.is_meta and data_getter(self).is_meta and SLOT in self.__dict__:
                assign(self, value)  # ``weight.data = t``: torch refuses a meta tensor a CPU value
                return
            before = self.dtype
            data_setter(self, value)
            if value.is_meta and value.dtype != before and SLOT in self.__dict__:
                converted(self)  # Module._apply (.half(), .to(dtype) of any submodule) sets .data

    class OffloadedPlaceholder(_Marked, torch.nn.Parameter):
        """A parameter's meta placeholder an accelerate offload hook serves."""

        def __new__(cls, data: Any = None, requires_grad: bool = True) -> Any:
            if data is None or not data.is_meta:  # accelerate loading a value for a forward: a plain parameter
                return torch.nn.Parameter(data, requires_grad)
            return super().__new__(cls, data, requires_grad)

        def _plain(self, tensor: Any, memo: Optional[dict] = None) -> Any:
            return torch.nn.Parameter(tensor, self.requires_grad)

    class _MarkedTensor(_Marked, torch.Tensor):
        """A marked plain tensor (not a parameter): a copy or pickle of it is a plain tensor."""

        def _plain(self, tensor: Any, memo: Optional[dict] = None) -> Any:
            return tensor

    class OffloadedEntry(_MarkedTensor):
        """A ``state_dict()`` entry of a marked placeholder (a meta tensor): writes into it are writes into the
        placeholder, as a state dict's entries alias the model's tensors in memory."""

    CLASSES["entry"], CLASSES["marked"] = OffloadedEntry, _Marked

    class OffloadedBuffer(_MarkedTensor):
        """A buffer's meta placeholder an offload hook serves (``offload_buffers=True``): BatchNorm's running
        statistics, reset between forwards by ``reset_running_stats()``."""

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

    quiet_sibling(OffloadedPlaceholder, disabled)
    quiet_sibling(OffloadedBuffer, disabled)
    return OffloadedPlaceholder, OffloadedBuffer, PlaceholderData


def _is_write_method(name: str) -> bool:
    """Whether ``torch.Tensor.<name>`` writes its tensor's values (``__setitem__``, ``__iadd__``..., ``mul_``...)."""
    if name == "__setitem__":
        return True
    if name.startswith("__") and name.endswith("__"):  # __iadd__, __imul__, ... (not __int__, __init_subclass__)
        return name in _AUGMENTED_ASSIGNMENTS
    return name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES
