"""An operation over offloaded modules: what it writes into them is kept in the offload store, or refused.

metapatch's workarounds onload an offloaded module, let upstream run an operation over real tensors (create or
load an adapter, merge it, ...) and offload it again. Upstream sometimes *writes* the base weights in that
operation: PiSSA/OLoRA replace ``base_layer.weight`` by the residual ``W - s·B·A``, a merge adds the delta in
place, a saved embedding layer is loaded into the base. Offloading again would throw every such write away.

Here every such operation is an :class:`Operation`. A module onloaded by it is held
(:mod:`metapatch._offload.holds`) and snapshotted (each tensor's object, storage pointer, ``_version`` and,
where values matter, a copy: writes through ``.data`` do not bump ``_version``); when the operation ends the
store's rule (:func:`metapatch._offload.store.keep_changes`) keeps every change or refuses it.
:meth:`Operation.adopt_materialised` keeps tensors an operation loaded into an offloaded module's placeholders
without onloading it (transformers' loader materialises them on ``cpu``), and :meth:`Operation.watch_loads`
onloads an offloaded module just before ``load_state_dict`` copies into it (a copy into a ``meta`` placeholder
is a no-op)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Dict, Iterator, List, Optional, Tuple

from metapatch._framework.records import MetapatchError
from metapatch._offload.hook_state import offload_hook
from metapatch._offload.holds import held, hold, release
from metapatch._offload.module_walk import modules, submodule
from metapatch._offload.store import hook_tensors, keep, keep_changes, plain_tensor, refuse, settle, snapshot

_CURRENT: "contextvars.ContextVar[Optional[Operation]]" = contextvars.ContextVar("metapatch_offload_operation",
                                                                              default=None)


def current() -> Optional["Operation"]:
    """The innermost store operation running in this context, if any (an entry point that found the
    model offloaded opened it: what runs inside may hide the model's device map meanwhile)."""
    return _CURRENT.get()


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
            settle(module, hook)  # the rule is applied: the hook's offload keeps nothing more of it
            release(module, hook)
        refuse(self.what, refused, tied)


    def adopt_materialised(self, model: Any) -> int:
        """Tensors an operation put into an offloaded module's ``meta`` placeholders without onloading it
        (a loader that materialises them): kept for the hook to serve, placeholders back on meta."""
        from accelerate.utils import set_module_tensor_to_device

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
