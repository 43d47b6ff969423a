"""Group releases into code variants: consecutive releases (in version order) whose target
fingerprints are identical form one row; rows with the same fingerprints share a variant id, so a
variant that comes back (A, B, A) is recognisable as the same code."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence


def exact_range(releases: Sequence[str], first: str, last: str) -> str:
    """A specifier that selects exactly ``first``..``last`` among ``releases`` (sorted, the
    window's final releases): ``>=first,<next release``, or ``>=first`` when ``last`` is the newest."""
    index = list(releases).index(last)
    after = releases[index + 1] if index + 1 < len(releases) else None
    return f">={first},<{after}" if after else f">={first}"


def group(releases: Sequence[str], fingerprints: Dict[str, Dict[str, str]],
          series: Optional[Dict[str, str]] = None) -> List[dict]:
    """Rows ``{"variant", "releases", "range", "fingerprints"}`` for releases in version order.

    ``fingerprints`` maps release -> {target: fingerprint}. Where a distribution has no target of
    the patch (its version only matters to the bug), ``series`` maps release -> a label (the minor
    series, "5.7") and the rows group by that instead, marked ``"grouped_by": "series"``."""
    rows: List[dict] = []
    ids: Dict[tuple, str] = {}
    for release in releases:
        prints = fingerprints.get(release, {})
        key = tuple(sorted(prints.items())) if not series else (("series", series[release]),)
        if rows and rows[-1]["_key"] == key:
            rows[-1]["releases"].append(release)
            continue
        variant = ids.setdefault(key, f"V{len(ids) + 1}")
        row = {"_key": key, "variant": variant, "releases": [release], "fingerprints": dict(sorted(prints.items()))}
        if series:
            row["grouped_by"] = "series"
        rows.append(row)
    for row in rows:
        row.pop("_key")
        row["range"] = exact_range(releases, row["releases"][0], row["releases"][-1])
    return rows


def minor_series(version: str) -> str:
    from packaging.version import Version

    parsed = Version(version)
    return f"{parsed.major}.{parsed.minor}"


def representative(row: dict) -> str:
    """The release a variant is run on: its newest (the one users are most likely to have)."""
    return row["releases"][-1]
