"""Post-import hooks that can never hang an import.

A meta-path finder that watches a few module names. For a watched name it asks the finders after
it for the real spec and wraps the spec's loader; the wrapper runs the real ``exec_module`` and
then the callbacks, with the module complete and still under the import system's own module lock.

Why not ``wrapt.register_post_import_hook``: the import system calls every finder's
``find_spec`` while holding its global import lock, and wrapt's finder answers by calling
``importlib.util.find_spec``, which re-imports the parent package. When that parent is still
being executed by another thread (which the import system allows after its deadlock detection
breaks a cross-thread import cycle), the call waits for the parent's module lock while holding the
global import lock, and the thread executing the parent waits for the global import lock: a
deadlock the import system cannot see, at 0 % CPU. This finder never imports, never
waits on a lock, and calls the other finders exactly as the import system would.

Rules the callbacks rely on:

* they run after the module executed successfully, on the importing thread, once per execution
  of the module by the import system (first import, or an import after the module was removed
  from ``sys.modules``); not on ``importlib.reload`` (the caller checks reloads itself);
* an exception from a callback propagates into the import (metapatch's strict mode uses that);
* the module's ``__loader__`` and ``__spec__.loader`` are the real loader, before and after.

Import-cheap: only ``sys`` and ``threading``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Optional

Callback = Callable[..., None]  # (module) or, for a module a finder ahead of us loaded, (module, late=True)


class _LoaderProxy:
    """The real loader; everything a subclass does not define is delegated to it."""

    def __init__(self, loader: Any, finder: "PostImportFinder") -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def _put_back_real_loader(self, module: Any) -> None:
        # The import system copied spec.loader (us) into the module; code that reads its own
        # __loader__ (resources, get_source, reload) must see the real one.
        try:
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self._loader
        except (AttributeError, TypeError):
            pass
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = self._loader


class _HookedLoader(_LoaderProxy):
    """The real loader, plus the callbacks after ``exec_module``."""

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: Any) -> None:
        self._put_back_real_loader(module)
        self._loader.exec_module(module)
        self._finder.fire(module)


class _LegacyHookedLoader(_LoaderProxy):
    """For loaders that only implement ``load_module`` (pre-PEP 451); no exec_module attribute, so
    the import system takes its load_module path."""

    def load_module(self, fullname: str) -> Any:
        module = self._loader.load_module(fullname)
        self._put_back_real_loader(module)
        self._finder.fire(module)
        return module


class PostImportFinder:
    """Process-wide; :func:`finder` returns the one installed on ``sys.meta_path``."""

    _metapatch_post_import_finder = True  # found by a re-imported copy of this module

    def __init__(self) -> None:
        # name -> callbacks. Read without a lock: a dict lookup is atomic, and watch() replaces
        # the list instead of mutating it, so a reader never sees a half-updated list.
        self.callbacks: Dict[str, List[Callback]] = {}
        self._local = threading.local()
        self._writer = threading.Lock()  # serialises watch(); never held while importing
        self.moved_ahead_of: List[str] = []  # the finders last found ahead of us (for status())
        self.fired: Dict[Optional[str], int] = {}  # name -> id of the module object last seen through us

    def watch(self, name: str, callback: Callback) -> None:
        with self._writer:
            current = self.callbacks.get(name, [])
            if not any(cb == callback for cb in current):
                self.callbacks[name] = current + [callback]

    def fire(self, module: Any) -> None:
        name = getattr(module, "__name__", None)
        self.fired[name] = id(module)
        for callback in self.callbacks.get(name, ()):
            callback(module)
        if self.moved_ahead_of:
            for missed in self._missed():
                self.fired[missed.__name__] = id(missed)
                for callback in self.callbacks.get(missed.__name__, ()):
                    callback(missed, late=True)

    def _missed(self) -> List[Any]:
        """Watched modules imported (and finished) without our loader: answered by a finder that was ahead of
        us. Dictionary lookups only, never an import: called under the import system's lock too."""
        found = []
        for name in list(self.callbacks):
            module = sys.modules.get(name)
            if module is not None and self.fired.get(name) != id(module) and not getattr(
                    getattr(module, "__spec__", None), "_initializing", False):
                found.append(module)
        return found

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if sys.meta_path and sys.meta_path[0] is not self:
            self._back_to_front()
        if target is not None:
            return None  # importlib.reload() (which passes the module as target)
        if fullname not in self.callbacks and not (self.moved_ahead_of and self._missed()):
            return None  # not watched (else: the next module loaded through us catches up on the missed ones)
        active = self._local.__dict__.setdefault("active", set())
        if fullname in active:
            return None  # a finder after us asked the import system again: let it through
        active.add(fullname)
        try:
            spec = self._real_spec(fullname, path, target)
        finally:
            active.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, _LoaderProxy):
            return spec
        if hasattr(loader, "exec_module"):
            spec.loader = _HookedLoader(loader, self)
        elif hasattr(loader, "load_module"):
            spec.loader = _LegacyHookedLoader(loader, self)
        return spec

    def _back_to_front(self) -> None:
        # A finder inserted ahead of us after `import metapatch` (typeguard's and jaxtyping's import hooks
        # insert theirs at sys.meta_path[0]) would answer a watched module itself, and its callbacks would
        # never run. Back in front we still ask it, in its place, through _real_spec: the same spec and
        # loader as without us, wrapped. Called under the import system's lock, during its walk of
        # sys.meta_path: one slice assignment, and the finders after us keep their indexes, so the walk
        # in progress neither skips nor repeats one. (A module such a finder answered before we got back
        # in front is caught by the registry's sweep for imported-but-unpatched targets.)
        meta_path = sys.meta_path
        try:
            index = meta_path.index(self)
        except ValueError:
            return  # removed on purpose (by the user, or a test): stay out
        meta_path[: index + 1] = [self] + meta_path[:index]
        self.moved_ahead_of = [type(f).__module__ + "." + type(f).__qualname__ for f in meta_path[1: index + 1]]

    def _real_spec(self, fullname: str, path: Any, target: Any) -> Optional[Any]:
        # What importlib._bootstrap._find_spec does with the rest of sys.meta_path; we are called
        # under its global import lock already, so this adds no lock and imports nothing.
        for other in list(sys.meta_path):
            if other is self or getattr(other, "_metapatch_post_import_finder", False):
                continue
            find_spec = getattr(other, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


_install_lock = threading.Lock()


def finder() -> PostImportFinder:
    """The finder on ``sys.meta_path`` (inserted first on the first call)."""
    for existing in sys.meta_path:
        if getattr(existing, "_metapatch_post_import_finder", False):
            return existing
    with _install_lock:  # never held while importing: only list operations inside
        for existing in sys.meta_path:
            if getattr(existing, "_metapatch_post_import_finder", False):
                return existing
        created = PostImportFinder()
        sys.meta_path.insert(0, created)
        return created
