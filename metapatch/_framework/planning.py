"""What applying a patch in one module takes, worked out without the registry's lock: the swaps
(:func:`plan`: resolve, conflict and fingerprint checks, the replacement built), and the order of
patches that replace one target (:func:`stack_order`, :func:`stacked_at`). Nothing here changes a module."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, List, Optional, Tuple

from . import firing
from .copyable_wrapper import function_wrapper
from .gate import Gate
from .records import Patch, State
from .sites import PatchStatus, Planned, conflict_reason
from .targets import MARKER, fingerprint, replaced_by, resolve


def plan(patch: Patch, module: Any, status: PatchStatus, gate: Gate) -> Tuple[List[Planned], Optional[Tuple[State, str]]]:
    """Everything that may import or run patch code, without the lock. Returns the planned
    swaps and, if a target cannot be patched, (state, reason) for the whole patch."""
    plan: List[Planned] = []
    if not gate.affected:
        return plan, None
    for target in patch.targets:
        if target.module != module.__name__:
            continue
        try:
            parent, attr, current = resolve(module, target.qualname)
        except AttributeError as exc:
            owner = replaced_by(module, target)  # a class on the path replaced by one without it
            if owner is not None:
                return plan, (State.CONFLICT, conflict_reason(target, owner))
            return plan, (State.STALE, f"{target.dotted} not found ({exc})")
        owner = replaced_by(module, target, current)
        if owner is not None:
            return plan, (State.CONFLICT, conflict_reason(target, owner))
        site = status.sites.get(target.dotted)
        # In place, itself or under other metapatch patches that wrapped it since (a second patch of one target
        # without a declared order): planning it again would wrap the target twice.
        if site is not None and site.parent is parent and site.stacked_above() is not None:
            continue
        marker = getattr(current, MARKER, None)
        if marker is not None and marker[0] == patch.id:
            # Installed by an earlier registry (metapatch reloaded): adopt it, never wrap twice.
            plan.append(Planned(target, parent, attr, marker[2], current, adopt=True))
            continue
        try:
            found = fingerprint(current)
        except (OSError, TypeError, SyntaxError) as exc:
            return plan, (State.STALE, f"cannot read the source of {target.dotted}: {exc}")
        if found not in target.fingerprints:
            return plan, (State.STALE,
                          f"{target.dotted} changed upstream (source fingerprint {found}, patch written for "
                          f"{', '.join(target.fingerprints)}); skipped rather than patched blindly")
        try:
            counting = firing.enabled()  # METAPATCH_DEBUG=1: each call counted for the report at exit
            if target.wrapper is not None:
                wrapper = (firing.counting_wrapper(patch.id, target.dotted, target.wrapper) if counting
                           else target.wrapper)
                installed = function_wrapper(current, wrapper)
            else:
                installed = target.replacement(current)
                if counting:
                    installed = firing.counted_replacement(patch.id, target.dotted, installed, MARKER)
            setattr(installed, MARKER, (patch.id, target.dotted, current))
        except Exception as exc:
            return plan, (State.FAILED, f"{type(exc).__name__}: {exc}")
        plan.append(Planned(target, parent, attr, current, installed, adopt=False))
    return plan, None


def stack_order(patches: Mapping, ids: Iterable[str]) -> List[str]:
    """``ids`` in application order: each patch after the patches it declares it wraps over
    (``Patch.wraps_over``), otherwise as given. Loads the records of ``ids`` only."""
    ids = list(dict.fromkeys(ids))
    wanted, placed, order = set(ids), set(), []

    def place(patch_id: str) -> None:
        if patch_id in placed:
            return
        placed.add(patch_id)
        for under in patches[patch_id].wraps_over:
            if under in wanted:
                place(under)
        order.append(patch_id)

    for patch_id in ids:
        place(patch_id)
    return order


def stacked_at(patch: Patch, module: Any) -> List[str]:
    """The ids of the metapatch patches whose replacements sit on ``patch``'s targets in ``module``
    (outermost first), down to ``patch``'s own replacement or the original."""
    stacked: List[str] = []
    for target in patch.targets:
        if target.module != module.__name__:
            continue
        try:
            current = resolve(module, target.qualname)[2]
        except AttributeError:
            continue
        for _ in range(8):
            marker = getattr(current, MARKER, None)
            if not isinstance(marker, tuple) or len(marker) < 3 or marker[0] == patch.id:
                break
            stacked.append(marker[0])
            current = marker[2]
    return list(dict.fromkeys(stacked))
