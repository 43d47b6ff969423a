"""The version gate: whether a patch applies on this install, from installed distribution metadata.

Read lazily (``importlib.metadata`` and ``packaging`` only once a target module is imported or
``status()`` asks): ``import metapatch`` runs at the top of user scripts and must cost next to nothing.
One :class:`Gate` per patch travels from the decision to the status row unchanged.
"""

from __future__ import annotations

import os
from typing import Dict, NamedTuple, Optional, Tuple

from .records import Patch, State

_TRUE = {"1", "true", "yes", "on"}


def strict_mode() -> bool:
    return os.environ.get("METAPATCH_STRICT", "").strip().lower() in _TRUE


def disabled_ids() -> Tuple[bool, frozenset]:
    """(all disabled?, explicitly disabled ids) from METAPATCH_DISABLE."""
    raw = os.environ.get("METAPATCH_DISABLE", "")
    ids = frozenset(part.strip() for part in raw.split(",") if part.strip())
    return ("all" in ids or "*" in ids), ids - {"all", "*"}


class Gate(NamedTuple):
    """The version gate's answer for one patch on this install."""

    affected: bool  # apply it
    why: str  # the ranges that matched, or why not
    versions: Dict[str, Optional[str]]  # installed version per distribution in ``affects``
    state: Optional[State]  # None when affected, else NOT_AFFECTED or NOT_MEASURED


class Gating:
    """Installed versions (read once each) and the support window, judged against a patch's ranges."""

    def __init__(self, support_window: Optional[Dict[str, str]] = None) -> None:
        self._versions: Dict[str, Optional[str]] = {}
        self._window = support_window  # None: metapatch.tested_versions.SUPPORT_WINDOW, read lazily

    def version(self, dist: str) -> Optional[str]:
        import importlib.metadata

        if dist not in self._versions:
            try:
                self._versions[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                self._versions[dist] = None
        return self._versions[dist]

    def support_window(self) -> Dict[str, str]:
        if self._window is None:
            from .. import tested_versions

            self._window = dict(getattr(tested_versions, "SUPPORT_WINDOW", {}))
        return self._window

    def gate(self, patch: Patch) -> Gate:
        """``not-affected`` (missing, or measured outside the affected range), ``not-measured`` (a
        version outside the declared support window), or affected (patch it), with the reason."""
        from packaging.specifiers import SpecifierSet  # only once a decision is needed
        from packaging.version import InvalidVersion, Version

        versions = {dist: self.version(dist) for dist in patch.affects}

        def no(state: State, why: str) -> Gate:
            return Gate(False, why, versions, state)

        parsed = {}
        for dist in patch.affects:
            installed = versions[dist]
            if installed is None:
                return no(State.NOT_AFFECTED, f"{dist} is not installed")
            try:
                parsed[dist] = Version(installed)
            except InvalidVersion:
                return no(State.NOT_AFFECTED, f"{dist} {installed} is not a PEP 440 version")
        window = self.support_window()
        for dist in patch.affects:
            measured, fixed = window.get(dist), patch.upstream.fixed_in.get(dist)
            if not measured or SpecifierSet(measured).contains(parsed[dist], prereleases=True):
                continue
            if fixed and parsed[dist] >= Version(fixed):
                continue  # fixed upstream: outside the window, but not the bug's range either
            return no(State.NOT_MEASURED, (
                f"not measured for {dist} {versions[dist]} (support window {dist}{measured}); nothing patched; "
                f"run `metapatch selftest` to see whether the bug exists on this install"))
        for dist, spec in patch.affects.items():
            if not SpecifierSet(spec).contains(parsed[dist], prereleases=True):
                fixed = patch.upstream.fixed_in.get(dist)
                why = f"{dist} {versions[dist]} is outside {spec}"
                return no(State.NOT_AFFECTED, why + (f" (fixed upstream in {fixed})" if fixed else ""))
        ranges = ", ".join(f"{d} {versions[d]} in {s}" for d, s in patch.affects.items())
        return Gate(True, ranges, versions, None)
