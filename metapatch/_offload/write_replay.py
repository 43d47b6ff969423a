"""Replaying a write into an offloaded weight's marked placeholder on the value its offload hook stores.

A marked placeholder (:mod:`metapatch._offload.placeholder_writes`) stands for ``(module, name)`` of a hook's
weights map. A write into it (an aten op through its ``PlaceholderData``, ``weight.data = t``, a dtype conversion,
a ``torch.nn.init`` call run on the stored value) is replayed here: the stored value is copied onto the hook's
execution device, where the in-memory weight is (:class:`Materialised`: a random write draws from that device's
generator, the program's other operands stay where it put them), written there, and kept in CPU memory in the
hook's :class:`~metapatch._offload.store.Overlay`,
which the next forward and ``save_pretrained`` read; or refused with
:class:`~metapatch._offload.offloaded_weights.OffloadedWriteError` (a meta source, a change of shape or dtype, a
tie it cannot follow, a placeholder its module no longer holds), keeping nothing. A tied pair of offloaded weights
(:func:`tie_partner`) is one placeholder, and a write into it is kept for both hooks. The torch classes that route writes here
are :mod:`metapatch._offload.placeholder_classes`.

Nothing here imports torch or accelerate at import time.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional, Tuple

from metapatch._framework.records import MetapatchError
from metapatch._offload.hook_state import compute_device, offload_hook
from metapatch._offload.offloaded_weights import OffloadedWriteError
from metapatch._offload.store import NOT_A_PAIR, TIES_UNKNOWN, convert, overlay_of, tied_name

SLOT = "_metapatch_placeholder_of"  # in a marked placeholder's __dict__: (weakref to module, local dotted name)
ALIAS = "_metapatch_entry_of"  # in a state_dict() entry's __dict__: the marked placeholder it aliases
PARTNERS = "_metapatch_tie_partners"  # in a module's __dict__: {name: (weakref to the tied module, its name)}
# id(QuantState of a 4-bit weight) -> how many writes were kept for its offloaded weight; an entry goes with its
# state. A repacked copy made from the bytes before a write is stale after it, and nothing else tells: the bytes may
# be written in place or a new copy land at a freed copy's address, the loaded parameter's own _version does not
# follow its storage, and bnb-quant-state-offload rebuilds the state's __dict__ at every reload.
_KEPT_WRITES: Dict[int, int] = {}

# aten in-place ops that change a tensor's shape, strides or storage: replayed on a copy, so a refused
# change leaves the kept value as it was.
RESHAPING = frozenset({"set_", "resize_", "resize_as_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
                        "transpose_", "swapdims_", "swapaxes_", "detach_"})


def write_error(message: str) -> Exception:
    return OffloadedWriteError(message)


def describe(module: Any, name: str) -> str:
    return f"{type(module).__name__}.{name}"


def owner(placeholder: Any, tied_ok: bool = False) -> Tuple[Any, str, Any]:
    """(module, name as its weights map names it, hook) a marked placeholder stands for; raises when its
    module no longer holds it (a copy of the model, the module loaded back) or serves it from no store, and, unless
    ``tied_ok``, when it is a tied weight whose every copy a write could not reach (:func:`tie_partner`)."""
    ref, name = placeholder.__dict__.get(SLOT, (None, ""))
    module = ref() if ref is not None else None
    holder = module
    *path, local = name.split(".") if name else [""]
    for part in path:
        holder = getattr(holder, "_modules", {}).get(part)
    if holder is None or (holder._parameters.get(local) is not placeholder
                          and holder._buffers.get(local) is not placeholder):
        raise write_error(f"metapatch: a write into an offloaded weight's meta placeholder "
                          f"({tuple(placeholder.shape)}) whose module no longer serves it: the value would go nowhere. "
                          f"Write into the tensor the model holds now (getattr(module, name), or a state_dict() taken "
                          f"after the last forward: each forward puts new placeholders in place).")
    hook = offload_hook(module)
    if hook is None:
        raise write_error(f"metapatch: a write into {describe(module, name)}, a meta placeholder no accelerate offload "
                     f"hook serves any more: the value would go nowhere.")
    if not tied_ok and name in module.__dict__.get(TIES_UNKNOWN, ()):
        raise write_error(f"metapatch: a write into {describe(module, name)}, an offloaded weight whose offload hook was "
                          f"attached before metapatch was imported, from a store where metapatch cannot tell whether it "
                          f"is tied to another module's weight: keeping the write for this copy alone could leave a "
                          f"tied copy with the old value. Import metapatch before loading or dispatching the model.")
    if not tied_ok and tied_name(module, hook, name) and tie_partner(module, name, placeholder) is None:
        raise write_error(f"metapatch: a write into {describe(module, name)}, an offloaded weight tied to other "
                     f"modules' in a way metapatch cannot follow (more than one other module, one kept in memory, or "
                     f"a tie it did not see being made): keeping the write here could leave another copy with the "
                     f"old value. Write before dispatching the model, or keep the tied modules in memory (device_map).")
    return module, name, hook


def tie_partner(module: Any, name: str, placeholder: Any) -> Optional[Tuple[Any, str, Any]]:
    """(partner module, its name, its offload hook) of the tied weight ``placeholder`` stands for, where a write can
    be kept for both: the tie is a pair of offloaded modules, each the other's recorded partner, that hold this one
    placeholder object (as in memory they hold one parameter), so both hooks serve one kept value. None otherwise."""
    if name in module.__dict__.get(NOT_A_PAIR, ()):
        return None
    ref, partner_name = module.__dict__.get(PARTNERS, {}).get(name, (None, ""))
    partner = ref() if ref is not None else None
    if partner is None or partner_name in partner.__dict__.get(NOT_A_PAIR, ()):
        return None
    back_ref, back_name = partner.__dict__.get(PARTNERS, {}).get(partner_name, (None, ""))
    if back_ref is None or back_ref() is not module or back_name != name:
        return None
    partner_hook = offload_hook(partner)
    if partner_hook is None or partner._parameters.get(partner_name) is not placeholder:
        return None
    return partner, partner_name, partner_hook


# aten writes that only move values (no arithmetic, no random draw, no index or mask that must share the weight's
# device): bit for bit the same on any device, so with CPU operands they are replayed on the kept value in CPU
# memory, in place (a textual-inversion loop writes one row per step, ``emb.weight.data[token] = learned``: on the
# execution device each write would copy the whole stored tensor there and back)
MOVING_ONLY = frozenset({"copy_", "fill_", "zero_"})


def write_device(hook: Any) -> Any:
    """Where a write into ``hook``'s offloaded weights runs: its execution device, where the in-memory weight is (the
    CPU for a hook that computes nothing: accelerate's meta execution device)."""
    device = compute_device(hook)
    if device.type == "meta":
        import torch

        device = torch.device("cpu")
    return device


class Materialised:
    """The stored values of the placeholders one write touches, on their hooks' execution devices (``on_cpu``: in CPU
    memory, for a write that only moves values), and where to keep them (in CPU memory)."""

    def __init__(self, on_cpu: bool = False) -> None:
        self.values: Dict[int, Tuple[Any, Any, str, Any, Any]] = {}
        self.on_cpu = on_cpu

    def of(self, placeholder: Any, copy: bool) -> Any:
        entry = self.values.get(id(placeholder))
        if entry is None:
            import torch

            module, name, hook = owner(placeholder)
            partner = tie_partner(module, name, placeholder) if tied_name(module, hook, name) else None
            overlay = overlay_of(hook)
            kept = overlay.kept.get(name)
            # The write runs where the in-memory weight is, the hook's execution device: a random one draws from that
            # device's generator, with the program's other operands where it put them, as in memory.
            device = torch.device("cpu") if self.on_cpu else write_device(hook)
            if not copy and kept is not None and kept.device == device and kept.dtype == placeholder.dtype \
                    and kept.shape == placeholder.shape:
                value = kept  # written in place: a training loop writes one row per step
            else:
                value = overlay[name].detach().to(device=device, dtype=placeholder.dtype, copy=True)
            entry = (placeholder, value, name, hook, partner)
            self.values[id(placeholder)] = entry
        return entry[1]

    def keep(self) -> None:
        for placeholder, value, name, hook, _ in self.values.values():
            if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
                raise write_error(f"metapatch: a write that changes the shape or dtype of an offloaded weight's "
                             f"placeholder ({name}: {tuple(placeholder.shape)} {placeholder.dtype} -> "
                             f"{tuple(value.shape)} {value.dtype}); the offload hook serves the placeholder's shape. "
                             f"Replace the module (or keep it in memory with the device_map) instead.")
        for placeholder, value, name, hook, partner in self.values.values():
            if value is not overlay_of(hook).kept.get(name) and value.device.type != "cpu":
                value = value.to("cpu")  # kept in CPU memory, as the stored value was
            overlay_of(hook).kept[name] = value
            if partner is not None:  # a tied pair: both hooks serve the one kept value, as both modules hold one tensor
                overlay_of(partner[2]).kept[partner[1]] = value
            _count_write(placeholder)


def converted(placeholder: Any) -> None:
    """A dtype conversion reached a marked placeholder (``module.half()``, ``.to(torch.bfloat16)`` of the model or of
    any submodule: torch's ``Module._apply`` sets ``.data``): the store serves the stored value converted as the
    in-memory tensor was, step by step (a chain keeps its lossy step), not cast straight to the last dtype."""
    try:
        module, name, hook = owner(placeholder, tied_ok=True)
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


def assign(placeholder: Any, value: Any) -> None:
    """``weight.data = value`` on a marked placeholder: in memory the parameter takes ``value``'s storage (it
    aliases it); here ``value`` itself, on its device, is kept for the hook to serve (as a replaced weight is,
    :mod:`metapatch._offload.replaced_weights`), so later writes into it, or into the weight, show as in memory.
    Another shape or dtype would change the parameter: refused."""
    module, name, hook = owner(placeholder)
    if value.shape != placeholder.shape or value.dtype != placeholder.dtype:
        raise write_error(f"metapatch: {describe(module, name)}.data = a tensor of another shape or dtype "
                     f"({tuple(value.shape)} {value.dtype}, the offloaded weight is {tuple(placeholder.shape)} "
                     f"{placeholder.dtype}); the offload hook serves the placeholder's shape. Replace the module (or "
                     f"keep it in memory with the device_map) instead.")
    import torch

    if value.is_inference():  # accelerate could not make a parameter of it at the next forward: a normal copy
        with torch.inference_mode(False):
            value = value.clone()
    value = value.detach()
    overlay_of(hook).kept[name] = value
    partner = tie_partner(module, name, placeholder) if tied_name(module, hook, name) else None
    if partner is not None:  # a tied pair: both hooks serve it
        overlay_of(partner[2]).kept[partner[1]] = value
    _count_write(placeholder)


def _count_write(placeholder: Any) -> None:
    """A write kept for a quantized placeholder (bitsandbytes' ``Params4bit``): counted per quant state object, which
    the weight loaded at the next forward carries (:func:`kept_writes`)."""
    state = placeholder.__dict__.get("quant_state")
    if state is None:
        return
    if id(state) not in _KEPT_WRITES:
        weakref.finalize(state, _KEPT_WRITES.pop, id(state), None)
    _KEPT_WRITES[id(state)] = _KEPT_WRITES.get(id(state), 0) + 1


def kept_writes(state: Any) -> int:
    """How many writes were kept for the offloaded 4-bit weight whose quant state is ``state``."""
    return _KEPT_WRITES.get(id(state), 0)


def replay_write(func: Any, args: tuple, kwargs: dict, data_cls: Any) -> Any:
    """Replay one aten write whose written argument is a ``data_cls`` view of a marked placeholder
    (:class:`~metapatch._offload.placeholder_classes` ``PlaceholderData``) on the stored values, and keep them."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    op = func._schema.name.split("::")[-1]
    reshaping = op in RESHAPING
    store = Materialised(on_cpu=op in MOVING_ONLY and not any(
        isinstance(value, torch.Tensor) and not isinstance(value, data_cls) and value.device.type != "cpu"
        for value in tree_leaves((args, kwargs))))

    def real(value: Any) -> Any:
        if isinstance(value, data_cls):
            view = store.of(value._root, copy=reshaping)
            for step, rest, kw in value._chain:
                view = step(view, *rest, **kw)
            return view
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise write_error("metapatch: a write into an offloaded weight's placeholder from a tensor on the meta "
                         "device (itself a placeholder, or computed from one): its values are unknown here. "
                         "Read the value inside a forward, or from the in-memory model.")
        # the program's operands stay where it put them (a GPU scale, a CPU row): the stored value is on the execution
        # device, where the in-memory weight is (Materialised), so the op meets the devices it meets in memory
        return value

    # Outside inference mode: a value copied under it would be an inference tensor, which accelerate cannot make
    # a parameter of at the next forward (the in-memory model's tensor stays a normal one too).
    with torch.inference_mode(False), torch.no_grad():
        real_args, real_kwargs = tree_map(real, args), tree_map(real, kwargs)
        func(*real_args, **real_kwargs)
    store.keep()


def replay_call(function: Any, frame: Any, placeholder: Any) -> None:
    """Call ``function`` with the arguments ``frame`` (its own call, stopped at its first line's meta check) was
    given, ``placeholder`` replaced by its stored value on the hook's execution device, and keep the value."""
    import torch

    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    store = Materialised()
    # Outside inference mode, as in replay_write: a value copied under it could not be written by the next call outside.
    with torch.inference_mode(False), torch.no_grad():
        arguments = {}
        for name in names:
            value = frame.f_locals[name]
            # a state_dict() entry stands for the placeholder it aliases
            arguments[name] = store.of(placeholder.__dict__.get(ALIAS, placeholder), copy=False) \
                if value is placeholder else value
        positional = [arguments.pop(name) for name in code.co_varnames[:code.co_argcount]]
        function(*positional, **arguments)
    store.keep()


def scratch_like(placeholder: Any, meta_result: Any) -> Any:
    """An uninitialised tensor shaped as ``meta_result`` on the execution device of ``placeholder``'s hook, where the
    in-memory weight is: what ``weight.new_empty(...)`` gives an in-place ``torch.nn.init`` function in memory (torch
    < 2.13's ``orthogonal_`` draws its matrix into one, then copies it into the weight: on a meta scratch the copied
    value would be unknown, and the write refused)."""
    import torch

    _, _, hook = owner(placeholder, tied_ok=True)
    return torch.empty(meta_result.shape, dtype=meta_result.dtype, device=write_device(hook))


def part(func: Any, index: int, view: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``index``-th view ``func`` (``split``, ``unbind``, ``chunk``...) makes of ``view``: one step of a chain."""
    return func(view, *args, **kwargs)[index]


def writes_into(func: Any, args: tuple, kwargs: dict, data_cls: Any) -> bool:
    """Whether the aten op ``func`` writes an argument that is a ``data_cls`` view (or a list holding one)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, data_cls) or (isinstance(value, (list, tuple))
                                           and any(isinstance(v, data_cls) for v in value)):
            return True
    return False
