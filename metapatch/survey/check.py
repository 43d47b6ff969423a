"""Does a Patch record agree with its survey table? Used by ``metapatch survey ID --check`` and by
tests/test_survey.py; every problem is a sentence that tells the patch author what to change.

For each target distribution inside the support window:
* every fingerprint in the record must occur in some release of the window (else it is dead, or
  from a release outside the window);
* every release inside ``affects`` must have a fingerprint the record accepts, else the patch goes
  ``stale`` there (static rows are checked this far and no further);
* a row measured ``affected`` (the bug reproduced, the forced patch fixed it) must lie inside
  ``affects`` and its fingerprints must be in the record; a row measured ``not-affected`` must lie
  outside ``affects``.
For a distribution read but never installed (torch's read-only window) or outside every window, each
release's fingerprint of each target must be in the record.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .static import ABSENT, MODULE_ABSENT, UNREADABLE
from .table import AFFECTED, NOT_AFFECTED, STATIC, row_status

_SURVEY = "metapatch survey {id} --run"


def _inside(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return SpecifierSet(spec).contains(Version(version), prereleases=True)


def _span(releases: List[str]) -> str:
    return releases[0] if len(releases) == 1 else f"{releases[0]}..{releases[-1]}"


def problems(patch: Any, table: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    for dist, section in sorted(table["distributions"].items()):
        if section.get("window") is None or section.get("read_only"):
            out += _fingerprints_only(patch, dist, section)
            continue
        spec = patch.affects.get(dist)
        fps_by_target = {t.dotted: set(t.fingerprints) for t in patch.targets if t.dotted in section["targets"]}
        for target, accepted in sorted(fps_by_target.items()):
            seen = {row["fingerprints"].get(target) for row in section["rows"]}
            for fp in sorted(accepted - seen):
                out.append(f"{patch.id}: {target} fingerprint {fp} is in the record but in no {dist} release of the "
                           f"window {section['window']}: remove it from the Target (or widen the window and rerun "
                           f"`metapatch survey {patch.id} --static`)")
        for row in section["rows"]:
            out += _row_problems(patch, dist, spec, row, fps_by_target)
    return out


def _row_problems(patch: Any, dist: str, spec: Any, row: Dict[str, Any], fps_by_target: Dict[str, set]) -> List[str]:
    out: List[str] = []
    status = row_status(row)
    inside = [v for v in row["releases"] if spec is not None and _inside(spec, v)]
    where = f"{dist} {_span(row['releases'])} ({row['range']}, variant {row['variant']}, {status})"
    if inside:
        for target, accepted in sorted(fps_by_target.items()):
            fp = row["fingerprints"].get(target)
            if fp in accepted:
                continue
            if status == NOT_AFFECTED:
                continue  # reported below as "outside affects"
            if fp in (ABSENT, MODULE_ABSENT, UNREADABLE):
                out.append(f"{patch.id}: {where}: inside affects {spec!r} but {target} is {fp} there, so the patch "
                           f"goes stale: exclude these releases from affects['{dist}'], or target what exists there")
                continue
            advice = (f"add {fp} to the Target's fingerprints (the survey measured the patch fixing it there)"
                      if status == AFFECTED else
                      f"adapt the patch to this code and add {fp} once `{_SURVEY.format(id=patch.id)}` shows the "
                      f"patched reproducer passing there, or exclude these releases from affects['{dist}']")
            out.append(f"{patch.id}: {where}: inside affects {spec!r} but {target} there has fingerprint {fp}, "
                       f"which the record does not accept, so the patch goes stale: {advice}")
    if status == AFFECTED and len(inside) < len(row["releases"]):
        outside = [v for v in row["releases"] if v not in inside]
        out.append(f"{patch.id}: {where}: the bug was measured there and the patch fixes it, but "
                   f"{', '.join(outside)} lie outside affects[{dist!r}] = {spec!r}: widen the range to include them")
    if status == NOT_AFFECTED and inside:
        out.append(f"{patch.id}: {where}: the survey measured the bug absent there, but {', '.join(inside)} lie "
                   f"inside affects[{dist!r}] = {spec!r}: narrow the range to exclude them")
    return out


def _fingerprints_only(patch: Any, dist: str, section: Dict[str, Any]) -> List[str]:
    """A distribution outside the window (the installed release only) or read but never installed (torch,
    every release of its read-only window): whatever the patch's ranges, its targets there must be accepted."""
    out = []
    for row in section["rows"]:
        for target in patch.targets:
            fp = row["fingerprints"].get(target.dotted)
            if fp is not None and fp not in target.fingerprints:
                out.append(f"{patch.id}: {target.dotted} in {dist} {_span(row['releases'])} has fingerprint {fp}, "
                           f"not in the record: the patch is stale there; adapt it and add {fp}")
    return out


def static_only(table: Dict[str, Any]) -> List[str]:
    """The rows checked for fingerprints only (never run): named, so a passing check says so."""
    return [f"{dist} {row['range']}" for dist, section in sorted(table["distributions"].items())
            for row in section["rows"] if section.get("window") and row_status(row) == STATIC]
