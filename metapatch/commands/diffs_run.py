"""`metapatch diffs check --run`: does each diff do what its patch does?

The text check says whether a diff still applies; this says whether, applied, it fixes the bug.
For each chosen patch whose diffs all apply to the installed packages, every scenario of the patch
runs twice in a fresh interpreter, with this patch disabled (the others as shipped):
  without the diff   the installed packages as they are (does the bug reproduce here?)
  with the diff      a copy of each installed package with the patch's diffs (a series: all of
                     them, in order) applied, first on the child's path
A scenario that is `n/a` on this stack (its model class is missing, say) is skipped. The check
fails when a scenario fails with the diff applied: the diff does not do what the patch does.
"""

from __future__ import annotations

from typing import Any, Dict, List


def run_all(registry: Any, text_rows: List[Dict[str, Any]], patch_ids: List[str], timeout: float,
            progress: Any = None) -> List[Dict[str, Any]]:
    """One result per chosen patch that lists diffs (in registry order)."""
    from metapatch._framework import layout

    chosen = patch_ids or [p.id for p in registry.patches.values() if layout.diffs(p)]
    verdicts: Dict[str, List[str]] = {}
    for row in text_rows:
        verdicts.setdefault(row["patch_id"], []).append(row["verdict"])
    results = []
    for patch_id in chosen:
        patch = registry.patches[patch_id]
        if not layout.diffs(patch):
            continue
        blocking = sorted({v for v in verdicts.get(patch_id, []) if v != "applies"})
        if blocking:
            results.append({"patch_id": patch_id, "result": "not-run", "scenarios": {},
                            "reason": f"a diff is {', '.join(blocking)} on the installed packages (see above)"})
            continue
        if progress:
            progress(f"running {patch_id}'s scenarios without and with its diff ...")
        results.append(run_patch(patch, timeout))
    return results


def run_patch(patch: Any, timeout: float) -> Dict[str, Any]:
    """The survey's probe without its forced leg: this patch off, without and with its diffs."""
    from metapatch.survey.probe import DOES_NOT_APPLY, probe

    rows = probe(patch.id, timeout, with_diff=True, forced=False)["scenarios"]
    scenarios: Dict[str, Dict[str, Any]] = {}
    for key, row in rows.items():
        scenarios[key] = {"without_diff": row["unpatched"]}
        if "diff" in row:
            result = row["diff"]["result"]
            if result.startswith(DOES_NOT_APPLY):
                return {"patch_id": patch.id, "result": "does-not-apply", "scenarios": {}, "reason": result[:300]}
            scenarios[key]["with_diff"] = row["diff"]
    return {"patch_id": patch.id, "scenarios": scenarios, **_verdict(scenarios)}


def _verdict(scenarios: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    ran = {k: r for k, r in scenarios.items() if "with_diff" in r}
    failed = sorted(k for k, r in ran.items() if r["with_diff"]["result"] != "pass")
    fixed = sorted(k for k, r in ran.items()
                   if r["without_diff"]["result"] == "fail" and r["with_diff"]["result"] == "pass")
    if not scenarios:
        return {"result": "no-scenarios", "reason": "the patch has no scenarios to run"}
    if not ran:
        return {"result": "n/a", "reason": "every scenario is n/a on this stack"}
    if failed:
        return {"result": "fail", "reason": f"with the diff applied, {len(failed)} of {len(ran)} scenario(s) fail: "
                                            + ", ".join(failed)}
    if not fixed:
        return {"result": "pass", "reason": f"the bug does not reproduce here; with the diff {len(ran)} scenario(s) "
                                            "still pass"}
    return {"result": "pass", "reason": f"the diff fixes {len(fixed)} of {len(ran)} scenario(s) (the others pass "
                                        "without it too)" if len(fixed) < len(ran)
            else f"the diff fixes all {len(ran)} scenario(s)"}


def format_results(results: List[Dict[str, Any]]) -> str:
    out = ["behaviour (scenarios with this patch disabled, without / with its diff applied to a copy):"]
    for result in results:
        out.append(f"  {result['patch_id']}: {result['result']}: {result['reason']}")
        for key, row in sorted(result["scenarios"].items()):
            cells = [f"without the diff {_cell(row['without_diff'], 'fails')}"]
            if "with_diff" in row:
                cells.append(f"with it {_cell(row['with_diff'], 'FAILS')}")
            out.append(f"    {key}: " + "; ".join(cells))
    if len(out) == 1:
        out.append("  no patch with diffs was chosen")
    return "\n".join(out)


def _cell(summary: Dict[str, Any], failing: str) -> str:
    if summary["result"] == "fail":
        return f"{failing} {summary.get('error_type')}: {(summary.get('error') or '')[:120]}"
    if summary["result"] == "n/a":
        return f"n/a ({summary.get('reason', '')[:80]})"
    return "passes" if summary["result"] == "pass" else summary["result"]


def failed(results: List[Dict[str, Any]]) -> bool:
    return any(r["result"] in ("fail", "does-not-apply") for r in results)
