"""Where a replaced object also lives besides its target: declared aliases, the modules that re-export it, and the
ones that captured the original by name before metapatch got there.

A patch swaps ``module.attr``; other modules may hold the same object under their own names
(``from accelerate import dispatch_model`` in peft). Restoring a patch puts the original back at every such site and
remembers them, so that installing it again covers them again; installing late reports the modules that captured
the original before (their calls bypass the patch: other people's namespaces are not rewritten). Knows no patch.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Tuple

from .records import Target
from .sites import PatchStatus, namespace


class Reexports:
    """The re-export sites of every target a registry swapped, kept across unpatch/install."""

    def __init__(self) -> None:
        # target.dotted -> {(module name, attribute)}: sites that held the replacement when it was restored
        self._sites: Dict[str, Dict[Tuple[str, str], None]] = {}
        self._unpatched: set = set()  # targets unpatch() restored at least once

    def cover(self, target: Target, original: Any, installed: Any, status: PatchStatus, late: bool,
              messages: List[Tuple[Any, str]]) -> None:
        """``installed`` replaces ``original`` at ``target``'s aliases and remembered re-export sites too; where
        installed ``late``, a note (and a warning in ``messages``) names the modules that captured the original."""
        for alias in target.aliases:
            module_name, _, attr = alias.partition(":")
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attr, None) is original:
                setattr(module, attr, installed)
        for module_name, attr in self._sites.get(target.dotted, {}):
            module = sys.modules.get(module_name)
            if module is not None and namespace(module).get(attr) is original:
                setattr(module, attr, installed)
        if not late:
            return  # patched as its module finished executing: nobody can have captured it yet
        holders = sorted(name for name, mod in list(sys.modules.items())
                         if mod is not None and any(v is original for v in namespace(mod).values()))
        if holders:
            when = ("before metapatch was imported, or while it was unpatched"
                    if target.dotted in self._unpatched else "before metapatch was imported")
            note = (f"{target.dotted} was imported by name into {', '.join(holders)} {when}; "
                    "calls through those names bypass the patch (import metapatch first)")
            status.notes.append(note)
            messages.append((("bypass", target.dotted, tuple(holders)), "metapatch: " + note))

    def restore(self, replaced: Dict[int, Tuple[Any, Any, str]]) -> None:
        """Every module attribute holding one of the replacements (``{id: (installed, original, target.dotted)}``)
        gets the original back, and is remembered as a re-export site of its target."""
        if not replaced:
            return
        for name, mod in list(sys.modules.items()):
            for attr, value in list(namespace(mod).items()):
                hit = replaced.get(id(value))
                if hit is not None and hit[0] is value:
                    setattr(mod, attr, hit[1])
                    self._sites.setdefault(hit[2], {})[(name, attr)] = None

    def unpatched(self, targets: Iterable[Target]) -> None:
        self._unpatched.update(t.dotted for t in targets)
