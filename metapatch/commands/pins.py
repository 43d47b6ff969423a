"""metapatch pins"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

HELP = "print requirement lines pinning the versions metapatch was tested with, and pins that can go"

DESCRIPTION = """Prints requirement lines (paste them into requirements.txt or a constraints file)
pinning the installed versions of the stack metapatch is tested with, says which installed
versions are not tested ones, and which pins can be dropped because every metapatch patch for
that package is not-affected at the installed version (the bug is fixed upstream there)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    import metapatch
    from metapatch import tested_versions
    from metapatch.diffs import installed_version

    report = compute(metapatch.registry, tested_versions.MATRIX, installed_version)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def patches_by_distribution(registry: Any) -> Dict[str, List[str]]:
    """Distribution -> ids of the patches that belong to it: it is a key of ``affects`` or the
    package of one of the patch's diffs."""
    from metapatch._framework import layout
    from metapatch.diffs import distribution_of, name_parts

    owners: Dict[str, List[str]] = {}
    for patch in registry.patches.values():
        names = {_canonical(d) for d in patch.affects}
        names |= {_canonical(distribution_of(name_parts(rel)[0])) for rel in layout.diffs(patch)}
        for name in sorted(names):
            owners.setdefault(name, []).append(patch.id)
    return owners


def _states(registry: Any) -> Dict[str, str]:
    """Patch id -> state, where a disabled patch counts by its version gate (disabling a patch
    does not fix the bug it covers)."""
    states = {}
    for row in registry.status():
        state = row["state"]
        if state == "disabled":
            state = "pending-import" if registry.gate(registry.patches[row["id"]]).affected else "not-affected"
        states[row["id"]] = state
    return states


def compute(registry: Any, matrix: Sequence[Mapping[str, str]],
            version_of: Callable[[str], Optional[str]]) -> Dict[str, Any]:
    """Per tested distribution: installed version, tested versions, the pin (or why none), and
    whether the pin can be dropped; plus whether the installed combination is a tested row."""
    distributions: List[str] = []
    for row in matrix:
        distributions += [d for d in row if d not in distributions]
    owners = patches_by_distribution(registry)
    states = _states(registry)
    installed = {d: version_of(d) for d in distributions}
    entries = []
    for dist in distributions:
        tested = sorted({row[dist] for row in matrix if dist in row}, key=_version_key)
        version = installed[dist]
        ids = owners.get(_canonical(dist), [])
        entry = {"distribution": dist, "installed": version, "tested": tested, "patches": ids,
                 "pin": None, "droppable": False, "why": ""}
        if version is None:
            entry["why"] = "not installed"
        elif _public(version) in tested:
            # A public pin matches local builds too (PEP 440): torch==2.13.0 accepts 2.13.0+cpu.
            entry["pin"] = f"{dist}=={_public(version)}"
        else:
            entry["why"] = f"{dist} {version} is not a version metapatch has been tested with"
        if version is not None and ids and all(states.get(i) == "not-affected" for i in ids):
            entry["droppable"] = True
            entry["why"] = (entry["why"] + "; " if entry["why"] else "") + (
                f"every patch for {dist} is not-affected at {version}: {', '.join(ids)}")
        entries.append(entry)
    present = {d: v for d, v in installed.items() if v is not None}
    tested_row = any(all(row.get(d) == _public(v) for d, v in present.items()) for row in matrix) if present else False
    return {"entries": entries, "combination_tested": tested_row,
            "matrix": [dict(row) for row in matrix]}


def _public(version: str) -> str:
    """The version without its local label, normalised (``2.13.0+cpu`` -> ``2.13.0``); an
    unparsable version is kept as it is, and then matches no tested version."""
    from packaging.version import InvalidVersion, Version

    try:
        return str(Version(version).public)
    except InvalidVersion:
        return version


def _version_key(version: str):
    from packaging.version import Version

    return Version(version)


def format_report(report: Dict[str, Any]) -> str:
    out = ["# versions metapatch has been tested with, pinned where installed (metapatch pins)"]
    for entry in report["entries"]:
        tested = ", ".join(entry["tested"])
        if entry["pin"] and not entry["droppable"]:
            out.append(entry["pin"])
        elif entry["installed"] is None:
            out.append(f"# {entry['distribution']}: not installed (tested: {tested})")
        elif not entry["pin"]:
            out.append(f"# {entry['distribution']}=={entry['installed']} is installed; metapatch has been tested "
                       f"with {tested} only")
    droppable = [e for e in report["entries"] if e["droppable"]]
    if droppable:
        out.append("# pins that can be dropped: every metapatch patch for the package is not-affected")
        for entry in droppable:
            line = entry["pin"] or f"{entry['distribution']}=={entry['installed']}"
            out.append(f"# {line}  ({', '.join(entry['patches'])})")
    installed = [e for e in report["entries"] if e["installed"]]
    if installed and not report["combination_tested"]:
        rows = "; ".join(", ".join(f"{d} {v}" for d, v in row.items()) for row in report["matrix"])
        out.append("# note: the installed combination is not a tested one; tested combinations: " + rows)
    return "\n".join(out)
