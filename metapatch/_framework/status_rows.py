"""``metapatch.status()``: what a row says about one patch. The registry decides the recorded state under
its lock (:meth:`metapatch._framework.registry.Registry.reported`); here, with no lock and no registry,
the state as a user should read it (a target still executing, a site lost to a reload or to another
library) and the row itself."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

from . import layout
from .gate import Gate
from .records import Patch, State
from .sites import PatchStatus, replaced_after
from .targets import initializing


def reported_state(patch: Patch, status: PatchStatus, gate: Optional[Gate]
                   ) -> Tuple[State, str, Dict[str, Optional[str]], List[str]]:
    """(state, reason, installed versions, notes) of ``status`` as ``status()`` shows it; ``gate``: the
    gate decided for this call when the status holds none. Reads the status only (the caller holds the lock)."""
    state, reason = status.state, status.reason
    running = [m for m in patch.modules if initializing(sys.modules.get(m))]
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
    return state, reason, versions, list(status.notes)


def row(patch: Patch, state: State, reason: str, versions: Dict[str, Optional[str]], notes: List[str]
        ) -> Dict[str, Any]:
    return {
        "id": patch.id,
        "title": patch.title,
        "state": str(state),
        "reason": reason,
        "installed": versions,
        "affects": dict(patch.affects),
        "fixed_in": dict(patch.upstream.fixed_in),
        "upstream": patch.upstream.link,
        "forwarded": patch.upstream.forwarded,
        "diffs": list(layout.diffs(patch)),
        "targets": [t.dotted for t in patch.targets],
        "notes": notes,
    }
