"""The one offload store: what is written into an accelerate-offloaded module is kept, or refused.

accelerate serves an offloaded module's tensors from its hook's ``weights_map`` and puts ``meta``
placeholders back after every forward, so a write into the module's tensors is thrown away at the next
load: the model silently computes with the old weights. Whatever metapatch keeps of such a write goes
into an :class:`Overlay` put in front of the hook's ``weights_map``: a CPU copy the hook serves from then
on. The user's offload folder and checkpoint are never written.

The one rule for what to keep (:func:`snapshot` before, :func:`keep_changes` after): every tensor that
changed (replaced, ``.data`` reassigned, written in place, reshaped) is kept; a change that cannot be kept
(a quantized tensor class, a weight tied to another hook's) is collected for :func:`refuse`, which raises
:class:`~metapatch._framework.records.MetapatchError` naming the tensor. Who applies the rule:
:mod:`metapatch._offload.operations` (an operation over onloaded modules: adapter loads, merges),
:func:`metapatch._offload.offloaded_weights.materialised` (a read outside the module's forward),
:mod:`metapatch._offload.placeholder_writes` (a write into a placeholder between forwards).
:func:`conversion` makes a dtype conversion of the model reach the stored values: the :class:`Overlay`
serves each converted key through the dtypes the in-memory tensor went through.

Which hook offloads a module is read by :mod:`metapatch._offload.hook_state`, for everyone. Nothing here
imports accelerate before a hook exists: a process that never imported ``accelerate.hooks`` has none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from metapatch._framework.records import MetapatchError
from metapatch._offload.hook_state import offload_hook, serve_from, weights_map_of
from metapatch._offload.module_walk import modules, submodule


def hook_tensors(module: Any, hook: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) of what ``hook`` loads and offloads on ``module``, named as its weights map names them."""
    from accelerate.utils import named_module_tensors

    return list(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                                     remove_non_persistent=True))


def slot_tensors(module: Any, hook: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) of what ``hook`` loads into ``module``: its own parameters in the common case, without
    building accelerate's list (this runs at every load and offload)."""
    if not hook.place_submodules and not hook.offload_buffers:
        return [(name, tensor) for name, tensor in module._parameters.items() if tensor is not None]
    return hook_tensors(module, hook)


_TORCH_PLAIN: set = set()  # torch's plain tensor classes, filled on first use


def torch_plain(tensor: Any) -> bool:
    """``tensor`` is of torch's own plain classes (``Tensor``, ``Parameter``), not a subclass: a type check cheap
    enough for every loaded tensor and forward."""
    if not _TORCH_PLAIN:
        import torch

        _TORCH_PLAIN.update((torch.nn.Parameter, torch.Tensor))
    return type(tensor) in _TORCH_PLAIN


class Overlay(Mapping):
    """A hook's weights map once an operation wrote into its module (or a resize replaced its tensors,
    offloaded-resize-token-embeddings, or a dtype conversion converted them, offloaded-dtype-conversion):
    the kept tensors (CPU memory) in front of the previous map, which still serves everything else and is
    only ever read. ``conversions``: for a key served from the previous map, the dtypes the model was
    converted to since, in order; each read converts the stored value through all of them, as the
    in-memory tensor went (``bf16`` then ``fp32`` keeps the bf16 rounding), one tensor at a time: a
    disk-offloaded model is never loaded as a whole."""

    def __init__(self, previous: Any, kept: Optional[Dict[str, Any]] = None) -> None:
        self.kept: Dict[str, Any] = dict(kept or {})
        self.previous = previous
        self.conversions: Dict[str, Tuple[Any, ...]] = {}

    def __getitem__(self, key: str) -> Any:
        if key in self.kept:
            return self.kept[key]
        if self.previous is None:
            raise KeyError(key)
        value = self.previous[key]
        for dtype in self.conversions.get(key, ()):
            value = value.to(dtype)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.kept or (self.previous is not None and key in self.previous)

    def __iter__(self) -> Iterator[str]:
        yield from self.kept
        if self.previous is not None:
            yield from (key for key in self.previous if key not in self.kept)

    def __len__(self) -> int:
        return sum(1 for _ in self)


TIED_MARK = "_metapatch_tied_tensors"  # on a module: names of its tensors tied to another module's
# On a module: names of its offloaded tensors tied to more than one other module's, or to one kept in memory
# (metapatch._offload.placeholder_writes.note_ties): a write into one cannot reach every copy.
NOT_A_PAIR = "_metapatch_tie_not_a_pair"
# On a module: names (also in NOT_A_PAIR) of offloaded tensors whose ties metapatch could not learn: their hook was
# attached before metapatch was imported, and the store holds them where two copies cannot be told to be one tensor
# (metapatch._offload.placeholder_writes.adopt_hooked_before).
TIES_UNKNOWN = "_metapatch_ties_unknown"


def tied_name(module: Any, hook: Any, name: str) -> bool:
    """Whether ``module.<name>``, which ``hook`` offloads, is tied to another module's tensor: by accelerate's own
    record, or by metapatch's (:func:`mark_tied`, ``note_ties``)."""
    return (name in (getattr(hook, "tied_params_names", None) or ()) or name in module.__dict__.get(TIED_MARK, ())
            or name in module.__dict__.get(NOT_A_PAIR, ()))


# On a tensor an offload hook loaded into its module (or metapatch stood in for it): never the program's own, so
# a later load that finds it still there (a forward that raised before its post_forward, a re-entered module)
# does not take it for a replacement (replaced_weights.adopt_replacements).
HOOK_LOADED = "_metapatch_hook_loaded"
# On a tensor an offload hook loaded: its ``_version`` then, or ``(copy,)`` of an inference tensor's values
# (:mod:`metapatch._offload.forward_writes`: a write the module's forward makes into it is kept).
LOADED_VERSION = "_metapatch_loaded_version"


def mark_tied(model: Any) -> None:
    """Mark every module whose tensor is tied to another one (declared ties and shared objects), so
    that a write into it is refused at the end of an operation: once accelerate has dispatched the
    model, the tied copies are separate tensors served by separate hooks (``tied_params_names`` stays
    empty for a tie transformers made before dispatch), and keeping one copy's write would leave the
    other with the old value."""
    from metapatch._offload.tied_members import tied_groups

    members: Dict[str, set] = {}
    for group in tied_groups(model):
        for name in group:
            owner, _, local = name.rpartition(".")
            members.setdefault(owner, set()).add(local)
    for name, locals_ in members.items():  # looked up by name: a walk of the whole model cost more
        submodule(model, name).__dict__[TIED_MARK] = frozenset(locals_)


def keep(hook: Any, name: str, tensor: Any) -> None:
    """``hook`` serves ``tensor`` (copied to CPU memory) for ``name`` from now on."""
    overlay_of(hook).kept[name] = tensor.detach().to("cpu", copy=True)


def overlay_of(hook: Any) -> Overlay:
    """The :class:`Overlay` ``hook`` serves from (put in front of its weights map on first use)."""
    overlay = weights_map_of(hook)
    if not isinstance(overlay, Overlay):
        overlay = Overlay(overlay)
        serve_from(hook, overlay)
    return overlay


def convert(hook: Any, name: str, dtype: Any) -> None:
    """The model converted the offloaded tensor ``name`` of ``hook`` to ``dtype`` (its placeholder shows
    it): from now on ``hook`` serves the value the in-memory tensor would have. A kept tensor (in CPU
    memory already) is converted now; a stored one at each read (:class:`Overlay`)."""
    overlay = overlay_of(hook)
    if name in overlay.kept:
        overlay.kept[name] = overlay.kept[name].to(dtype)
    else:
        overlay.conversions[name] = (*overlay.conversions.get(name, ()), dtype)


@contextlib.contextmanager
def conversion(model: Any) -> Iterator[None]:
    """A dtype conversion of ``model`` (``model.to(dtype)``, ``.half()``, ...): every offloaded tensor under
    it whose placeholder the block converts is served converted from then on (:func:`convert`). Upstream,
    torch converts only the ``meta`` placeholders, and the hook casts the stored value straight to the
    placeholder's dtype at each load: a chain (``bf16`` then ``fp32``) skips the lossy step, and
    ``save_pretrained`` (which reads the weights map) writes the stored dtype."""
    before = []
    for module in modules(model):
        hook = offload_hook(module)
        if hook is not None:
            dtypes = {name: tensor.dtype for name, tensor in hook_tensors(module, hook) if tensor.is_meta}
            if dtypes:
                before.append((module, hook, dtypes))
    yield
    for module, hook, dtypes in before:
        for name, tensor in hook_tensors(module, hook):
            if name in dtypes and tensor.is_meta and tensor.dtype != dtypes[name]:
                convert(hook, name, tensor.dtype)


def plain_tensor(tensor: Any) -> bool:
    """A plain tensor or parameter (a marked placeholder, :mod:`metapatch._offload.placeholder_writes`, counts as
    one): the store keeps a CPU copy of such a tensor; other classes (quantized) are their library's."""
    import torch

    return type(tensor) in (torch.nn.Parameter, torch.Tensor) or getattr(type(tensor), "_metapatch_plain", False)


def _changed(before: Tuple[Any, int, Optional[int], Any, Any, Optional[Any]], now: Any) -> bool:
    """Whether ``now`` holds another value than the snapshot ``before``. With a copy the values decide
    (a write through ``.data`` or under ``torch.inference_mode`` bumps no ``_version``; a tensor replaced
    by an equal one is no change); without one (a stand-in, a quantized class), any sign of a write does."""
    import torch

    tensor, pointer, version, shape, dtype, copy = before
    if now.is_meta or now.shape != shape or now.dtype != dtype or now.device != tensor.device:
        return True  # (moved to another device: torch.equal would refuse to compare across devices)
    if copy is not None:
        return not torch.equal(now, copy)
    return now is not tensor or now.data_ptr() != pointer or (
        version is not None and not now.is_inference() and now._version != version)


def snapshot(module: Any, hook: Any, values: bool = True, plain_only: bool = False) -> Dict[str, Any]:
    """What :func:`keep_changes` compares with at the end: each loaded tensor of ``hook``, its storage
    pointer, ``_version`` (None for an inference tensor: it has none), shape, dtype and, with ``values``,
    a copy of a plain tensor's values. ``plain_only``: other tensor classes are left out (bitsandbytes
    repacks its 4-bit weights on a first forward, and the reloaded ones the same way on the next)."""
    taken = {}
    for name, tensor in hook_tensors(module, hook):
        plain = plain_tensor(tensor)
        if tensor.is_meta or (plain_only and not plain):
            continue
        copy = tensor.detach().clone() if values and plain else None
        version = None if tensor.is_inference() else tensor._version
        taken[name] = (tensor, tensor.data_ptr(), version, tensor.shape, tensor.dtype, copy)
    return taken


def keep_changes(module: Any, hook: Any, taken: Dict[str, Any], refused: List[Tuple[Any, str, Any]],
                 tied: List[Tuple[Any, str]], plain_only: bool = False) -> None:
    """The one rule for writes into an onloaded offloaded module, before it is offloaded again: every
    tensor of ``hook`` that changed since ``taken`` (replaced, ``.data`` reassigned, written in place,
    converted, reshaped) is kept for the hook to serve (:func:`keep`); one that cannot be kept goes into
    ``refused`` (a tensor class the store cannot copy) or ``tied`` (a weight tied to another hook's),
    for the caller to raise."""
    for name, tensor in hook_tensors(module, hook):
        if name in taken and not _changed(taken[name], tensor):
            continue
        if plain_only and name not in taken and not tensor.is_meta and not plain_tensor(tensor):
            continue
        if not plain_tensor(tensor):
            refused.append((module, name, tensor))
            continue
        if tensor.is_meta:
            continue  # put back on meta meanwhile: nothing was written that a read could see
        if tied_name(module, hook, name):
            # accelerate serves each tied copy from its own hook: keeping the write here would
            # leave the partner (a tied head, say) with the old value, silently.
            tied.append((module, name))
            continue
        keep(hook, name, tensor)


def refuse(what: str, refused: List[Tuple[Any, str, Any]], tied: List[Tuple[Any, str]],
           error: Any = MetapatchError) -> None:
    """Raise ``error`` for the first write :func:`keep_changes` could not keep (if any)."""
    if tied:
        module, name = tied[0]
        raise error(
            f"metapatch: {what} wrote {type(module).__name__}.{name}, a weight tied to another parameter "
            f"(e.g. an input embedding tied to the output head) in a module accelerate offloads. metapatch "
            f"cannot keep the tied copies in step, so the offloaded model would silently differ from the "
            f"in-memory one. Load the model without offloading that module (device_map), or untie it first.")
    if refused:
        module, name, tensor = refused[0]
        raise error(
            f"metapatch: {what} wrote {type(module).__name__}.{name} (a {type(tensor).__name__}) of a "
            f"module accelerate offloads, and a tensor of that class cannot be kept for the offload hook to "
            f"serve; the offloaded model would silently keep the old value. Keep that module in memory "
            f"(device_map) for this operation, or run it before dispatching the model.")


def settle(module: Any, hook: Any) -> None:
    """``module``'s loaded tensors as they are now count as loaded (no forward wrote them): an operation that
    onloaded it has applied the rule to them (kept, refused, or dropped after upstream raised) and offloads it
    next, through the hook's ``post_forward``."""
    for _, tensor in hook_tensors(module, hook):
        tensor.__dict__.pop(LOADED_VERSION, None)


def refresh_sources(captured: Dict[int, Tuple[Any, Dict[str, Any]]]) -> None:
    """Sources captured from hooks before an operation: what the operation kept (an :class:`Overlay`
    entry) replaces the old source, so a re-dispatch serves the written value."""
    for module, tensors in captured.values():
        hook = offload_hook(module)
        overlay = weights_map_of(hook)
        if isinstance(overlay, Overlay):
            for name, tensor in overlay.kept.items():
                tensors[name] = (tensor, None)
