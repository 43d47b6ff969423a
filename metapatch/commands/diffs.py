"""metapatch diffs check"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

HELP = ("check each upstream diff against the installed package: still needed, fixed upstream, or drifted; "
        "--run: and whether, applied, it fixes the patch's scenarios")

DESCRIPTION = """For each upstream diff (upstream_diffs/<patch-id>/<package>.diff, or a series of
pull requests <package>-1-<what>.diff, <package>-2-<what>.diff, ... each checked on top of the
ones before it), against the installed package:
  applies          the bug is present (the patch should be in effect)
  fixed-upstream   the diff applies in reverse: the patch should be not-affected
  drifted          neither: upstream moved the code (the failing hunks are shown)
  not-installed    the package is not installed
Each verdict is compared with the patch's state in `metapatch status`; the exit code is 1 when
any of them disagree (or a diff is missing, has no patch, has no section for its package, or its
DEP-3 header lacks one of Description, Origin, Bug, Forwarded, Applied-Upstream, Last-Update).

--run also checks behaviour, not only text: for each patch whose diffs apply, its scenarios run
with the patch disabled, once on the installed packages and once on a copy with the diffs applied
(a series: all of them, in order); the exit code is 1 when a scenario fails with the diff applied.
Scenarios that are n/a on this stack (a model class missing) are skipped. It takes minutes.

environment:
  METAPATCH_DIFFS_ROOT=DIR   read the diffs from DIR instead of the project's upstream_diffs/
"""

# States in which the registry holds the patch as needed for the installed versions.
_IN_RANGE_STATES = ("applied", "pending-import", "stale", "failed")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    check = actions.add_parser("check", help="check every diff (or those of the given patch ids)",
                               description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("patch_ids", nargs="*", metavar="PATCH_ID")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--import-targets", action="store_true",
                       help="import each patch's target modules first, so a stale patch shows as stale")
    check.add_argument("--run", action="store_true",
                       help="also run each patch's scenarios with its diffs applied to a copy (metapatch's patch off)")
    check.add_argument("--timeout", type=float, default=600, metavar="SECONDS",
                       help="per scenario run, with --run (default 600)")


def run(args: argparse.Namespace) -> int:
    from . import UsageError

    if getattr(args, "action", None) != "check":
        raise UsageError("name the action: metapatch diffs check [PATCH_ID ...] [--json] [--import-targets] [--run]")
    import metapatch

    registry = metapatch.registry
    unknown = [i for i in args.patch_ids if i not in registry.patches]
    if unknown:
        raise UsageError(f"unknown patch id(s) {', '.join(unknown)}; known: {', '.join(registry.patches) or 'none'}")
    if args.import_targets:
        _import_targets(registry)
    from metapatch._framework import layout
    from metapatch.diffs import diffs_root

    listed = [rel for patch in registry.patches.values() for rel in layout.diffs(patch)]
    if listed and not diffs_root().is_dir():
        print(f"metapatch diffs: the upstream diffs are not installed with this copy of metapatch ({diffs_root()} "
              f"does not exist); they ship in the source tree: point METAPATCH_DIFFS_ROOT at its upstream_diffs/")
        return 2
    rows = check_all(registry, args.patch_ids or None)
    consistent = all(r["consistent"] for r in rows)
    ok = consistent and not any(r["header_missing"] for r in rows)
    runs = None
    if args.run:
        from metapatch.commands import diffs_run

        if not args.json:
            print(format_rows(rows), flush=True)
        progress = None if args.json else (lambda line: print(line, flush=True))
        runs = diffs_run.run_all(registry, rows, args.patch_ids, args.timeout, progress)
        ok = ok and not diffs_run.failed(runs)
    if args.json:
        print(json.dumps({"ok": ok, "consistent": consistent, "diffs": rows,
                          **({"runs": runs} if runs is not None else {})}, indent=2))
    elif runs is not None:
        print(diffs_run.format_results(runs))
    else:
        print(format_rows(rows))
    return 0 if ok else 1


def _import_targets(registry: Any) -> None:
    import importlib

    for patch in registry.patches.values():
        for module in patch.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                pass  # the row's state says the distribution is missing


def check_all(registry: Any, patch_ids: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """One row per diff: the diffs each patch lists, plus any diff in the diffs folder that no
    patch lists (an orphan). Each row carries the verdict, the patch's state and whether they agree."""
    from metapatch import diffs as diffs_mod
    from metapatch._framework import layout

    states = {row["id"]: row for row in registry.status()}
    chosen = [registry.patches[i] for i in patch_ids] if patch_ids else list(registry.patches.values())
    rows: List[Dict[str, Any]] = []
    listed = set()
    for patch in chosen:
        parsed, relative_of = [], {}
        for relative in layout.diffs(patch):
            path = diffs_mod.resolve_diff_path(relative)
            listed.add(path.resolve())
            if not path.is_file():
                rows.append(_problem_row(patch.id, relative, states[patch.id]["state"], "missing",
                                         f"{patch.id} lists {relative}, which does not exist"))
                continue
            parsed.append(diffs_mod.parse(path))
            relative_of[id(parsed[-1])] = relative
        for series in diffs_mod.series_of(parsed):
            problem = diffs_mod.series_problem(series)
            if problem:
                rows += [_problem_row(patch.id, relative_of[id(d)], states[patch.id]["state"], "invalid", problem)
                         for d in series]
                continue
            for n, diff in enumerate(series):  # diff N of a series on top of 1..N-1
                row = _row(diffs_mod.check(diff, previous=series[:n]), patch, states[patch.id], registry,
                           relative_of[id(diff)])
                row["series_size"] = len(series)
                rows.append(row)
    for path in diffs_mod.all_diff_paths():
        if path.resolve() in listed:
            continue
        patch = registry.patches.get(path.parent.name)
        if patch_ids and path.parent.name not in patch_ids:
            continue
        relative = f"upstream_diffs/{path.parent.name}/{path.name}"
        why = (f"no patch has the id {path.parent.name!r}" if patch is None
               else f"patch {patch.id} does not list it")
        rows.append(_problem_row(path.parent.name, relative, states.get(path.parent.name, {}).get("state"),
                                 "orphan", f"{relative}: {why}"))
    return rows


def _problem_row(patch_id: str, relative: str, state: Optional[str], verdict: str, message: str) -> Dict[str, Any]:
    from metapatch.diffs import name_parts

    return {"patch_id": patch_id, "diff": relative, "package": name_parts(relative)[0], "distribution": None,
            "installed": None, "verdict": verdict, "detail": message, "files": [], "header_missing": [],
            "patch_state": state, "consistent": False, "message": message}


def _row(result: Any, patch: Any, status_row: Dict[str, Any], registry: Any, relative: str) -> Dict[str, Any]:
    from metapatch.diffs import DEP3_FIELDS

    row = result.to_dict()
    row["diff"] = relative
    row["header_missing"] = [name for name in DEP3_FIELDS if not result.diff.header.get(name)]
    row["patch_state"] = status_row["state"]
    row["base"] = result.diff.header.get("Upstream-Base") or None
    consistent, message = judge(result.verdict, patch, status_row, registry, result.distribution, result.installed,
                                base=row["base"])
    row["consistent"], row["message"] = consistent, message
    return row


def _older_than(version: Optional[str], base: Optional[str]) -> bool:
    """``base`` is an Upstream-Base header: a release ("5.25.0", also written "transformers 5.25.0") or a
    commit of main ("main 95f9af3... (date)"), which no release is older than by this test."""
    from packaging.version import InvalidVersion, Version

    if not (version and base):
        return False
    for word in base.split():
        try:
            return Version(version) < Version(word)
        except InvalidVersion:
            continue
    return False


def _own_range(patch: Any, distribution: str, version: Optional[str]) -> Optional[bool]:
    """Whether ``version`` of ``distribution`` is inside the patch's range for it (None: the
    patch's ``affects`` does not name the distribution)."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    for dist, spec in patch.affects.items():
        if canonicalize_name(dist) == canonicalize_name(distribution):
            if version is None:
                return False
            try:
                return SpecifierSet(spec).contains(Version(version), prereleases=True)
            except InvalidVersion:
                return None
    return None


def judge(verdict: str, patch: Any, status_row: Dict[str, Any], registry: Any,
          distribution: str, version: Optional[str], base: Optional[str] = None) -> "tuple[bool, str]":
    """Does the diff's verdict agree with the patch's state? (agree, what to tell the user).

    ``base``: the release the diff was written against (its ``Upstream-Base`` header). A diff is a pull
    request against upstream's main branch; on a release older than its base the code around the
    fix may differ, so a drifted diff there is expected, not a sign that the patch is wrong."""
    state = status_row["state"]
    # A disabled patch has no gate of its own in status(); ask the registry's gate directly.
    in_range = state in _IN_RANGE_STATES or (state == "disabled" and registry.gate(patch).affected)
    own = _own_range(patch, distribution, version)
    spec = patch.affects.get(distribution, "")
    label = f"{distribution} {version}"
    if verdict == "not-installed":
        return True, f"{distribution} is not installed; nothing to compare"
    if verdict == "applies":
        if own is False:
            return False, (f"the bug is still in {label}, but {patch.id}'s range {distribution}{spec} excludes it "
                           f"(state {state}): widen the range")
        if not in_range:
            return True, f"the bug is in {label}; {patch.id} is {state} for another reason ({status_row['reason']})"
        return True, f"the bug is in {label} and {patch.id} is {state}"
    if verdict == "fixed-upstream":
        if in_range:
            fix = (f"close {distribution}{spec} below {version} and record fixed_in" if spec
                   else f"add {distribution}<{version} to affects and record fixed_in")
            return False, (f"{label} already has this fix, so {patch.id} should be not-affected, but it is {state}: "
                           f"{fix}")
        return True, f"{label} already has this fix and {patch.id} is {state}"
    if verdict == "drifted":
        if state == "stale":
            return True, f"upstream changed the code in {label}: both {patch.id} and its diff need refreshing"
        if in_range and _older_than(version, base):
            return True, (f"the diff is written against {distribution} {base} (upstream main) and the code around "
                          f"the fix differs in the older {label}, where {patch.id} is {state} and carries the fix")
        if in_range:
            return False, (f"{patch.id} is {state} for {label} but its diff does not apply there: refresh the diff "
                           f"(or, if upstream changed the code, the patch is stale: try --import-targets)")
        return True, f"the diff no longer applies to {label}, where {patch.id} is {state}"
    return False, f"the diff cannot be checked ({verdict})"


def format_rows(rows: List[Dict[str, Any]]) -> str:
    if not rows:
        return "no upstream diffs"
    out = []
    for row in rows:
        version = f" [{row['distribution']} {row['installed']}]" if row.get("distribution") and row.get("installed") else ""
        mark = "ok" if row["consistent"] else "DISAGREES"
        size, index = row.get("series_size") or 1, row.get("series_index")
        on_top = "" if not index or index == 1 else ", on top of 1" if index == 2 else f", on top of 1..{index - 1}"
        place = f" (diff {index} of {size}{on_top})" if size > 1 else ""
        out.append(f"{row['diff']}{version}{place}: {row['verdict']} ({mark})")
        if row["detail"] != row["message"]:
            out.append(f"    {row['detail']}")
        out.append(f"    patch {row['patch_id']}: {row['patch_state'] or 'none'}: {row['message']}")
        if row["header_missing"]:
            out.append(f"    DEP-3 header lacks: {', '.join(row['header_missing'])}")
        for file in row["files"]:
            if file["result"] == "applies" and not any("fuzz" in n or "offset" in n for n in file["notes"]):
                continue
            out.append(f"    {file['path']}: {file['result']}" + (f" ({'; '.join(file['notes'])})" if file["notes"] else ""))
            for hunk in file["failed_hunks"]:
                out.append(f"      failing hunk #{hunk['number']}:")
                out.extend("        " + line for line in hunk["text"].rstrip("\n").splitlines())
    bad = sum(not r["consistent"] for r in rows)
    headers = sum(bool(r["header_missing"]) for r in rows)
    out.append(f"{len(rows)} diff(s), " + (f"{bad} disagreement(s) with `metapatch status`" if bad
                                          else "all consistent with `metapatch status`")
               + (f", {headers} incomplete DEP-3 header(s)" if headers else ""))
    return "\n".join(out)
