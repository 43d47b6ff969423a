"""What the registry remembers per patch (its state and the sites its replacements went to), and how it
reads a site back: whether the replacement is still there, stacked under another patch's, or replaced by
another library. No lock and no import here; the registry calls these under its lock."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .gate import Gate
from .records import State, Target
from .targets import MARKER, code_owner, package_of, raw_attribute, source_object


class Site:
    """One place a patch put its replacement: ``parent.attr`` held ``original``, now ``installed``."""

    __slots__ = ("parent", "attr", "original", "installed")

    def __init__(self, parent: Any, attr: str, original: Any, installed: Any) -> None:
        self.parent, self.attr, self.original, self.installed = parent, attr, original, installed

    def current(self) -> Any:
        return raw_attribute(self.parent, self.attr)

    def holds_installed(self) -> bool:
        return self.current() is self.installed

    def stacked_above(self) -> Optional[List[str]]:
        """The ids of the metapatch patches whose replacements sit over this one, outermost first
        ([] when this site holds its own), or None when the replacement is not in the chain at all
        (a reload, another library). Followed through the marker each installed object carries
        (patch id, target, original)."""
        current, above = self.current(), []
        for _ in range(8):
            if current is self.installed:
                return above
            marker = getattr(current, MARKER, None)
            if not isinstance(marker, tuple) or len(marker) < 3:
                return None
            above.append(marker[0])
            current = marker[2]
        return None


class PatchStatus:
    __slots__ = ("state", "reason", "sites", "notes", "gate")

    def __init__(self, state: State, reason: str, sites: Optional[Dict[str, Site]] = None) -> None:
        self.state = state
        self.reason = reason
        self.sites: Dict[str, Site] = dict(sites or {})  # target.dotted -> site
        self.notes: List[str] = []
        self.gate: Optional[Gate] = None  # decided once, when first needed

    def lost_sites(self) -> bool:
        """Applied, but a site no longer leads to its replacement (re-executed module, other library)."""
        return self.state is State.APPLIED and not all(s.stacked_above() is not None for s in self.sites.values())


class Planned:
    """One target of a patch, prepared outside the registry lock."""

    __slots__ = ("target", "parent", "attr", "original", "installed", "adopt")

    def __init__(self, target: Target, parent: Any, attr: str, original: Any, installed: Any, adopt: bool) -> None:
        self.target, self.parent, self.attr = target, parent, attr
        self.original, self.installed, self.adopt = original, installed, adopt


class Retry(Exception):
    """A target changed between planning and committing (another thread): plan again."""


def replaced_after(status: PatchStatus) -> Optional[str]:
    """Why a site lost its replacement, when another library (not a reload) put its own there."""
    for dotted, site in status.sites.items():
        if site.holds_installed():
            continue
        now = site.current()
        owner = code_owner(source_object(now))
        if owner is not None and package_of(owner) != package_of(dotted.partition(":")[0]):
            return (f"{dotted} was replaced by {owner} after metapatch patched it, so calls no longer reach "
                    f"metapatch's fix. Check whether {package_of(owner)} fixes this bug too, or disable its "
                    f"patch of this function")
    return None


def conflict_reason(target: Target, owner: str) -> str:
    return (f"{target.dotted} was already replaced by {owner} (another library patches it); nothing "
            f"patched rather than wrap another library's patch. Check whether {package_of(owner)} fixes "
            f"this bug too, or disable its patch of this function")


def namespace(module: Any) -> Dict[str, Any]:
    try:
        found = vars(module)
    except TypeError:
        return {}
    return found if isinstance(found, dict) else {}
