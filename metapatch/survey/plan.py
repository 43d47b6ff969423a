"""Build a patch's survey table: the static part (releases -> fingerprints -> variants) and, with
``--run``, the reproducer runs on one release per variant combined with its companions.

Companions vary together rather than one axis at a time: for a transformers variant the other
distributions the patch touches (its targets, its ``affects``, what its scenarios import) are set
all to their newest release in the window, then all to their oldest, then mixed, up to
``max_combos`` combinations; distributions the patch does not touch are not installed at all.
"""

from __future__ import annotations

from itertools import product
from typing import Any, Callable, Dict, List, Optional

from . import releases as rel
from . import runner, static, table, variants

METHOD = ("fingerprints read from each release's wheel; runs (python -m metapatch.survey.probe): 'bug' = the "
          "patch's reproducers with this patch disabled and the others as shipped, 'patched' = this patch forced on "
          "(gate open, any fingerprint accepted), 'diff' = this patch disabled and its upstream diff applied to a copy "
          "of the installed package; measured on the newest and oldest release of each row, bisected where they differ "
          "(a row whose runs name only its newest release was surveyed with --ends newest: one release per variant)")
CORE = ("transformers", "accelerate")  # every reproducer builds a transformers model and dispatches it


def scenario_needs(patch: Any) -> set:
    """Distributions of the window that the patch's reproducer modules import (read, not imported)."""
    import re

    from ..tested_versions import SUPPORT_WINDOW

    found = set()
    for path in runner._scenario_files(patch.id):
        text = path.read_text() if path.is_file() else ""
        found |= {d for d in SUPPORT_WINDOW if re.search(rf"^\s*(from|import)\s+{d}\b", text, re.M)}
    return found


def target_dists(patch: Any) -> Dict[str, List[str]]:
    """{distribution: [target dotted, ...]}; the distribution is the module's top-level package."""
    out: Dict[str, List[str]] = {}
    for target in patch.targets:
        out.setdefault(target.module.split(".")[0], []).append(target.dotted)
    return out


def related_dists(patch: Any) -> List[str]:
    names = set(CORE) | set(patch.affects) | set(target_dists(patch)) | scenario_needs(patch)
    return sorted(d for d in names if rel.window_for(d))


def _static_rows(dist: str, targets: List[str], refresh: bool, workers: int, log: Callable[[str], None],
                 window: Optional[str] = None, read_only: bool = False) -> Dict[str, Any]:
    versions = rel.releases_in_window(dist, refresh, window)
    progress = rel.Progress(f"{dist} wheels", len(versions))
    # a distribution without targets is grouped by series: its wheels are not needed
    archives = rel.fetch_all(dist, versions, workers, on_done=progress.step) if targets else {}
    prints: Dict[str, Dict[str, str]] = {}
    for version in versions:
        path, error = archives.get(version, (None, ""))
        prints[version] = static.archive_fingerprints(dist, version, path, targets) if path else \
            {t: "download-failed" for t in targets}  # (an empty dict where there are no targets)
        if error:
            log(f"{dist} {version}: {error}")
    series = None if targets else {v: variants.minor_series(v) for v in versions}
    rows = variants.group(versions, prints, series)
    section = {"window": window or rel.window_for(dist), "targets": targets, "releases": versions, "rows": rows}
    if read_only:
        section["read_only"] = True
        section["note"] = (f"{dist} releases are read, not installed: each release's targets are fingerprinted from "
                           f"its wheel, and no reproducer runs there (the test suite and `metapatch selftest` measure "
                           f"the {dist} they run on)")
    elif window:
        section["note"] = f"no support window is declared for {dist}: surveyed over the patch's affects {window}"
    return section


def _installed_rows(dist: str, targets: List[str]) -> Dict[str, Any]:
    """A target distribution outside every window: the installed release only."""
    from ..diffs import installed_version

    version = installed_version(dist)
    if version is None:
        return {"window": None, "targets": targets, "releases": [], "rows": [],
                "note": f"{dist} is not installed where the survey ran; not measured"}
    prints = static.installed_fingerprints(targets)
    row = {"variant": "V1", "releases": [version], "range": f"=={version}", "fingerprints": dict(sorted(prints.items()))}
    return {"window": None, "targets": targets, "releases": [version], "rows": [row],
            "note": f"{dist} is outside the support window: only the installed {version} is measured"}


def static_table(patch: Any, refresh: bool = False, workers: int = 4, log: Callable[[str], None] = print) -> Dict[str, Any]:
    dists: Dict[str, Any] = {}
    by_dist = target_dists(patch)
    for dist in sorted(set(by_dist) | set(patch.affects)):
        targets = sorted(by_dist.get(dist, []))
        if rel.window_for(dist):
            dists[dist] = _static_rows(dist, targets, refresh, workers, log)
        elif rel.read_only_window_for(dist) and targets:  # torch: every release's code, read where it lies
            dists[dist] = _static_rows(dist, targets, refresh, workers, log, rel.read_only_window_for(dist),
                                       read_only=True)
        elif dist in patch.affects:  # a distribution of its own (gguf): its affects range is its window
            dists[dist] = _static_rows(dist, targets, refresh, workers, log, patch.affects[dist])
        else:  # outside every window: only the installed release
            dists[dist] = _installed_rows(dist, targets)
    return {"patch": patch.id, "schema": 1, "distributions": dists, "method": METHOD}


def carry_runs(new: Dict[str, Any], old: Optional[Dict[str, Any]]) -> None:
    """Keep the measured rows of an earlier table where the code did not change: a new static row
    is replaced by the old measured rows with its fingerprints when they cover exactly its releases
    (a row split by bisection stays split); where they cover only some of them (the row has grown: more
    releases read, a new release with the same code) and agree on the verdict, their runs go to the new
    row, which names its measured releases in each run's pins, as a row measured with --ends newest does.
    A --static refresh must not throw measurements away."""
    if not old:
        return
    for dist, section in new["distributions"].items():
        previous: Dict[tuple, List[Dict[str, Any]]] = {}
        for row in old.get("distributions", {}).get(dist, {}).get("rows", []):
            if row.get("runs"):
                previous.setdefault(tuple(sorted(row["fingerprints"].items())), []).append(row)
        rows = []
        for row in section["rows"]:
            same = [r for r in previous.get(tuple(sorted(row["fingerprints"].items())), [])
                    if set(r["releases"]) <= set(row["releases"])]
            if same and sorted(v for r in same for v in r["releases"]) == sorted(row["releases"]):
                for r in sorted(same, key=lambda r: row["releases"].index(r["releases"][0])):
                    rng = variants.exact_range(section["releases"], r["releases"][0], r["releases"][-1])
                    rows.append({**r, "variant": row["variant"], "range": rng})
            elif same and len({table.row_status(r) for r in same}) == 1:
                rows.append({**row, "runs": [run for r in same for run in r["runs"]]})
            else:
                rows.append(row)
        section["rows"] = rows


def companion_releases(patch: Any, dist: str) -> List[str]:
    """The releases of a companion distribution to pin: those inside the patch's own ``affects``
    range for it when it declares one (a bug that needs transformers 5.6-5.22 is not measured on
    an accelerate release by pairing it with transformers 5.24), else the whole window."""
    from packaging.specifiers import SpecifierSet

    releases = rel.releases_in_window(dist)
    spec = patch.affects.get(dist)
    if spec:
        inside = [v for v in releases if SpecifierSet(spec).contains(v, prereleases=True)]
        return inside or releases
    return releases


def combinations(patch: Any, dist: str, version: str, max_combos: int) -> List[Dict[str, str]]:
    """Pins for one release of a variant: companions all newest, all oldest, then mixed (newest and
    oldest inside the patch's affected range of each companion, where it declares one)."""
    companions = [d for d in related_dists(patch) if d != dist]
    ends = {d: (releases[-1], releases[0]) for d in companions for releases in [companion_releases(patch, d)]}
    order = [tuple(0 for _ in companions), tuple(1 for _ in companions)]
    order += [c for c in product((0, 1), repeat=len(companions)) if c not in order]
    combos = []
    for choice in order[:max(1, max_combos)]:
        pins = {dist: version, **{d: ends[d][i] for d, i in zip(companions, choice)}}
        if pins not in combos:
            combos.append(pins)
    return combos


# How many older releases of the companions to try when a combination cannot be installed (a new
# transformers that asks for a package PyPI does not have yet): the newest one that installs stands for it.
_STEP_BACK = 3


def _stepped_back(patch: Any, dist: str, pins: Dict[str, str]) -> Optional[Dict[str, str]]:
    """``pins`` with every companion one release older (inside its range), or None where none can go back."""
    older, moved = dict(pins), False
    for companion, version in pins.items():
        if companion == dist:
            continue
        releases = companion_releases(patch, companion)
        if version in releases and releases.index(version) > 0:
            older[companion] = releases[releases.index(version) - 1]
            moved = True
    return older if moved else None


def _run_installable(patch: Any, dist: str, pins: Dict[str, str], timeout: float,
                     log: Callable[[str], None]) -> Dict[str, Any]:
    """The combination's result; where it is uninstallable, the result with the companions stepped back
    (up to _STEP_BACK releases) instead, noting what was asked for, so that a row is measured rather than
    left undecided (and its earlier measurement overwritten) because of a companion's missing dependency."""
    result = runner.run_combination(patch.id, pins, timeout, log)
    tried, current = [result], pins
    while result.get("status") == "uninstallable" and len(tried) <= _STEP_BACK:
        current = _stepped_back(patch, dist, current)
        if current is None:
            break
        result = runner.run_combination(patch.id, current, timeout, log)
        tried.append(result)
    if result is not tried[0] and result.get("status") != "uninstallable":
        first = tried[0]
        result = {**result, "stepped_back_from": first["pins"], "stepped_back_reason": first.get("reason", "")}
    return result


def _measure(patch: Any, dist: str, version: str, max_combos: int, timeout: float, progress: Any,
             log: Callable[[str], None]) -> List[Dict[str, Any]]:
    runs = []
    for pins in combinations(patch, dist, version, max_combos):
        result = _run_installable(patch, dist, pins, timeout, log)
        runs.append({"pins": result["pins"], **runner.verdict(result), "patch_source": result["patch_source"]})
        if "stepped_back_from" in result:
            runs[-1]["stepped_back_from"] = result["stepped_back_from"]
            runs[-1]["stepped_back_reason"] = result["stepped_back_reason"][:200]
        progress.step(", ".join(f"{d} {v}" for d, v in sorted(pins.items())) + f": bug {runs[-1]['bug']}")
    return runs


def _measured_row(row: Dict[str, Any], releases: List[str], runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {**row, "releases": releases, "runs": runs}


def run_row(row: Dict[str, Any], all_releases: List[str], measure: Callable[[str], List[Dict[str, Any]]],
            ends: str = "both") -> List[Dict[str, Any]]:
    """Run a row's newest and oldest release; when they disagree (the bug was fixed, or appeared,
    outside the fingerprinted code) bisect for the boundary and split the row there. Both halves
    keep the variant id: same code, different measured behaviour. ``ends="newest"`` runs the newest
    release only (one per code variant, half the runs; a fix outside the fingerprinted code then
    goes unseen)."""
    releases = row["releases"]
    newest = measure(releases[-1])
    if len(releases) == 1 or ends == "newest":
        return [_measured_row(row, releases, newest)]
    oldest = measure(releases[0])
    lo, hi, at = 0, len(releases) - 1, {0: oldest, len(releases) - 1: newest}
    status = lambda runs: table.row_status({"runs": runs})  # noqa: E731
    # Different answers at the two ends (including n/a at one end: bitsandbytes 0.46.0 cannot load a
    # 4-bit model under transformers 5.x at all, 0.46.1 has the bug): bisect for the boundary.
    if status(oldest) == status(newest):
        return [_measured_row(row, releases, oldest + newest)]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at[mid] = measure(releases[mid])
        lo, hi = (mid, hi) if status(at[mid]) == status(oldest) else (lo, mid)
    first, second = releases[:hi], releases[hi:]
    last = len(releases) - 1
    first_runs = at[0] + (at[lo] if lo else [])  # both ends of each half, where measured
    second_runs = at[hi] + (at[last] if hi != last else [])
    return [dict(_measured_row(row, first, first_runs), range=variants.exact_range(all_releases, first[0], first[-1])),
            dict(_measured_row(row, second, second_runs), range=variants.exact_range(all_releases, second[0], second[-1]))]


def run_table(table_: Dict[str, Any], patch: Any, max_combos: int, timeout: float, only_dists: List[str],
              log: Callable[[str], None] = print, ends: str = "both") -> None:
    """Replace each row by its measured row(s) in place; cached combinations cost nothing."""
    for dist, section in table_["distributions"].items():
        if section.get("window") is None or section.get("read_only") or (only_dists and dist not in only_dists):
            continue
        per_row = 1 if ends == "newest" else 2
        estimate = sum(min(len(r["releases"]), per_row) for r in section["rows"]) * max(1, max_combos)
        progress = rel.Progress(f"{patch.id} runs on {dist} (about {estimate})", estimate)
        measure = lambda version: _measure(patch, dist, version, max_combos, timeout, progress, log)  # noqa: E731
        first = [v for r in section["rows"]
                 for v in dict.fromkeys((r["releases"][-1],) + (() if ends == "newest" else (r["releases"][0],)))]
        runner.prefetch([p for v in first for p in combinations(patch, dist, v, max_combos)], log)
        section["rows"] = [half for row in section["rows"] for half in run_row(row, section["releases"], measure, ends)]
