"""``metapatch.status()``: one row per patch, read from the registry's records under its lock, the
version gate decided (unlocked) for patches whose target was never imported."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Dict, List

from .records import MetapatchError, State
from .sites import PatchStatus, replaced_after
from .targets import _initializing

if TYPE_CHECKING:  # pragma: no cover
    from .registry import Registry


def status_rows(registry: "Registry") -> List[Dict[str, Any]]:
    try:
        registry._sweep_missed("metapatch.status()")
    except MetapatchError:
        pass  # strict mode: the problem state and reason are in the rows below
    rows = []
    for patch in registry.patches.values():
        with registry._lock:
            known = registry._status.get(patch.id)
            need_gate = known is None or known.gate is None
        gate = registry.gate(patch) if need_gate else None  # unlocked: reads metadata, may import
        with registry._lock:
            status = registry._status.get(patch.id) or PatchStatus(State.PENDING_IMPORT, "metapatch.install() not run")
            if status.state is State.PENDING_IMPORT and patch.id in registry._status:
                status.gate = status.gate or gate
                if not status.gate.affected:
                    status.state, status.reason = status.gate.state, status.gate.why
                elif not status.reason:
                    status.reason = f"{status.gate.why}; waiting for import of {', '.join(patch.modules)}"
            state, reason = status.state, status.reason
            running = [m for m in patch.modules if _initializing(sys.modules.get(m))]
            if state is State.PENDING_IMPORT and running:
                reason = f"{reason}; {', '.join(running)} still executing (patched as soon as it finishes)"
            if status.lost_sites():
                replaced = replaced_after(status)
                if replaced is not None:
                    state, reason = State.CONFLICT, replaced
                else:
                    state = State.PENDING_IMPORT
                    reason = "target module was re-executed (reload?) after patching; metapatch.install() re-applies"
            versions = (status.gate or gate).versions
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
