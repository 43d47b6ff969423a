"""Version gating, lifecycle and (un)installation of patch records.

This module knows nothing about any particular patch. It is handed :class:`Patch` records and

* registers a wrapt post-import hook per target module, so a patch applies whether metapatch is
  imported before or after its target;
* gates each patch on installed distribution versions (lazily: ``importlib.metadata`` is only
  read once a target module is imported or ``status()`` is asked for);
* refuses to patch code whose source no longer matches the fingerprints the patch was written
  against (``stale``), and never lets an exception from a patch escape into the user's import
  (``failed``) unless ``METAPATCH_STRICT=1`` asks for exactly that;
* marks every object it installs, so a second registry (``importlib.reload(metapatch)``, or
  metapatch re-imported after ``sys.modules`` was cleared) adopts what is there instead of
  wrapping twice, and ``unpatch`` can find every site that holds a replacement.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ._records import MetapatchError, MetapatchWarning, Patch, State, Target

# ast, inspect, hashlib, logging and importlib.metadata are imported where used: `import metapatch`
# runs at the top of user scripts and must cost next to nothing.


def _logger() -> Any:
    import logging

    return logging.getLogger("metapatch")

# The attribute that marks an installed object: (patch id, target dotted path, original object).
# The "_self_" prefix keeps wrapt proxies from forwarding the attribute to the wrapped function.
MARKER = "_self_metapatch"

_TRUE = {"1", "true", "yes", "on"}


def strict_mode() -> bool:
    return os.environ.get("METAPATCH_STRICT", "").strip().lower() in _TRUE


def disabled_ids() -> Tuple[bool, frozenset]:
    """(all disabled?, explicitly disabled ids) from METAPATCH_DISABLE."""
    raw = os.environ.get("METAPATCH_DISABLE", "")
    ids = frozenset(part.strip() for part in raw.split(",") if part.strip())
    return ("all" in ids or "*" in ids), ids - {"all", "*"}


# ---------------------------------------------------------------------------------------------
# Source fingerprints


def _source_object(obj: Any) -> Any:
    """The plain function behind descriptors and wrappers, whose source we can read."""
    for _ in range(10):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif hasattr(obj, "__wrapped__") and getattr(obj, MARKER, None) is not None:
            obj = obj.__wrapped__
        else:
            return obj
    return obj


def fingerprint(obj: Any) -> str:
    """A short hash of an object's source code that ignores formatting, comments and docstrings,
    so upstream reformatting does not make a patch stale but any change to the logic does."""
    import ast
    import hashlib
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(_source_object(obj))))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    canonical = ast.dump(tree, annotate_fields=False, include_attributes=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def resolve(module: Any, qualname: str) -> Tuple[Any, str, Any]:
    """(parent object, attribute name, raw object as stored on the parent).

    For class attributes the raw object comes from the class ``__dict__`` (so a staticmethod is
    restored as the very same staticmethod), and it must be defined on that class itself:
    patching an inherited method through a subclass would change the wrong class."""
    *parents, attr = qualname.split(".")
    parent = module
    for name in parents:
        parent = getattr(parent, name)
    if isinstance(parent, type):
        if attr not in vars(parent):
            raise AttributeError(f"{parent.__qualname__} defines no attribute {attr!r} itself")
        return parent, attr, vars(parent)[attr]
    return parent, attr, getattr(parent, attr)


# ---------------------------------------------------------------------------------------------
# Runtime records


class _Site:
    __slots__ = ("parent", "attr", "original", "installed")

    def __init__(self, parent: Any, attr: str, original: Any, installed: Any) -> None:
        self.parent, self.attr, self.original, self.installed = parent, attr, original, installed

    def holds_installed(self) -> bool:
        current = vars(self.parent).get(self.attr) if isinstance(self.parent, type) \
            else getattr(self.parent, self.attr, None)
        return current is self.installed


class _Status:
    __slots__ = ("state", "reason", "sites", "notes", "gate")

    def __init__(self, state: State, reason: str, sites: Optional[Dict[str, _Site]] = None) -> None:
        self.state = state
        self.reason = reason
        self.sites: Dict[str, _Site] = dict(sites or {})  # target.dotted -> site
        self.notes: List[str] = []
        self.gate: Optional[Tuple[bool, str, Dict[str, Optional[str]]]] = None  # (affected, why, versions)


class _NotApplicable(Exception):
    """The target is not what the patch was written for (stale)."""


class Registry:
    def __init__(self, patches: Iterable[Patch]):
        self.patches: Dict[str, Patch] = {}
        for patch in patches:
            if patch.id in self.patches:
                raise ValueError(f"two patches share the id {patch.id!r}")
            self.patches[patch.id] = patch
        self._status: Dict[str, _Status] = {}
        self._lock = threading.RLock()
        self._hooked: set = set()
        self._warned: set = set()
        self._versions: Dict[str, Optional[str]] = {}

    # -- gating --------------------------------------------------------------------------------

    def _version(self, dist: str) -> Optional[str]:
        import importlib.metadata

        if dist not in self._versions:
            try:
                self._versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                self._versions[dist] = None
        return self._versions[dist]

    def _gate(self, patch: Patch) -> Tuple[bool, str, Dict[str, Optional[str]]]:
        from packaging.specifiers import SpecifierSet  # only once a decision is needed
        from packaging.version import InvalidVersion, Version

        versions = {dist: self._version(dist) for dist in patch.affects}
        for dist, spec in patch.affects.items():
            installed = versions[dist]
            if installed is None:
                return False, f"{dist} is not installed", versions
            try:
                inside = SpecifierSet(spec).contains(Version(installed), prereleases=True)
            except InvalidVersion:
                return False, f"{dist} {installed} is not a PEP 440 version", versions
            if not inside:
                fixed = patch.upstream.fixed_in.get(dist)
                why = f"{dist} {installed} is outside {spec}"
                return False, why + (f" (fixed upstream in {fixed})" if fixed else ""), versions
        ranges = ", ".join(f"{d} {versions[d]} in {s}" for d, s in patch.affects.items())
        return True, ranges, versions

    # -- install -------------------------------------------------------------------------------

    def install(self, ids: Optional[Iterable[str]] = None) -> None:
        """Register hooks for every enabled patch and apply those whose targets are imported.

        Idempotent: a patch already in place is left alone, one that was unpatched or whose
        target module was re-executed (reload) is applied again."""
        all_off, off = disabled_ids()
        unknown = off - set(self.patches)
        if unknown:
            self._warn_once(("disable", tuple(sorted(unknown))),
                            f"METAPATCH_DISABLE names unknown patch id(s) {', '.join(sorted(unknown))}; "
                            f"known ids: {', '.join(self.patches)}")
        chosen = self._select(ids)
        for patch in chosen:
            with self._lock:
                current = self._status.get(patch.id)
                if all_off or patch.id in off:
                    if current is not None and current.sites:
                        self._restore(patch, current)
                    self._status[patch.id] = _Status(State.DISABLED, "METAPATCH_DISABLE=" + (
                        "all" if all_off else patch.id))
                    continue
                if current is None or current.state is State.DISABLED or self._lost_sites(current):
                    keep = current.sites if current is not None else {}
                    self._status[patch.id] = _Status(State.PENDING_IMPORT, "", sites={
                        k: s for k, s in keep.items() if s.holds_installed()})
            for module_name in patch.modules:
                self._hook(module_name)
            for module_name in patch.modules:
                module = sys.modules.get(module_name)
                if module is not None:
                    self._apply(patch, module, late=True)

    def _select(self, ids: Optional[Iterable[str]]) -> List[Patch]:
        if ids is None:
            return list(self.patches.values())
        if isinstance(ids, str):
            ids = [ids]
        missing = [i for i in ids if i not in self.patches]
        if missing:
            raise ValueError(f"unknown metapatch patch id(s) {missing}; known: {list(self.patches)}")
        return [self.patches[i] for i in ids]

    def _hook(self, module_name: str) -> None:
        with self._lock:
            # An already-imported module is patched by install() itself, which also looks for
            # modules that captured the original by name; wrapt would fire the hook at once.
            if module_name in self._hooked or module_name in sys.modules:
                return
            self._hooked.add(module_name)
        import wrapt  # noqa: deferred so that reading records never needs it

        wrapt.register_post_import_hook(self._on_import, module_name)

    def _on_import(self, module: Any) -> None:
        # Runs inside the user's import statement: nothing may escape except, on purpose, the
        # strict-mode error.
        name = getattr(module, "__name__", "")
        for patch in list(self.patches.values()):
            if name in patch.modules:
                try:
                    self._apply(patch, module)
                except MetapatchError:
                    raise
                except Exception as exc:  # pragma: no cover - _apply already guards; belt and braces
                    _logger().exception("metapatch: unexpected error while applying %s: %s", patch.id, exc)

    def _apply(self, patch: Patch, module: Any, late: bool = False) -> None:
        with self._lock:
            status = self._status.get(patch.id)
            if status is None or status.state not in (State.PENDING_IMPORT, State.APPLIED):
                return
            affected, why, versions = status.gate or self._gate(patch)
            status.gate = (affected, why, versions)
            if not affected:
                status.state, status.reason = State.NOT_AFFECTED, why
                return
            try:
                for target in patch.targets:
                    if target.module != module.__name__:
                        continue
                    site = status.sites.get(target.dotted)
                    if site is not None and site.holds_installed():
                        continue
                    status.sites[target.dotted] = self._install_target(patch, target, module, status, late)
            except _NotApplicable as exc:
                self._restore(patch, status)
                self._set_problem(patch, status, State.STALE, str(exc))
                return
            except Exception as exc:
                self._restore(patch, status)
                self._set_problem(patch, status, State.FAILED, f"{type(exc).__name__}: {exc}")
                return
            waiting = [m for m in patch.modules
                       if not all(status.sites.get(t.dotted) is not None for t in patch.targets if t.module == m)]
            if waiting:
                status.state = State.PENDING_IMPORT
                status.reason = f"{why}; waiting for import of {', '.join(waiting)}"
            else:
                status.state, status.reason = State.APPLIED, why

    def _install_target(self, patch: Patch, target: Target, module: Any, status: _Status, late: bool) -> _Site:
        try:
            parent, attr, current = resolve(module, target.qualname)
        except AttributeError as exc:
            raise _NotApplicable(f"{target.dotted} not found ({exc})") from None
        marker = getattr(current, MARKER, None)
        if marker is not None and marker[0] == patch.id:
            # Installed by an earlier registry (metapatch reloaded): adopt it, never wrap twice.
            return _Site(parent, attr, marker[2], current)
        try:
            found = fingerprint(current)
        except (OSError, TypeError, SyntaxError) as exc:
            raise _NotApplicable(f"cannot read the source of {target.dotted}: {exc}") from None
        if found not in target.fingerprints:
            raise _NotApplicable(
                f"{target.dotted} changed upstream (source fingerprint {found}, patch written for "
                f"{', '.join(target.fingerprints)}); skipped rather than patched blindly")
        if target.wrapper is not None:
            import wrapt

            installed = wrapt.FunctionWrapper(current, target.wrapper)
        else:
            installed = target.replacement(current)
        setattr(installed, MARKER, (patch.id, target.dotted, current))
        setattr(parent, attr, installed)
        if not isinstance(parent, type):
            self._cover_aliases(target, current, installed, status, late)
        return _Site(parent, attr, current, installed)

    def _cover_aliases(self, target: Target, original: Any, installed: Any, status: _Status, late: bool) -> None:
        for alias in target.aliases:
            module_name, _, attr = alias.partition(":")
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attr, None) is original:
                setattr(module, attr, installed)
        if not late:
            return  # patched as its module finished executing: nobody can have captured it yet
        # Any other module that captured the original by name before we got here keeps calling
        # the unpatched function: we do not rewrite other people's namespaces, we say so.
        holders = sorted(name for name, mod in list(sys.modules.items())
                         if mod is not None and any(v is original for v in _namespace(mod).values()))
        if holders:
            note = (f"{target.dotted} was imported by name before metapatch into {', '.join(holders)}; "
                    "calls through those names bypass the patch (import metapatch first)")
            status.notes.append(note)
            _logger().warning("metapatch: %s", note)

    # -- problems ------------------------------------------------------------------------------

    def _set_problem(self, patch: Patch, status: _Status, state: State, reason: str) -> None:
        status.state, status.reason = state, reason
        message = f"metapatch: patch {patch.id!r} is {state}: {reason}. The program continues without it."
        if strict_mode():
            raise MetapatchError(message.replace("The program continues without it.",
                                                 "METAPATCH_STRICT=1 makes this an error."))
        self._warn_once((patch.id, state), message)

    def _warn_once(self, key: Any, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        _logger().warning(message)
        warnings.warn(message, MetapatchWarning, stacklevel=3)

    # -- unpatch -------------------------------------------------------------------------------

    def _lost_sites(self, status: _Status) -> bool:
        return status.state is State.APPLIED and not all(s.holds_installed() for s in status.sites.values())

    def _restore(self, patch: Patch, status: _Status) -> None:
        replaced = {}
        for site in status.sites.values():
            if site.holds_installed():
                setattr(site.parent, site.attr, site.original)
            replaced[id(site.installed)] = (site.installed, site.original)
        # Re-export sites: declared aliases and any module that imported the replacement by name
        # after it was installed (``from accelerate import dispatch_model`` in peft, say).
        if replaced:
            for mod in list(sys.modules.values()):
                namespace = _namespace(mod)
                for name, value in list(namespace.items()):
                    hit = replaced.get(id(value))
                    if hit is not None and hit[0] is value:
                        setattr(mod, name, hit[1])
        status.sites.clear()

    def unpatch(self, ids: Optional[Iterable[str]] = None) -> None:
        """Put back the exact original objects, everywhere the replacements went."""
        for patch in self._select(ids):
            with self._lock:
                status = self._status.get(patch.id)
                if status is None:
                    status = self._status[patch.id] = _Status(State.DISABLED, "")
                self._restore(patch, status)
                status.state, status.reason = State.DISABLED, "unpatched by metapatch.unpatch(); metapatch.install() re-applies"

    # -- status --------------------------------------------------------------------------------

    def status(self) -> List[Dict[str, Any]]:
        rows = []
        for patch in self.patches.values():
            with self._lock:
                status = self._status.get(patch.id) or _Status(State.PENDING_IMPORT, "metapatch.install() not run")
                if status.state is State.PENDING_IMPORT and patch.id in self._status:
                    status.gate = status.gate or self._gate(patch)
                    if not status.gate[0]:
                        status.state, status.reason = State.NOT_AFFECTED, status.gate[1]
                    elif not status.reason:
                        status.reason = f"{status.gate[1]}; waiting for import of {', '.join(patch.modules)}"
                state, reason = status.state, status.reason
                if self._lost_sites(status):
                    state = State.PENDING_IMPORT
                    reason = "target module was re-executed (reload?) after patching; metapatch.install() re-applies"
                versions = status.gate[2] if status.gate else {d: self._version(d) for d in patch.affects}
            rows.append({
                "id": patch.id,
                "title": patch.title,
                "state": str(state),
                "reason": reason,
                "installed": versions,
                "affects": dict(patch.affects),
                "fixed_in": dict(patch.upstream.fixed_in),
                "upstream": patch.upstream.link,
                "forwarded": patch.upstream.forwarded,
                "diffs": list(patch.diffs),
                "targets": [t.dotted for t in patch.targets],
                "notes": list(status.notes),
            })
        return rows


def _namespace(module: Any) -> Dict[str, Any]:
    try:
        namespace = vars(module)
    except TypeError:
        return {}
    return namespace if isinstance(namespace, dict) else {}


def load_patches(package: str = "metapatch.patches") -> List[Patch]:
    """Every ``PATCH`` record in the modules of ``package``, in file-name order."""
    import importlib

    pkg = importlib.import_module(package)
    names = sorted({entry[:-3] for folder in pkg.__path__ for entry in os.listdir(folder)
                    if entry.endswith(".py") and not entry.startswith("_")})
    records = []
    for name in names:
        module = importlib.import_module(f"{package}.{name}")
        patch = getattr(module, "PATCH", None)
        if isinstance(patch, Patch):
            records.append(patch)
    return records
