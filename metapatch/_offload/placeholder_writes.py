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

Here: marking, and the tied weights' bookkeeping. The marked classes are
:mod:`metapatch._offload.placeholder_classes`, the replay on the stored value
:mod:`metapatch._offload.write_replay`. Replacing the placeholder (``module.weight = nn.Parameter(v)``) is
:mod:`metapatch._offload.replaced_weights`.

Nothing here imports torch or accelerate at import time.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Dict, List, Tuple

from metapatch._offload.hook_state import CPU, DISK, hooked_modules_alive, locate, offload_hooks, weights_map_of
from metapatch._offload.module_walk import live_modules, named_modules, roots
from metapatch._offload.placeholder_classes import CLASSES, placeholder_class, quantized_placeholder_class
from metapatch._offload.placeholder_quiet import LOUD, QUIET
from metapatch._offload.store import NOT_A_PAIR, TIED_MARK, TIES_UNKNOWN
from metapatch._offload.tied_members import tied_groups
from metapatch._offload.write_replay import PARTNERS, SLOT

# On a module: whether its tied weights were looked for (note_ties at its hook's init_hook, or adopt_hooked_before)
TIES_NOTED = "_metapatch_ties_noted"
# [WeakIdKeyDictionary: tensor -> [(weakref to a hooked module holding it when its hook was attached, its name there,
# whether that hook offloads, weakref to the module whose _parameters hold it, the local name)]], built on first use
_SEEN: List[Any] = []


def note_ties(module: Any, hook: Any) -> None:
    """Before ``hook`` attaches to ``module`` (its ``init_hook``, offloading or not): a parameter object another module
    held when its hook was attached is a tied weight (a tied head and input embedding are one object until their
    offload hooks put a placeholder in each). Two offloaded modules holding it are recorded as tie partners
    (:func:`record_tie`): their placeholders are one object between forwards, and a write into it is kept for both
    hooks. A tie with a third member, or with a module kept in memory, is marked ``NOT_A_PAIR`` on its offloaded
    members: a write into their placeholder raises, since it could not reach every copy."""
    offloading = getattr(hook, "offload", False)
    module.__dict__[TIES_NOTED] = True
    from torch.utils.weak import WeakIdKeyDictionary

    if not _SEEN:
        _SEEN.append(WeakIdKeyDictionary())
    seen = _SEEN[0]
    named = module.named_parameters() if getattr(hook, "place_submodules", False) else module._parameters.items()
    for name, tensor in list(named):
        if tensor is None:
            continue
        slot = _slot_of(module, name)
        records = []
        for ref, held, offloaded, slot_ref, slot_local in seen.get(tensor, ()):
            other, slot_owner = ref(), slot_ref()
            # the very slot seen again (through a block's hook, then its own; a model dispatched again) is no tie
            if other is not None and slot_owner is not None and (slot_owner, slot_local) != slot:
                records.append((other, held, offloaded, slot_owner, slot_local))
        seen[tensor] = [(weakref.ref(other), held, offloaded, weakref.ref(owner), local)
                        for other, held, offloaded, owner, local in records] + \
            [(weakref.ref(module), name, offloading, weakref.ref(slot[0]), slot[1])]
        holders = [(other, held, offloaded) for other, held, offloaded, _, _ in records]
        if not holders:
            continue
        first_offloaded = next(((other, held) for other, held, offloaded in holders if offloaded), None)
        if offloading and first_offloaded is not None:
            record_tie(first_offloaded[0], first_offloaded[1], module, name)
        if len(holders) > 1 or not offloading or not all(offloaded for _, _, offloaded in holders):
            for other, held in [(o, h) for o, h, offloaded in holders if offloaded] + ([(module, name)] if offloading
                                                                                      else []):
                other.__dict__[NOT_A_PAIR] = frozenset(other.__dict__.get(NOT_A_PAIR, ())) | {held}


def adopt_hooked_before() -> int:
    """The offload hooks attached before this mechanism was in place (a model dispatched, then ``import metapatch``):
    their placeholders are plain meta tensors, and a write into one vanishes, silently, as upstream. Each is marked
    now, as :func:`mark` after ``init_hook`` would have; returns how many modules were adopted.

    Which of their weights are tied, :func:`note_ties` never saw (the hooks split every tie into one placeholder
    each), so each is decided from what is left, and refused where that cannot tell (a write kept for one copy of a tie
    would leave the other with the old value):

    * a tie the model declares (transformers' ``all_tied_weights_keys``, :func:`tied_groups`) between two offloaded
      weights whose stores hold one tensor (one storage in memory, one index entry on disk) is a pair, recorded as
      :func:`note_ties` records one (a write is kept for both); any other declared tie (a member kept in memory,
      three or more, or stores that cannot be compared: one in memory, one on disk) is refused (``NOT_A_PAIR``);
    * undeclared, two offloaded weights served from one tensor in memory (``cpu_offload``'s state dict holds a tied
      weight under both names) are a pair, three or more refused;
    * the rest is untied where ``dispatch_model`` made the hooks (accelerate's own record of the ties it found,
      ``tied_params_names``, which :func:`metapatch._offload.store.tied_name` reads), and refused where it did not
      and the weight is on disk (``TIES_UNKNOWN``: nothing left says whether it was tied)."""
    everything = live_modules()
    adopted = [(module, hook) for module in hooked_modules_alive(everything) if not module.__dict__.get(TIES_NOTED)
               for hook in offload_hooks(module) if weights_map_of(hook) is not None]
    if not adopted:
        return 0
    stores: Dict[Tuple[int, str], Any] = {}  # (id(module), name) -> where its value is stored
    for module, hook in adopted:
        module.__dict__[TIES_NOTED] = True
        named = module.named_parameters() if getattr(hook, "place_submodules", False) else module._parameters.items()
        for name, param in list(named):
            if param is not None and param.is_meta:
                stores[(id(module), name)] = (module, name, hook, _stored_identity(weights_map_of(hook), name))
    decided = _declared_ties(stores, roots(everything))
    sharing: Dict[Any, List[Any]] = {}
    for key, (module, name, hook, stored) in stores.items():
        if key in decided:
            continue
        if stored is not None and stored[0] == CPU:
            sharing.setdefault(stored, []).append((module, name))
        elif getattr(hook, "tied_params_map", None) is None:
            _refuse(module, name, unknown=True)
    for members in sharing.values():
        if len(members) == 2:
            (module, name), (other, other_name) = members
            record_tie(module, name, other, other_name)
        elif len(members) > 2:
            for module, name in members:
                _refuse(module, name)
    for module, hook in adopted:
        mark(module, hook)
    return len(adopted)


def _declared_ties(stores: Dict[Tuple[int, str], Any], models: List[Any]) -> set:
    """The ties the models holding adopted modules declare, decided (see :func:`adopt_hooked_before`); returns the
    keys of ``stores`` they decided."""
    decided: set = set()
    by_module: Dict[int, List[Tuple[int, str]]] = {}
    for key in stores:
        by_module.setdefault(key[0], []).append(key)
    for model in models:
        slots = {}  # the model's name of each adopted weight -> its key in stores
        for prefix, module in named_modules(model):
            for key in by_module.get(id(module), ()):
                slots[(prefix + "." if prefix else "") + key[1]] = key
        if not slots:
            continue
        for group in tied_groups(model):
            offloaded = [slots[name] for name in group if name in slots]
            if not offloaded:
                continue
            decided.update(offloaded)
            one_store = (len(group) == 2 and len(offloaded) == 2 and stores[offloaded[0]][3] is not None
                         and stores[offloaded[0]][3] == stores[offloaded[1]][3])
            if one_store:
                (module, name, _, _), (other, other_name, _, _) = stores[offloaded[0]], stores[offloaded[1]]
                record_tie(module, name, other, other_name)
            else:
                for key in offloaded:
                    _refuse(stores[key][0], stores[key][1])
    return decided


def _refuse(module: Any, name: str, unknown: bool = False) -> None:
    """A write into ``module.<name>`` raises: a tie it could not reach every copy of (``unknown``: a tie nothing tells)."""
    module.__dict__[NOT_A_PAIR] = frozenset(module.__dict__.get(NOT_A_PAIR, ())) | {name}
    if unknown:
        module.__dict__[TIES_UNKNOWN] = frozenset(module.__dict__.get(TIES_UNKNOWN, ())) | {name}


def _stored_identity(weights_map: Any, name: str) -> Any:
    """What tells the value stored for ``name`` apart from every other: (CPU, its memory and layout) for a tensor in
    memory; (DISK, file, tensor name) for an offload-index entry that points into a safetensors file (transformers'
    index points a tied weight at its source's tensor), (DISK, folder, key) for one in its own file; None for a store
    that cannot be looked into."""
    found = locate(weights_map, name)
    if found is None:
        return None
    entry = found.entry
    if found.store == DISK:
        if isinstance(entry, dict) and entry.get("safetensors_file") and entry.get("weight_name"):
            return (DISK, str(entry["safetensors_file"]), str(entry["weight_name"]))
        return (DISK, str(found.folder), found.key)
    if getattr(entry, "is_meta", True) or not hasattr(entry, "untyped_storage"):
        return None
    return (CPU, entry.untyped_storage().data_ptr(), entry.storage_offset(), tuple(entry.shape), tuple(entry.stride()),
            entry.dtype)


def _slot_of(module: Any, name: str) -> Any:
    """(the module whose ``_parameters`` hold ``module``'s parameter ``name``, its local name)."""
    *path, local = name.split(".")
    owner = module
    for part in path:
        owner = owner._modules[part]
    return owner, local


def record_tie(module: Any, name: str, other: Any, other_name: str) -> None:
    """``module.<name>`` and ``other.<other_name>`` are one tied weight served by two hooks: their placeholders are one
    object between forwards (:func:`mark`), and a write into it is kept for both (:func:`tie_partner`). Recording a
    second partner for either side (a tie of three or more) marks all of them ``NOT_A_PAIR``."""
    for (owner, local), (partner, partner_name) in (((module, name), (other, other_name)),
                                                   ((other, other_name), (module, name))):
        owner.__dict__[TIED_MARK] = frozenset(owner.__dict__.get(TIED_MARK, ())) | {local}
        partners = owner.__dict__.setdefault(PARTNERS, _Partners())
        earlier = partners.get(local)
        earlier_partner = earlier[0]() if earlier is not None else None
        if earlier_partner is not None and (earlier_partner is not partner or earlier[1] != partner_name):
            for member, member_name in ((owner, local), (partner, partner_name), (earlier_partner, earlier[1])):
                member.__dict__[NOT_A_PAIR] = frozenset(member.__dict__.get(NOT_A_PAIR, ())) | {member_name}
        partners[local] = (weakref.ref(partner), partner_name)


def untie(module: Any, name: str, replacement: Any) -> None:
    """The program replaced ``module.<name>``, a tied offloaded weight, by ``replacement``: in memory the two tied
    parameters are separate objects from then on, so their placeholders must not be one object again after the next
    forward (transformers' ``save_pretrained`` finds ties among offloaded tensors by that identity, and would save the
    partner's values under one name only). A re-tie (``replacement`` is the partner's own tensor) stays a tie."""
    partners = module.__dict__.get(PARTNERS)
    if not partners or name not in partners:
        return
    ref, partner_name = partners[name]
    partner = ref()
    if partner is not None and partner._parameters.get(partner_name) is replacement:
        return
    del partners[name]
    if partner is not None:
        partner.__dict__.get(PARTNERS, {}).pop(partner_name, None)


class _Partners(dict):
    """A module's tie partners (:data:`PARTNERS`). A deep copy of the model maps them to the partners' copies (copied
    before this module), and leaves out the others: a copy must never share a placeholder with the original."""

    def __deepcopy__(self, memo: Any) -> "_Partners":
        copied = _Partners()
        for name, (ref, partner_name) in self.items():
            partner = ref()
            partner_copy = memo.get(id(partner)) if partner is not None else None
            if partner_copy is None:
                continue
            copied[name] = (weakref.ref(partner_copy), partner_name)
            # the partner was copied first, when this module's copy did not exist yet: its copy gets the way back
            back = partner.__dict__.get(PARTNERS, {}).get(partner_name)
            owner = back[0]() if back is not None else None
            owner_copy = memo.get(id(owner)) if owner is not None else None
            if owner_copy is not None:
                partner_copy.__dict__.setdefault(PARTNERS, _Partners())[partner_name] = (weakref.ref(owner_copy), name)
        return copied


def mark(module: Any, hook: Any) -> None:
    """Mark the meta placeholders ``hook`` just put on ``module`` (after ``init_hook``/``post_forward``)."""
    if weights_map_of(hook) is None:
        return
    cls = CLASSES.get("placeholder") or placeholder_class()
    parameter, quantized = CLASSES["parameter"], _params4bit()
    if hook.place_submodules:
        items = [(name, p) for name, p in module.named_parameters()]
    else:
        items = list(module._parameters.items())
    for name, param in items:
        if param is None or type(param) not in (parameter, quantized) or not param.is_meta:
            continue
        param.__class__ = cls if type(param) is parameter else quantized_placeholder_class(quantized)
        param.__dict__[SLOT] = (weakref.ref(module), name)
    if hook.offload_buffers:  # BatchNorm's statistics: reset_running_stats() between forwards writes into them
        buffer_cls, plain = CLASSES["buffer"], CLASSES["tensor"]
        buffers = module.named_buffers() if hook.place_submodules else module._buffers.items()
        for name, buffer in list(buffers):
            if buffer is not None and type(buffer) is plain and buffer.is_meta:
                buffer.__class__ = buffer_cls
                buffer.__dict__[SLOT] = (weakref.ref(module), name)
    partners = module.__dict__.get(PARTNERS)
    if partners:
        _share_tied_placeholders(module, partners, cls)


def quieted(module: Any, hook: Any) -> List[Any]:
    """Before ``hook`` loads ``module``'s values (its ``pre_forward``): each marked placeholder takes its quiet sibling
    class (:func:`metapatch._offload.placeholder_quiet.quiet_sibling`), whose attribute reads cost what a plain
    parameter's do. Returns them for :func:`restored`, which gives each its marked class back when the load returns."""
    switched = []
    named = [module.named_parameters() if hook.place_submodules else module._parameters.items()]
    if hook.offload_buffers:  # their placeholders are marked too (mark)
        named.append(module.named_buffers() if hook.place_submodules else module._buffers.items())
    for _, tensor in itertools.chain.from_iterable(named):
        quiet = QUIET.get(type(tensor))
        if quiet is not None:
            tensor.__class__ = quiet
            switched.append(tensor)
    return switched


def restored(switched: List[Any]) -> None:
    """The placeholders :func:`quieted` switched get their marked class back (the module holds loaded values now; a
    reference the program kept to a placeholder refuses or keeps a write again, as before the load)."""
    for tensor in switched:
        tensor.__class__ = LOUD[type(tensor)]


def _params4bit() -> Any:
    """bitsandbytes' 4-bit parameter class where bitsandbytes is imported (its placeholders are marked too)."""
    return getattr(sys.modules.get("bitsandbytes.nn.modules"), "Params4bit", None)


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
