"""Version gating, lifecycle and (un)installation of patch records.

This module knows nothing about any particular patch. It is handed :class:`Patch` records and

* registers a post-import hook per target module (:mod:`metapatch._import_hooks`, a meta-path
  finder that never imports nor waits on a lock while the import system holds its own), so a
  patch applies whether metapatch is imported before or after its target;
* gates each patch on installed distribution versions (lazily: ``importlib.metadata`` is only
  read once a target module is imported or ``status()`` is asked for);
* refuses to patch code whose source no longer matches the fingerprints the patch was written
  against (``stale``) or that another library already replaced (``conflict``), reports versions
  outside the declared support window as ``not-measured`` instead of guessing, and never lets an
  exception from a patch escape into the user's import (``failed``) unless ``METAPATCH_STRICT=1``
  asks for exactly that;
* marks every object it installs, so a second registry (``importlib.reload(metapatch)``, or
  metapatch re-imported after ``sys.modules`` was cleared) adopts what is there instead of
  wrapping twice, and ``unpatch`` can find every site that holds a replacement.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from ._patch_loading import LazyPatches, _patch_module_names, lazy_patches, load_patches  # noqa: F401 - re-exported
from ._records import MetapatchError, Patch, State, Target
from ._targets import (MARKER, _code_owner, _initializing, _package, _raw, _source_object,  # noqa: F401
                       fingerprint, replaced_by, resolve)

# ast, inspect, hashlib, logging and importlib.metadata are imported where used: `import metapatch`
# runs at the top of user scripts and must cost next to nothing.


def _logger() -> Any:
    import logging

    return logging.getLogger("metapatch")

_TRUE = {"1", "true", "yes", "on"}


def strict_mode() -> bool:
    return os.environ.get("METAPATCH_STRICT", "").strip().lower() in _TRUE


def disabled_ids() -> Tuple[bool, frozenset]:
    """(all disabled?, explicitly disabled ids) from METAPATCH_DISABLE."""
    raw = os.environ.get("METAPATCH_DISABLE", "")
    ids = frozenset(part.strip() for part in raw.split(",") if part.strip())
    return ("all" in ids or "*" in ids), ids - {"all", "*"}


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
        # (verdict, why, versions), verdict None when affected: see Registry._verdict
        self.gate: Optional[Tuple[Optional[State], str, Dict[str, Optional[str]]]] = None


class _Planned:
    """One target of a patch, prepared outside the registry lock."""

    __slots__ = ("target", "parent", "attr", "original", "installed", "adopt")

    def __init__(self, target: Target, parent: Any, attr: str, original: Any, installed: Any, adopt: bool) -> None:
        self.target, self.parent, self.attr = target, parent, attr
        self.original, self.installed, self.adopt = original, installed, adopt


class _Retry(Exception):
    """A target changed between planning and committing (another thread): plan again."""


class Gate(NamedTuple):
    """The version gate's answer for one patch on this install."""

    affected: bool  # apply it
    why: str  # the ranges that matched, or why not
    versions: Dict[str, Optional[str]]  # installed version per distribution in ``affects``
    state: Optional["State"]  # None when affected, else NOT_AFFECTED or NOT_MEASURED


class Registry:
    def __init__(self, patches: Iterable[Patch], support_window: Optional[Dict[str, str]] = None):
        """``patches``: records, or a :class:`LazyPatches` (records loaded when first needed)."""
        self.patches: Mapping = patches if isinstance(patches, LazyPatches) else {}
        for patch in () if isinstance(patches, LazyPatches) else patches:
            if patch.id in self.patches:
                raise ValueError(f"two patches share the id {patch.id!r}")
            self.patches[patch.id] = patch
        self._status: Dict[str, _Status] = {}
        # Guards _status and the swaps. Never held while importing, calling a patch's factory or
        # emitting a warning: the import system's deadlock detection cannot see this lock, so a
        # thread holding it must never wait for an import lock (issue 12).
        self._lock = threading.RLock()
        self._hooked: set = set()
        self._versions: Dict[str, Optional[str]] = {}
        self._window = support_window  # None: metapatch.tested_versions.SUPPORT_WINDOW, read lazily
        # target.dotted -> {(module name, attribute)}: re-export sites that held the replacement
        # when it was restored, so that install() after unpatch() covers them again.
        self._reexports: Dict[str, Dict[Tuple[str, str], None]] = {}
        self._unpatched: set = set()

    # -- gating --------------------------------------------------------------------------------

    def _version(self, dist: str) -> Optional[str]:
        import importlib.metadata

        if dist not in self._versions:
            try:
                self._versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                self._versions[dist] = None
        return self._versions[dist]

    def _support_window(self) -> Dict[str, str]:
        if self._window is None:
            from . import tested_versions

            self._window = dict(getattr(tested_versions, "SUPPORT_WINDOW", {}))
        return self._window

    def gate(self, patch: Patch) -> "Gate":
        """Whether ``patch`` is to be applied on this install, and why (the version gate alone:
        nothing is imported or patched). Public: the CLI, the reports and the tests ask it."""
        verdict, why, versions = self._verdict(patch)
        return Gate(verdict is None, why, versions, verdict)

    def _verdict(self, patch: Patch) -> Tuple[Optional[State], str, Dict[str, Optional[str]]]:
        """(verdict, why, versions): verdict None means affected (patch it), otherwise the state
        to report: ``not-affected`` (missing, or measured outside the affected range) or
        ``not-measured`` (a version outside the declared support window)."""
        from packaging.specifiers import SpecifierSet  # only once a decision is needed
        from packaging.version import InvalidVersion, Version

        versions = {dist: self._version(dist) for dist in patch.affects}
        parsed = {}
        for dist in patch.affects:
            installed = versions[dist]
            if installed is None:
                return State.NOT_AFFECTED, f"{dist} is not installed", versions
            try:
                parsed[dist] = Version(installed)
            except InvalidVersion:
                return State.NOT_AFFECTED, f"{dist} {installed} is not a PEP 440 version", versions
        window = self._support_window()
        for dist in patch.affects:
            measured, fixed = window.get(dist), patch.upstream.fixed_in.get(dist)
            if not measured or SpecifierSet(measured).contains(parsed[dist], prereleases=True):
                continue
            if fixed and parsed[dist] >= Version(fixed):
                continue  # fixed upstream: outside the window, but not the bug's range either
            return State.NOT_MEASURED, (
                f"not measured for {dist} {versions[dist]} (support window {dist}{measured}); nothing patched; "
                f"run `metapatch selftest` to see whether the bug exists on this install"), versions
        for dist, spec in patch.affects.items():
            if not SpecifierSet(spec).contains(parsed[dist], prereleases=True):
                fixed = patch.upstream.fixed_in.get(dist)
                why = f"{dist} {versions[dist]} is outside {spec}"
                return State.NOT_AFFECTED, why + (f" (fixed upstream in {fixed})" if fixed else ""), versions
        ranges = ", ".join(f"{d} {versions[d]} in {s}" for d, s in patch.affects.items())
        return None, ranges, versions

    # -- install -------------------------------------------------------------------------------

    def install(self, ids: Optional[Iterable[str]] = None) -> None:
        """Register hooks for every enabled patch and apply those whose targets are imported.

        Idempotent: a patch already in place is left alone, one that was unpatched or whose
        target module was re-executed (reload) is applied again, at every site it held before."""
        all_off, off = disabled_ids()
        unknown = off - set(self.patches)
        if unknown:
            self._warn_once(("disable", tuple(sorted(unknown))),
                            f"METAPATCH_DISABLE names unknown patch id(s) {', '.join(sorted(unknown))}; "
                            f"known ids: {', '.join(self.patches)}")
        # By id: with LazyPatches, a patch module is imported only once one of its targets is.
        for patch_id in self._select_ids(ids):
            with self._lock:
                current = self._status.get(patch_id)
                if all_off or patch_id in off:
                    if current is not None and current.sites:
                        self._restore(current)
                    self._status[patch_id] = _Status(State.DISABLED, "METAPATCH_DISABLE=" + (
                        "all" if all_off else patch_id))
                    continue
                if current is None or current.state is State.DISABLED or self._lost_sites(current):
                    keep = current.sites if current is not None else {}
                    self._status[patch_id] = _Status(State.PENDING_IMPORT, "", sites={
                        k: s for k, s in keep.items() if s.holds_installed()})
            modules = self._modules_of(patch_id)
            for module_name in modules:
                self._hook(module_name)
            for module_name in modules:
                module = sys.modules.get(module_name)
                if module is not None and not _initializing(module):
                    # (A module still executing gets its hook when it finishes.)
                    self._apply(self.patches[patch_id], module, late=True)

    def _select(self, ids: Optional[Iterable[str]]) -> List[Patch]:
        return [self.patches[i] for i in self._select_ids(ids)]

    def _select_ids(self, ids: Optional[Iterable[str]]) -> List[str]:
        if ids is None:
            return list(self.patches)
        if isinstance(ids, str):
            ids = [ids]
        ids = list(ids)
        missing = [i for i in ids if i not in self.patches]
        if missing:
            raise ValueError(f"unknown metapatch patch id(s) {missing}; known: {list(self.patches)}")
        return ids

    def _modules_of(self, patch_id: str) -> Tuple[str, ...]:
        modules_of = getattr(self.patches, "modules_of", None)
        return modules_of(patch_id) if modules_of is not None else self.patches[patch_id].modules

    def _hook(self, module_name: str) -> None:
        # Watched even when already imported: a later re-import (after the module was removed
        # from sys.modules) executes new objects that must be patched too.
        with self._lock:
            if module_name in self._hooked:
                return
            self._hooked.add(module_name)
        from ._import_hooks import finder

        finder().watch(module_name, self._on_import)

    def _on_import(self, module: Any, late: bool = False) -> None:
        # Runs inside the user's import statement: nothing may escape except, on purpose, the
        # strict-mode error. late: the module was loaded by a finder ahead of ours (see _sweep_missed).
        name = getattr(module, "__name__", "")
        for patch_id in list(self.patches):
            if name in self._modules_of(patch_id):
                try:
                    if late:
                        self._apply_missed(patch_id, module, "the next import through metapatch's finder")
                    else:
                        self._apply(self.patches[patch_id], module)  # (loads a lazy record)
                except MetapatchError:
                    raise
                except Exception as exc:  # pragma: no cover - _apply already guards; belt and braces
                    _logger().exception("metapatch: unexpected error while applying %s: %s", patch_id, exc)

    def _sweep_missed(self, when: str) -> None:
        """Apply, late, the patches of target modules that are imported (and finished) but whose import hook
        never ran: a finder inserted ahead of ours on ``sys.meta_path`` after ``import metapatch``
        (typeguard's and jaxtyping's import hooks) answered them itself before ours got back in front.
        Cheap unless something was missed: only pending patches, only modules in ``sys.modules``."""
        for patch_id in list(self._status):
            status = self._status.get(patch_id)
            if status is None or status.state is not State.PENDING_IMPORT:
                continue
            for module_name in self._modules_of(patch_id):
                module = sys.modules.get(module_name)
                if module is not None and not _initializing(module):
                    self._apply_missed(patch_id, module, when)

    def _apply_missed(self, patch_id: str, module: Any, when: str) -> None:
        status = self._status.get(patch_id)
        if status is None or status.state is not State.PENDING_IMPORT:
            return
        patch = self.patches[patch_id]
        mine = [t.dotted for t in patch.targets if t.module == module.__name__]
        if all(status.sites.get(d) is not None for d in mine):
            return
        self._apply(patch, module, late=True)
        said = f"{module.__name__} was imported through a finder ahead of metapatch's"
        if any(status.sites.get(d) is not None for d in mine) and not any(n.startswith(said) for n in status.notes):
            from ._import_hooks import finder

            loader = getattr(getattr(module, "__spec__", None), "loader", None)
            ahead = ", ".join(getattr(finder(), "moved_ahead_of", ())) or "none found"
            status.notes.append(
                f"{said} on sys.meta_path (its loader: "
                f"{type(loader).__module__}.{type(loader).__qualname__}; finders found ahead: {ahead}), so its "
                f"import hook did not run; patched late, when {when} found it imported")

    def _apply(self, patch: Patch, module: Any, late: bool = False) -> None:
        """Apply the targets of ``patch`` that live in ``module``.

        In three steps so that no lock of ours is held while something may import: read the
        status (locked), gate and prepare every replacement (unlocked: version metadata, source
        fingerprints, the patch's own factories), swap and record (locked), then warn (unlocked)."""
        for module_name in patch.modules:  # no-op unless the index missed one of the record's modules
            self._hook(module_name)
        messages: List[Tuple[Any, str]] = []  # (key, message): warned once the lock is released
        problem: Optional[MetapatchError] = None
        for _attempt in range(5):
            with self._lock:
                status = self._status.get(patch.id)
                if status is None or status.state not in (State.PENDING_IMPORT, State.APPLIED):
                    return
                gate = status.gate
            if gate is None:
                gate = self._verdict(patch)
            try:
                plan, trouble = self._plan(patch, module, status, gate)
                with self._lock:
                    problem = self._commit(patch, module, status, gate, plan, trouble, late, messages)
                break
            except _Retry:  # another thread changed the target or the status meanwhile: again
                continue
        skip = {m.partition(".")[0] for m in patch.modules}  # frames of the patched library are not the user's
        for key, message in messages:
            self._warn_once(key, message, skip)
        if problem is not None:
            raise problem

    def _plan(self, patch: Patch, module: Any, status: _Status, gate: Tuple[Optional[State], str, Any]
              ) -> Tuple[List[_Planned], Optional[Tuple[State, str]]]:
        """Everything that may import or run patch code, without the lock. Returns the planned
        swaps and, if a target cannot be patched, (state, reason) for the whole patch."""
        plan: List[_Planned] = []
        if gate[0] is not None:
            return plan, None
        for target in patch.targets:
            if target.module != module.__name__:
                continue
            owner = replaced_by(module, target)
            if owner is not None:
                return plan, (State.CONFLICT, _conflict_reason(target, owner))
            try:
                parent, attr, current = resolve(module, target.qualname)
            except AttributeError as exc:
                return plan, (State.STALE, f"{target.dotted} not found ({exc})")
            site = status.sites.get(target.dotted)
            if site is not None and site.parent is parent and site.holds_installed():
                continue
            marker = getattr(current, MARKER, None)
            if marker is not None and marker[0] == patch.id:
                # Installed by an earlier registry (metapatch reloaded): adopt it, never wrap twice.
                plan.append(_Planned(target, parent, attr, marker[2], current, adopt=True))
                continue
            owner = replaced_by(module, target, current)
            if owner is not None:
                return plan, (State.CONFLICT, _conflict_reason(target, owner))
            try:
                found = fingerprint(current)
            except (OSError, TypeError, SyntaxError) as exc:
                return plan, (State.STALE, f"cannot read the source of {target.dotted}: {exc}")
            if found not in target.fingerprints:
                return plan, (State.STALE,
                              f"{target.dotted} changed upstream (source fingerprint {found}, patch written for "
                              f"{', '.join(target.fingerprints)}); skipped rather than patched blindly")
            try:
                if target.wrapper is not None:
                    import wrapt

                    installed = wrapt.FunctionWrapper(current, target.wrapper)
                else:
                    installed = target.replacement(current)
                setattr(installed, MARKER, (patch.id, target.dotted, current))
            except Exception as exc:
                return plan, (State.FAILED, f"{type(exc).__name__}: {exc}")
            plan.append(_Planned(target, parent, attr, current, installed, adopt=False))
        return plan, None

    def _commit(self, patch: Patch, module: Any, status: _Status, gate: Tuple[Optional[State], str, Any],
                plan: List[_Planned], trouble: Optional[Tuple[State, str]], late: bool,
                messages: List[Tuple[Any, str]]) -> Optional[MetapatchError]:
        """The swaps, under the lock; returns the strict-mode error to raise once unlocked."""
        if self._status.get(patch.id) is not status or status.state not in (State.PENDING_IMPORT, State.APPLIED):
            raise _Retry()  # unpatched, disabled or re-installed meanwhile: decide on the current status
        status.gate = status.gate or gate
        verdict, why, _ = status.gate
        if verdict is not None:
            status.state, status.reason = verdict, why
            return None
        if trouble is not None:
            self._restore(status)
            return self._set_problem(patch, status, trouble[0], trouble[1], messages)
        for step in plan:
            now = _raw(step.parent, step.attr)
            if now is not (step.installed if step.adopt else step.original):
                marker = getattr(now, MARKER, None)
                if marker is not None and marker[0] == patch.id:
                    step = _Planned(step.target, step.parent, step.attr, marker[2], now, adopt=True)
                else:
                    raise _Retry()
            if not step.adopt:
                setattr(step.parent, step.attr, step.installed)
            status.sites[step.target.dotted] = _Site(step.parent, step.attr, step.original, step.installed)
            if not isinstance(step.parent, type):
                self._cover_aliases(step.target, step.original, step.installed, status, late, messages)
        waiting = [m for m in patch.modules
                   if not all(status.sites.get(t.dotted) is not None for t in patch.targets if t.module == m)]
        if waiting:
            status.state = State.PENDING_IMPORT
            status.reason = f"{why}; waiting for import of {', '.join(waiting)}"
        else:
            status.state, status.reason = State.APPLIED, why
        return None

    def _cover_aliases(self, target: Target, original: Any, installed: Any, status: _Status, late: bool,
                       messages: List[Tuple[Any, str]]) -> None:
        for alias in target.aliases:
            module_name, _, attr = alias.partition(":")
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attr, None) is original:
                setattr(module, attr, installed)
        # Every site that held the replacement when it was last restored (unpatch) holds it again.
        for module_name, attr in self._reexports.get(target.dotted, {}):
            module = sys.modules.get(module_name)
            if module is not None and _namespace(module).get(attr) is original:
                setattr(module, attr, installed)
        if not late:
            return  # patched as its module finished executing: nobody can have captured it yet
        # Any other module that captured the original by name before we got here keeps calling
        # the unpatched function: we do not rewrite other people's namespaces, we say so.
        holders = sorted(name for name, mod in list(sys.modules.items())
                         if mod is not None and any(v is original for v in _namespace(mod).values()))
        if holders:
            when = ("before metapatch was imported, or while it was unpatched"
                    if target.dotted in self._unpatched else "before metapatch was imported")
            note = (f"{target.dotted} was imported by name into {', '.join(holders)} {when}; "
                    "calls through those names bypass the patch (import metapatch first)")
            status.notes.append(note)
            messages.append((("bypass", target.dotted, tuple(holders)), "metapatch: " + note))

    # -- problems ------------------------------------------------------------------------------

    def _set_problem(self, patch: Patch, status: _Status, state: State, reason: str,
                     messages: List[Tuple[Any, str]]) -> Optional[MetapatchError]:
        status.state, status.reason = state, reason
        message = f"metapatch: patch {patch.id!r} is {state}: {reason}. The program continues without it."
        if strict_mode():
            return MetapatchError(message.replace("The program continues without it.",
                                                  "METAPATCH_STRICT=1 makes this an error."))
        messages.append(((patch.id, state), message))
        return None

    def _warn_once(self, key: Any, message: str, skip: Iterable[str] = ()) -> None:
        from ._warn import warn_once

        warn_once((id(self), key), message, skip=skip)

    # -- unpatch -------------------------------------------------------------------------------

    def _lost_sites(self, status: _Status) -> bool:
        return status.state is State.APPLIED and not all(
            s.holds_installed() or _stacked_on(s) for s in status.sites.values())

    def _restore(self, status: _Status) -> None:
        replaced = {}
        for dotted, site in status.sites.items():
            if site.holds_installed():
                setattr(site.parent, site.attr, site.original)
            replaced[id(site.installed)] = (site.installed, site.original, dotted)
        # Re-export sites: declared aliases and any module that imported the replacement by name
        # after it was installed (``from accelerate import dispatch_model`` in peft, say). They are
        # remembered, so that install() puts the replacement back at each of them.
        if replaced:
            for name, mod in list(sys.modules.items()):
                namespace = _namespace(mod)
                for attr, value in list(namespace.items()):
                    hit = replaced.get(id(value))
                    if hit is not None and hit[0] is value:
                        setattr(mod, attr, hit[1])
                        self._reexports.setdefault(hit[2], {})[(name, attr)] = None
        status.sites.clear()

    def unpatch(self, ids: Optional[Iterable[str]] = None) -> None:
        """Put back the exact original objects, everywhere the replacements went."""
        for patch in self._select(ids):
            with self._lock:
                status = self._status.get(patch.id)
                if status is None:
                    status = self._status[patch.id] = _Status(State.DISABLED, "")
                self._restore(status)
                self._unpatched.update(t.dotted for t in patch.targets)
                status.state, status.reason = State.DISABLED, "unpatched by metapatch.unpatch(); metapatch.install() re-applies"

    # -- status --------------------------------------------------------------------------------

    def status(self) -> List[Dict[str, Any]]:
        try:
            self._sweep_missed("metapatch.status()")
        except MetapatchError:
            pass  # strict mode: the problem state and reason are in the rows below
        rows = []
        for patch in self.patches.values():
            with self._lock:
                known = self._status.get(patch.id)
                need_gate = known is None or known.gate is None
            gate = self._verdict(patch) if need_gate else None  # unlocked: reads metadata, may import
            with self._lock:
                status = self._status.get(patch.id) or _Status(State.PENDING_IMPORT, "metapatch.install() not run")
                if status.state is State.PENDING_IMPORT and patch.id in self._status:
                    status.gate = status.gate or gate
                    if status.gate[0] is not None:
                        status.state, status.reason = status.gate[0], status.gate[1]
                    elif not status.reason:
                        status.reason = f"{status.gate[1]}; waiting for import of {', '.join(patch.modules)}"
                state, reason = status.state, status.reason
                running = [m for m in patch.modules if _initializing(sys.modules.get(m))]
                if state is State.PENDING_IMPORT and running:
                    reason = f"{reason}; {', '.join(running)} still executing (patched as soon as it finishes)"
                if self._lost_sites(status):
                    replaced = _replaced_after(status)
                    if replaced is not None:
                        state, reason = State.CONFLICT, replaced
                    else:
                        state = State.PENDING_IMPORT
                        reason = "target module was re-executed (reload?) after patching; metapatch.install() re-applies"
                gate_now = status.gate or gate
                versions = gate_now[2] if gate_now else {d: self._version(d) for d in patch.affects}
                notes = list(status.notes)
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
                "notes": notes,
            })
        return rows


def _stacked_on(site: "_Site") -> bool:
    """Whether another metapatch patch installed its replacement over this site's (two patches of one
    target, e.g. for different releases' bugs): calls still reach this patch's wrapper, through the
    other's. Followed through the markers each installed object carries (patch id, target, original)."""
    current = vars(site.parent).get(site.attr) if isinstance(site.parent, type) else getattr(site.parent, site.attr, None)
    for _ in range(8):
        marker = getattr(current, MARKER, None)
        if not isinstance(marker, tuple) or len(marker) < 3:
            return False
        current = marker[2]
        if current is site.installed:
            return True
    return False


def _replaced_after(status: _Status) -> Optional[str]:
    """Why a site lost its replacement, when another library (not a reload) put its own there."""
    for dotted, site in status.sites.items():
        if site.holds_installed():
            continue
        now = _raw(site.parent, site.attr)
        owner = _code_owner(_source_object(now))
        if owner is not None and _package(owner) != _package(dotted.partition(":")[0]):
            return (f"{dotted} was replaced by {owner} after metapatch patched it, so calls no longer reach "
                    f"metapatch's fix. Check whether {_package(owner)} fixes this bug too, or disable its "
                    f"patch of this function")
    return None


def _conflict_reason(target: Target, owner: str) -> str:
    return (f"{target.dotted} was already replaced by {owner} (another library patches it); nothing "
            f"patched rather than wrap another library's patch. Check whether {_package(owner)} fixes "
            f"this bug too, or disable its patch of this function")


def _namespace(module: Any) -> Dict[str, Any]:
    try:
        namespace = vars(module)
    except TypeError:
        return {}
    return namespace if isinstance(namespace, dict) else {}
