"""What a report's reproducer must do on the installed stack, from its classification."""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from metapatch.reports import FIXED_BY_METAPATCH, FIXED_UPSTREAM, NOT_META_BUG, OPEN, Report


def _installed(dist: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def patch_affected(patch_id: str) -> Tuple[Optional[bool], str]:
    """(affected?, why) from the patch's record and the installed versions; None when the install
    is outside the support window (not measured)."""
    import metapatch
    from metapatch import State

    _, why, _, verdict = metapatch.registry.gate(metapatch.registry.patches[patch_id])
    if verdict is State.NOT_MEASURED:
        return None, why
    return verdict is None, why


def upstream_affected(report: Report) -> Tuple[bool, str]:
    from packaging.specifiers import SpecifierSet

    ranges = dict(report.affected) or {d: f"<{v}" for d, v in report.fixed_upstream_in.items()}
    versions = {d: _installed(d) for d in ranges}
    inside = all(v is not None and SpecifierSet(spec).contains(v, prereleases=True)
                 for (d, spec), v in zip(ranges.items(), versions.values()))
    return inside, ", ".join(f"{d} {versions[d]} {'in' if inside else 'vs'} {s}" for d, s in ranges.items())


def unpatched_should_fail(report: Report) -> Tuple[Optional[bool], str]:
    if report.status == FIXED_BY_METAPATCH and report.affected:
        return upstream_affected(report)  # the reported symptom's own measured range
    if report.status == FIXED_BY_METAPATCH:
        answers = [patch_affected(p) for p in (report.patch, *report.extra_patches)]
        if any(a is None for a, _ in answers):
            return None, "; ".join(w for _, w in answers)
        return any(a for a, _ in answers), "; ".join(w for _, w in answers)
    if report.status == FIXED_UPSTREAM:
        return upstream_affected(report)
    if report.status in (OPEN, NOT_META_BUG):
        return True, report.status
    raise AssertionError(f"no CPU expectation for status {report.status}")


def matches_signature(report: Report, leg: Dict[str, Any]) -> bool:
    text = f"{leg.get('error_type')}: {leg.get('error')}\n{leg.get('traceback', '')[-3000:]}"
    return any(re.search(pattern, text) for pattern in report.signatures)


def describe(leg: Dict[str, Any]) -> str:
    if leg.get("passed"):
        return f"passed {leg.get('metrics')}"
    return f"failed {leg.get('error_type')}: {str(leg.get('error'))[:400]}"
