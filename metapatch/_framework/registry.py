"""Lifecycle and (un)installation of patch records; knows nothing about any particular patch.

The registry registers a post-import hook per target module (:mod:`metapatch._framework.import_hooks`), so a
patch applies whether metapatch is imported before or after its target; gates it on installed
versions (:mod:`metapatch._framework.gate`, lazily); refuses code whose source no longer matches the patch's
fingerprints (``stale``) or that another library replaced (``conflict``) (:mod:`metapatch._framework.planning`);
never lets a patch's exception escape into the user's import (``failed``) unless
``METAPATCH_STRICT=1`` asks for it; and marks every object it installs, so that a second registry
adopts what is there instead of wrapping twice and ``unpatch`` finds every site (:mod:`metapatch._framework.sites`;
aliases and re-exports of what it swapped: :mod:`metapatch._framework.reexports`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .gate import Gate, Gating, disabled_ids, strict_mode  # noqa: F401 - re-exported
from .patch_loading import LazyPatches, lazy_patches, load_patches  # noqa: F401 - re-exported
from .records import MetapatchError, Patch, State
from .reexports import Reexports
from .sites import PatchStatus, Planned, Retry, Site
from .targets import MARKER, fingerprint, initializing, raw_attribute, replaced_by, resolve  # noqa: F401 - re-exported

# ast, inspect, hashlib, logging and importlib.metadata are imported where used: `import metapatch`
# runs at the top of user scripts and must cost next to nothing.


def _logger() -> Any:
    import logging

    return logging.getLogger("metapatch")


class Registry:
    def __init__(self, patches: Iterable[Patch], support_window: Optional[Dict[str, str]] = None):
        """``patches``: records, or a :class:`LazyPatches` (records loaded when first needed)."""
        self.patches: Mapping = patches if isinstance(patches, LazyPatches) else {}
        for patch in () if isinstance(patches, LazyPatches) else patches:
            if patch.id in self.patches:
                raise ValueError(f"two patches share the id {patch.id!r}")
            self.patches[patch.id] = patch
        self._status: Dict[str, PatchStatus] = {}
        # Guards _status and the swaps. Never held while importing, calling a patch's factory or
        # emitting a warning: the import system's deadlock detection cannot see this lock, so a
        # thread holding it must never wait for an import lock.
        self._lock = threading.RLock()
        # watched module -> the ids of the patches with a target there, as their hooks were registered
        self._ids_by_module: Dict[str, Dict[str, None]] = {}
        self._gating = Gating(support_window)
        # aliases and re-export sites of what was swapped, so that install() after unpatch() covers them again
        self._reexports = Reexports()

    # -- gating --------------------------------------------------------------------------------

    def _version(self, dist: str) -> Optional[str]:
        return self._gating.version(dist)

    @property
    def _versions(self) -> Dict[str, Optional[str]]:  # installed versions read so far (tests set them)
        return self._gating._versions

    def gate(self, patch: Patch) -> Gate:
        """Whether ``patch`` is to be applied on this install, and why (the version gate alone:
        nothing is imported or patched). Public: the CLI, the reports and the tests ask it."""
        return self._gating.gate(patch)

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
        imported = []
        for patch_id in self._select_ids(ids):
            lifted: List[str] = []
            with self._lock:
                current = self._status.get(patch_id)
                if all_off or patch_id in off:
                    if current is not None and current.sites:
                        lifted = self._take_off(current)
                    self._status[patch_id] = PatchStatus(State.DISABLED, "METAPATCH_DISABLE=" + (
                        "all" if all_off else patch_id))
                elif current is None or current.state is State.DISABLED or current.lost_sites():
                    keep = current.sites if current is not None else {}
                    self._status[patch_id] = PatchStatus(State.PENDING_IMPORT, "", sites={
                        k: s for k, s in keep.items() if s.holds_installed()})
            self._put_back(lifted)
            if all_off or patch_id in off:
                continue
            modules = self._modules_of(patch_id)
            for module_name in modules:
                self._hook(module_name, patch_id)
            if any(self._imported(m) is not None for m in modules):
                imported.append(patch_id)
        if not imported:
            return  # `import metapatch` before its targets (the usual order): nothing to plan yet
        from .planning import stack_order

        # Patches of one target are applied inner first (Patch.wraps_over); a module still executing
        # gets its patches when it finishes.
        for patch_id in stack_order(self.patches, imported):
            for module_name in self._modules_of(patch_id):
                module = self._imported(module_name)
                if module is not None:
                    self._apply(self.patches[patch_id], module, late=True)

    @staticmethod
    def _imported(module_name: str) -> Any:
        module = sys.modules.get(module_name)
        return None if module is None or initializing(module) else module

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

    def _hook(self, module_name: str, patch_id: str) -> None:
        # Watched even when already imported: a later re-import (after the module was removed
        # from sys.modules) executes new objects that must be patched too.
        with self._lock:
            ids = self._ids_by_module.get(module_name)
            if ids is not None:
                ids[patch_id] = None
                return
            self._ids_by_module[module_name] = {patch_id: None}
        from .import_hooks import finder

        finder().watch(module_name, self._on_import)

    def _on_import(self, module: Any, late: bool = False) -> None:
        # Runs inside the user's import statement: nothing may escape except, on purpose, the
        # strict-mode error. late: the module was loaded by a finder ahead of ours (see sweep_missed).
        with self._lock:
            ids = list(self._ids_by_module.get(getattr(module, "__name__", ""), ()))
        try:
            from .planning import stack_order

            ids = stack_order(self.patches, ids)  # (loads the records: they are applied now anyway)
        except Exception as exc:  # pragma: no cover - a record that cannot load: _apply reports it
            _logger().exception("metapatch: cannot order the patches of %s: %s", module.__name__, exc)
        for patch_id in ids:
            try:
                if late:
                    self._apply_missed(patch_id, module, "the next import through metapatch's finder")
                else:
                    self._apply(self.patches[patch_id], module)  # (loads a lazy record)
            except MetapatchError:
                raise
            except Exception as exc:  # pragma: no cover - _apply already guards; belt and braces
                _logger().exception("metapatch: unexpected error while applying %s: %s", patch_id, exc)

    def sweep_missed(self, when: str) -> None:
        """Apply, late, the patches of target modules that are imported (and finished) but whose import hook
        never ran: a finder inserted ahead of ours on ``sys.meta_path`` after ``import metapatch``
        (typeguard's and jaxtyping's import hooks) answered them itself before ours got back in front.
        Cheap unless something was missed: only pending patches, only modules in ``sys.modules``."""
        for patch_id in list(self._status):
            status = self._status.get(patch_id)
            if status is None or status.state is not State.PENDING_IMPORT:
                continue
            for module_name in self._modules_of(patch_id):
                module = self._imported(module_name)
                if module is not None:
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
            from .import_hooks import finder

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
            self._hook(module_name, patch.id)
        lifted = self._lift_for(patch, module)
        if lifted:  # patches that wrap over this one were there first: rebuild the stack in order
            from .planning import stack_order

            for patch_id in stack_order(self.patches, [patch.id, *lifted]):
                if patch_id == patch.id:
                    self._apply_here(patch, module, late)
                else:
                    self._put_back([patch_id])
            return
        self._apply_here(patch, module, late)

    def _apply_here(self, patch: Patch, module: Any, late: bool) -> None:
        from .planning import plan

        messages: List[Tuple[Any, str]] = []  # (key, message): warned once the lock is released
        problem: Optional[MetapatchError] = None
        became_applied = False
        for _attempt in range(5):
            with self._lock:
                status = self._status.get(patch.id)
                if status is None or status.state not in (State.PENDING_IMPORT, State.APPLIED):
                    return
                gate = status.gate
                was_applied = status.state is State.APPLIED
            if gate is None:
                gate = self.gate(patch)
            try:
                swaps, trouble = plan(patch, module, status, gate)
                with self._lock:
                    problem = self._commit(patch, status, gate, swaps, trouble, late, messages)
                    became_applied = not was_applied and status.state is State.APPLIED
                break
            except Retry:  # another thread changed the target or the status meanwhile: again
                continue
        skip = {m.partition(".")[0] for m in patch.modules}  # frames of the patched library are not the user's
        for key, message in messages:
            self._warn_once(key, message, skip)
        # a module still executing (metapatch's import hook applies patches then) holds no object made unpatched
        finished = not getattr(getattr(module, "__spec__", None), "_initializing", False)
        if became_applied and finished and patch.adopt_existing is not None:
            try:
                patch.adopt_existing(module)
            except Exception as exc:  # noqa: BLE001 - the patch is in place; what it adopts late is its own
                _logger().exception("metapatch: %s: adopting what existed before it applied failed: %s", patch.id, exc)
        if problem is not None:
            raise problem

    def _commit(self, patch: Patch, status: PatchStatus, gate: Gate, plan: List[Planned],
                trouble: Optional[Tuple[State, str]], late: bool, messages: List[Tuple[Any, str]]
                ) -> Optional[MetapatchError]:
        """The swaps, under the lock; returns the strict-mode error to raise once unlocked."""
        if self._status.get(patch.id) is not status or status.state not in (State.PENDING_IMPORT, State.APPLIED):
            raise Retry()  # unpatched, disabled or re-installed meanwhile: decide on the current status
        status.gate = status.gate or gate
        if not status.gate.affected:
            status.state, status.reason = status.gate.state, status.gate.why
            return None
        if trouble is not None:
            self._restore(status)
            return self._set_problem(patch, status, trouble[0], trouble[1], messages)
        for step in plan:
            now = raw_attribute(step.parent, step.attr)
            if now is not (step.installed if step.adopt else step.original):
                marker = getattr(now, MARKER, None)
                if marker is not None and marker[0] == patch.id:
                    step = Planned(step.target, step.parent, step.attr, marker[2], now, adopt=True)
                else:
                    raise Retry()
            if not step.adopt:
                setattr(step.parent, step.attr, step.installed)
            status.sites[step.target.dotted] = Site(step.parent, step.attr, step.original, step.installed)
            if not isinstance(step.parent, type):
                self._reexports.cover(step.target, step.original, step.installed, status, late, messages)
        waiting = [m for m in patch.modules
                   if not all(status.sites.get(t.dotted) is not None for t in patch.targets if t.module == m)]
        if waiting:
            status.state = State.PENDING_IMPORT
            status.reason = f"{status.gate.why}; waiting for import of {', '.join(waiting)}"
        else:
            status.state, status.reason = State.APPLIED, status.gate.why
        return None

    # -- stacks: two patches of one target ---------------------------------------------------------

    def _lift_for(self, patch: Patch, module: Any) -> List[str]:
        """When a patch that declares it wraps over ``patch`` already holds one of ``patch``'s targets
        in ``module``, take every metapatch patch there off (outermost first) and return their ids, so
        that the stack is rebuilt in order. Otherwise nothing changes: []. Reads the targets and the
        records unlocked (either may import), lifts under the lock."""
        from .planning import stacked_at

        stacked = [other for other in stacked_at(patch, module) if other in self.patches]
        if not any(patch.id in self.patches[other].wraps_over for other in stacked):
            return []
        with self._lock:
            lifted = [other for other in stacked if other in self._status]
            for other in lifted:
                self._lift(other)
        return lifted

    def _lift(self, patch_id: str) -> None:
        status = self._status[patch_id]
        self._restore(status)
        status.state, status.reason = State.PENDING_IMPORT, ""

    def _take_off(self, status: PatchStatus) -> List[str]:
        """Under the lock: restore ``status``'s sites. Patches stacked over one of them are taken off
        first (outermost first) and their ids returned, for :meth:`_put_back` once unlocked: a
        wrapper left inside another patch's would keep running after unpatch()."""
        above: List[str] = []
        for site in status.sites.values():
            for patch_id in site.stacked_above() or ():
                if patch_id in self._status and patch_id not in above:
                    above.append(patch_id)
        for patch_id in above:
            self._lift(patch_id)
        self._restore(status)
        return above

    def _put_back(self, lifted: List[str]) -> None:
        if not lifted:
            return
        from .planning import stack_order

        for patch_id in stack_order(self.patches, lifted):
            for module_name in self.patches[patch_id].modules:
                module = self._imported(module_name)
                if module is not None:
                    self._apply_here(self.patches[patch_id], module, late=False)

    # -- problems ------------------------------------------------------------------------------

    def _set_problem(self, patch: Patch, status: PatchStatus, state: State, reason: str,
                     messages: List[Tuple[Any, str]]) -> Optional[MetapatchError]:
        status.state, status.reason = state, reason
        message = f"metapatch: patch {patch.id!r} is {state}: {reason}. The program continues without it."
        if strict_mode():
            return MetapatchError(message.replace("The program continues without it.",
                                                  "METAPATCH_STRICT=1 makes this an error."))
        messages.append(((patch.id, state), message))
        return None

    def _warn_once(self, key: Any, message: str, skip: Iterable[str] = ()) -> None:
        from .warn import warn_once

        warn_once((id(self), key), message, skip=skip)

    # -- unpatch -------------------------------------------------------------------------------

    def _restore(self, status: PatchStatus) -> None:
        replaced = {}
        for dotted, site in status.sites.items():
            if site.holds_installed():
                setattr(site.parent, site.attr, site.original)
            replaced[id(site.installed)] = (site.installed, site.original, dotted)
        # Re-export sites: declared aliases and any module that imported the replacement by name
        # after it was installed (``from accelerate import dispatch_model`` in peft, say).
        self._reexports.restore(replaced)
        status.sites.clear()

    def unpatch(self, ids: Optional[Iterable[str]] = None) -> None:
        """Put back the exact original objects, everywhere the replacements went. A patch stacked
        over one of them on the same target is taken off and put back over the original."""
        for patch in self._select(ids):
            with self._lock:
                status = self._status.get(patch.id)
                if status is None:
                    status = self._status[patch.id] = PatchStatus(State.DISABLED, "")
                lifted = self._take_off(status)
                self._reexports.unpatched(patch.targets)
                status.state, status.reason = State.DISABLED, "unpatched by metapatch.unpatch(); metapatch.install() re-applies"
            self._put_back(lifted)

    # -- status --------------------------------------------------------------------------------

    def status(self) -> List[Dict[str, Any]]:
        """One row per patch (:mod:`metapatch._framework.status_rows`), after applying what a finder ahead
        of ours kept from our hooks; the version gate decided (unlocked) for patches never imported."""
        from .status_rows import row

        try:
            self.sweep_missed("metapatch.status()")
        except MetapatchError:
            pass  # strict mode: the problem state and reason are in the rows
        return [row(patch, *self.reported(patch)) for patch in self.patches.values()]

    def reported(self, patch: Patch) -> Tuple[State, str, Dict[str, Optional[str]], List[str]]:
        """(state, reason, installed versions, notes) of ``patch`` as ``status()`` reports it."""
        from .status_rows import reported_state

        with self._lock:
            known = self._status.get(patch.id)
            need_gate = known is None or known.gate is None
        gate = self.gate(patch) if need_gate else None  # unlocked: reads metadata, may import
        with self._lock:
            status = self._status.get(patch.id) or PatchStatus(State.PENDING_IMPORT, "metapatch.install() not run")
            if status.state is State.PENDING_IMPORT and patch.id in self._status:
                status.gate = status.gate or gate
                if not status.gate.affected:
                    status.state, status.reason = status.gate.state, status.gate.why
                elif not status.reason:
                    status.reason = f"{status.gate.why}; waiting for import of {', '.join(patch.modules)}"
            return reported_state(patch, status, gate)

    def recorded(self) -> Dict[str, PatchStatus]:
        """What the registry holds per patch id it has seen (the live records, for tools that look at sites)."""
        with self._lock:
            return dict(self._status)


def shared_registry() -> Registry:
    """The registry of this process, the one ``import metapatch`` installs (``metapatch.registry``). Kept
    here, not in the package, so that ``importlib.reload(metapatch)`` re-uses it instead of building a
    second registry that would have to adopt the first one's wrappers; the tools below the package
    (``metapatch.diagnose``) ask for it here rather than importing ``metapatch`` back."""
    global REGISTRY  # never assigned at module level: a reload of this module keeps the registry
    if globals().get("REGISTRY") is None:
        # Patch modules load when one of their targets is imported: see metapatch.patches.INDEX.
        REGISTRY = Registry(lazy_patches())
    return REGISTRY
