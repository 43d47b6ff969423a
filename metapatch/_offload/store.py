"""The one offload store: what an operation writes into an accelerate-offloaded module is kept, or refused.

accelerate serves an offloaded module's tensors from its hook's ``weights_map`` and puts ``meta``
placeholders back after every forward. metapatch's workarounds onload such a module, let upstream run an
operation over real tensors (create or load an adapter, merge it, ...) and offload it again. Upstream
sometimes *writes* the base weights in that operation: PiSSA/OLoRA replace ``base_layer.weight`` by the
residual ``W - s·B·A``, a merge adds the delta in place, a saved embedding layer is loaded into the
base. Offloading again throws every such write away, because the hook serves ``weights_map``: the model
silently computes with the old weights.

Here every such operation goes through :class:`Operation`. A module onloaded by it is snapshotted (each
tensor's object, storage pointer, ``_version`` and, where values matter, a copy: writes through
``.data`` do not bump ``_version``), and when the operation ends every tensor that changed (replaced,
``.data`` reassigned, written in place, reshaped) is kept: a CPU copy goes into an :class:`Overlay` put in
front of the hook's ``weights_map``, which the hook serves from then on. The user's offload folder and
checkpoint are never written. A change that cannot be kept (a quantized tensor class, a write into a
stand-in that never held the real value) raises :class:`~metapatch._framework.records.MetapatchError` naming the
tensor. :meth:`Operation.adopt_materialised` keeps tensors an operation loaded into an offloaded module's
placeholders without onloading it (transformers' loader materialises them on ``cpu``), and
:meth:`Operation.watch_loads` onloads an offloaded module just before ``load_state_dict`` copies into it
(a copy into a ``meta`` placeholder is a no-op).

The same rule (:func:`snapshot`, :func:`keep_changes`) keeps writes into tensors held loaded for a read
outside their module's forward (:func:`metapatch._offload.offloaded_weights.materialised`), and
:func:`conversion` makes a dtype conversion of the model reach the stored values: the :class:`Overlay`
serves each converted key through the dtypes the in-memory tensor went through.

Which hook offloads a module is read by :mod:`metapatch._offload.hook_state`, for everyone. Nothing here
imports accelerate before a hook exists: a process that never imported ``accelerate.hooks`` has none.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Tuple

from metapatch._framework.records import MetapatchError
from metapatch._offload.hook_state import offload_hook, serve_from, weights_map_of


def hook_tensors(module: Any, hook: Any) -> List[Tuple[str, Any]]:
    """(name, tensor) of what ``hook`` loads and offloads on ``module``, named as its weights map names them."""
    from accelerate.utils import named_module_tensors

    return list(named_module_tensors(module, include_buffers=hook.offload_buffers, recurse=hook.place_submodules,
                                     remove_non_persistent=True))


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
# On a tensor an offload hook loaded into its module (or metapatch stood in for it): never the program's own, so
# a later load that finds it still there (a forward that raised before its post_forward, a re-entered module)
# does not take it for a replacement (replaced_weights.adopt_replacements).
HOOK_LOADED = "_metapatch_hook_loaded"


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
    from metapatch._offload.module_walk import modules

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

    return type(tensor) in (torch.nn.Parameter, torch.Tensor) or getattr(type(tensor), "_metapatch_placeholder", False)


def _changed(before: Tuple[Any, int, Optional[int], Any, Any, Optional[Any]], now: Any) -> bool:
    """Whether ``now`` holds another value than the snapshot ``before``. With a copy the values decide
    (a write through ``.data`` or under ``torch.inference_mode`` bumps no ``_version``; a tensor replaced
    by an equal one is no change); without one (a stand-in, a quantized class), any sign of a write does."""
    import torch

    tensor, pointer, version, shape, dtype, copy = before
    if now.is_meta or now.shape != shape or now.dtype != dtype:
        return True
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
        if name in (getattr(hook, "tied_params_names", None) or ()) or name in module.__dict__.get(TIED_MARK, ()):
            # accelerate serves each tied copy from its own hook: keeping the write here would
            # leave the partner (a tied head, say) with the old value, silently.
            tied.append((module, name))
            continue
        keep(hook, name, tensor)


# -- holding an offloaded module's weights in memory (counted: an operation and a tuner layer's forward nest) --


def held(hook: Any) -> bool:
    return getattr(hook, "_metapatch_held", 0) > 0


def hold(base_layer: Any, hook: Any) -> None:
    """Onload ``base_layer``'s weights and keep them until :func:`release`: its hook's own
    pre/post-forward then only move inputs and outputs (``offload`` is off while held). Nested holds
    are counted."""
    if not held(hook):
        hook.pre_forward(base_layer)
        hook.offload = False
    hook._metapatch_held = getattr(hook, "_metapatch_held", 0) + 1


def release(base_layer: Any, hook: Any) -> None:
    import torch

    hook._metapatch_held -= 1
    if hook._metapatch_held == 0:
        if torch.is_grad_enabled():
            keep_quant_states_for_backward(base_layer)
        hook.offload = True
        hook.post_forward(base_layer, torch.empty(0))


def keep_quant_states_for_backward(base_layer: Any) -> None:
    """bitsandbytes' 4-bit matmul keeps the weight's ``QuantState`` object for its backward, and
    offloading the weight moves that very object to meta in place (``Params4bit.to``): the backward
    then dequantizes garbage (NaN gradients). The parameter about to be offloaded gets its own copy,
    so the one autograd holds keeps its values."""
    import copy

    for module in base_layer.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and getattr(weight, "requires_grad", False) is False:
            weight.quant_state = copy.deepcopy(state)


_CURRENT: "contextvars.ContextVar[Optional[Operation]]" = contextvars.ContextVar("metapatch_offload_operation",
                                                                              default=None)


def current() -> Optional["Operation"]:
    """The innermost store operation running in this context, if any (an entry point that found the
    model offloaded opened it: what runs inside may hide the model's device map meanwhile)."""
    return _CURRENT.get()


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


class Operation:
    """One operation (what: its name, for messages) over offloaded modules. Use as a context manager:
    at its end every module it onloaded is checked, its writes kept, and it is offloaded again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.held: List[Tuple[Any, Any, Dict[str, Any]]] = []
        self._handles: List[Any] = []
        self._watchers: List[Any] = []
        self._watched: List[Any] = []
        self._token: Any = None

    def __enter__(self) -> "Operation":
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        _CURRENT.reset(self._token)
        self._stop_watching()
        self.finish(kept=kind is None)

    def holds(self, module: Any) -> bool:
        return any(onloaded is module for onloaded, _, _ in self.held)

    def onload(self, module: Any, hook: Optional[Any] = None, values: bool = True) -> bool:
        """``module``'s real tensors on its hook's execution device until the operation ends; False
        when it is not offloaded or already onloaded (by this operation or an enclosing hold)."""
        hook = hook if hook is not None else offload_hook(module)
        if hook is None or held(hook) or self.holds(module):
            return False
        hold(module, hook)
        self.held.append((module, hook, snapshot(module, hook, values)))
        return True

    def finish(self, kept: bool = True) -> None:
        """Keep what changed in every onloaded module (``kept``: False after upstream raised: the
        module goes back as it was) and offload it again."""
        onloaded, self.held = self.held, []
        refused, tied = [], []
        for module, hook, taken in reversed(onloaded):
            if kept:
                keep_changes(module, hook, taken, refused, tied)
            release(module, hook)
        refuse(self.what, refused, tied)


    def adopt_materialised(self, model: Any) -> int:
        """Tensors an operation put into an offloaded module's ``meta`` placeholders without onloading it
        (a loader that materialises them): kept for the hook to serve, placeholders back on meta."""
        from accelerate.utils import set_module_tensor_to_device

        from metapatch._offload.module_walk import modules

        adopted = 0
        for module in modules(model):
            hook = offload_hook(module)
            if hook is None or self.holds(module) or held(hook):
                continue
            if not hook.place_submodules and not hook.offload_buffers \
                    and all(t is None or t.is_meta for t in module._parameters.values()):
                continue  # the common case, without building the hook's tensor list
            for name, tensor in hook_tensors(module, hook):
                if tensor.is_meta:
                    continue
                if not plain_tensor(tensor):
                    raise MetapatchError(
                        f"metapatch: {self.what} loaded {type(module).__name__}.{name} (a {type(tensor).__name__}) "
                        f"into a module accelerate offloads; a tensor of that class cannot be kept for the hook to "
                        f"serve. Keep that module in memory (device_map).")
                keep(hook, name, tensor)
                set_module_tensor_to_device(module, name, "meta")
                adopted += 1
        return adopted

    def watch_loads(self, model: Any) -> None:
        """Until the operation ends, an offloaded module of ``model`` is onloaded by it just before a
        ``load_state_dict`` writes one of its tensors (so the copy lands in a real tensor and is kept).
        One pre-hook on ``model`` itself: it sees the keys meant for everything below it, and looks up
        only the modules they name (PEFT renames wrapped layers meanwhile; the keys say where they are)."""
        watcher = _LoadWatcher(self, model)
        self._watchers.append(watcher)
        self._watched.append(model)
        self._handles.append(model._register_load_state_dict_pre_hook(watcher, with_module=True))

    def _stop_watching(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self._watchers:
            return
        copied = any(watcher._copied for watcher in self._watchers)
        for watcher in self._watchers:
            watcher._watching = None
        self._watchers.clear()
        if not copied:  # no module was deep-copied meanwhile: the handles removed every watcher
            self._watched.clear()
            return
        # A module copied meanwhile (PEFT's modules_to_save deep-copies the module, hooks included)
        # carries a watcher too: taken off as well, nothing of the operation stays behind.
        for model in self._watched:
            for module in model.modules():
                hooks = module.__dict__.get("_load_state_dict_pre_hooks") or {}
                for key in [k for k, v in hooks.items() if _is_watcher(v)]:
                    del hooks[key]
        self._watched.clear()


class _LoadWatcher:
    """The ``load_state_dict`` pre-hook of :meth:`Operation.watch_loads`; inert on a copy of its module
    and once its operation ended. (Its attribute names are its own: torch's hook wrapper copies the
    hook's ``__dict__`` onto itself.)"""

    def __init__(self, operation: Operation, owner: Any) -> None:
        self._watching: Optional[Operation] = operation
        self._watched_module = owner
        self._copied = False

    def __deepcopy__(self, memo: Any) -> "_LoadWatcher":
        self._copied = True  # a module holding it was copied: the copy's hooks are taken off too
        return self

    def __call__(self, module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
        operation = self._watching
        if operation is None or module is not self._watched_module:
            return
        paths = {key[len(prefix):].rpartition(".")[0] for key in state_dict if key.startswith(prefix)}
        for path in paths:
            try:
                target = submodule(module, path)
            except AttributeError:
                continue  # upstream reports the unexpected key
            hook = offload_hook(target)
            if hook is not None:
                operation.onload(target, hook)
            elif any(t is not None and t.is_meta for t in target._parameters.values()):
                _onload_owning_block(operation, module, path)


def submodule(root: Any, path: str) -> Any:
    """``root.get_submodule(path)``, read from ``_modules`` (a load names every adapter layer: torch's
    lookup checks each level with ``hasattr``/``getattr``); anything else is left to torch."""
    module = root
    if path:
        for part in path.split("."):
            child = module.__dict__.get("_modules", {}).get(part)
            if child is None:
                return root.get_submodule(path)
            module = child
    return module


def _onload_owning_block(operation: Operation, root: Any, path: str) -> None:
    """A module offloaded as part of a block (``place_submodules``): the nearest ancestor whose hook
    holds its tensors is onloaded."""
    parts = path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = submodule(root, ".".join(parts[:depth]))
        hook = offload_hook(owner)
        if hook is not None:
            if hook.place_submodules:
                operation.onload(owner, hook)
            return


def _is_watcher(entry: Any) -> bool:
    return any(isinstance(getattr(entry, name, None), _LoadWatcher) for name in ("hook", "func", "__wrapped__"))


@contextlib.contextmanager
def operation(what: str) -> Iterator[Operation]:
    with Operation(what) as op:
        yield op


def refresh_sources(captured: Dict[int, Tuple[Any, Dict[str, Any]]]) -> None:
    """Sources captured from hooks before an operation: what the operation kept (an :class:`Overlay`
    entry) replaces the old source, so a re-dispatch serves the written value."""
    for module, tensors in captured.values():
        hook = offload_hook(module)
        overlay = weights_map_of(hook)
        if isinstance(overlay, Overlay):
            for name, tensor in overlay.kept.items():
                tensors[name] = (tensor, None)


@contextlib.contextmanager
def stood_in(base_layer: Any, device: Any, what: str) -> Iterator[None]:
    """Inside the block, the ``meta`` placeholders of ``base_layer`` (offloaded) are replaced by
    uninitialised tensors of the same shape and dtype on ``device``; the offloaded values are never
    read, and the placeholders are put back afterwards. For code that reads only where and what the
    weights are: a stand-in that was replaced or written holds a value computed from no real weight,
    and is refused (nothing could keep it)."""
    import torch

    placeholders = [(sub, store, name, tensor) for sub in base_layer.modules() for store in (sub._parameters, sub._buffers)
                    for name, tensor in store.items() if tensor is not None and tensor.device.type == "meta"]
    stand_ins = []
    for sub, store, name, tensor in placeholders:
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        store[name] = torch.nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else empty
        store[name].__dict__[HOOK_LOADED] = True
        stand_ins.append((store[name], store[name].data_ptr(), store[name]._version))
    try:
        yield
    finally:
        written = [f"{type(sub).__name__}.{name}" for (sub, store, name, _), (stand_in, pointer, version)
                   in zip(placeholders, stand_ins)
                   if store.get(name) is not stand_in or stand_in.data_ptr() != pointer or stand_in._version != version]
        for sub, store, name, tensor in placeholders:
            store[name] = tensor
    if written:
        raise MetapatchError(
            f"metapatch: {what} wrote {written[:4]} of an offloaded base layer that metapatch stood in for "
            f"(it reads no base value, it was assumed); the written value cannot be kept. Please report this; "
            f"meanwhile keep that layer in memory (device_map).")


def innermost_base_layer(layer: Any) -> Any:
    """``layer``'s innermost ``base_layer`` (what PEFT's ``get_base_layer`` returns), found through
    ``_modules`` only: no PEFT code runs for a layer that turns out not to be offloaded."""
    for _ in range(64):
        inner = getattr(layer, "__dict__", {}).get("_modules", {}).get("base_layer")
        if inner is None:
            return layer
        layer = inner
    return layer


def map_offloads(device_map: Dict[str, Any]) -> bool:
    """Whether ``dispatch_model`` offloads part of a model placed by ``device_map``: ``disk`` always,
    ``cpu`` when the main device is an accelerator (the first entry on neither cpu nor disk)."""
    values = [str(value) for value in device_map.values()]
    if "disk" in values:
        return True
    main = next((value for value in values if value not in ("cpu", "disk")), "cpu")
    return "cpu" in values and main not in ("cpu", "mps")
