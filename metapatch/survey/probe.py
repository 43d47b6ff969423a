"""What ``metapatch survey --run`` executes inside one throw-away venv:
``<venv>/bin/python -m metapatch.survey.probe PATCH_ID`` prints one JSON object.

Each reproducer of the patch runs three times with the shipped harness (a fresh subprocess each):
  unpatched  every other patch as shipped, this one disabled (so the bug measured is this patch's)
  patched    this patch forced on (gate open, any fingerprint accepted: see _force/sitecustomize.py)
  diff       this patch disabled, its upstream diff applied to a copy of the installed package
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

FORCE_DIR = Path(__file__).resolve().parent / "_force"
NOT_APPLICABLE_ERRORS = ("NotApplicable", "ModelUnavailable")
DOES_NOT_APPLY = "does not apply"


def scenarios_of(patch: Any) -> List[Any]:
    """The patch's own reproducers; for a patch without any (it is exercised by another patch's
    scenarios), the selftest scenarios of the module its record names."""
    from metapatch._framework import layout
    from metapatch.selftest import all_scenarios

    found = all_scenarios()
    own = [s for s in found if s.patch_id == patch.id]
    if own:  # the quick ones where there are any: the slow variants are the test suite's
        return [s for s in own if s.in_selftest] or own
    module = layout.scenarios(patch) or ""
    return [s for s in found if s.function.partition(":")[0] == module and s.in_selftest]


def summarise(outcome: Any) -> Dict[str, Any]:
    not_applicable = getattr(outcome, "not_applicable", None)
    if not_applicable is None and outcome.error_type in NOT_APPLICABLE_ERRORS:
        not_applicable = outcome.error or outcome.error_type
    if not_applicable:
        return {"result": "n/a", "reason": str(not_applicable)[:200]}
    if outcome.passed:
        return {"result": "pass", "max_abs_diff": outcome.metrics.get("max_abs_diff")}
    return {"result": "fail", "error_type": outcome.error_type, "error": (outcome.error or "")[:300]}


def diff_copies(patch: Any, root: Path) -> Optional[List[str]]:
    """Copies of the installed packages with the patch's upstream diffs applied, a series in order
    (upstream with all of the patch's pull requests), one path per package (None: no diff)."""
    from metapatch import diffs
    from metapatch._framework import layout

    parsed = [diffs.parse(diffs.resolve_diff_path(relative)) for relative in layout.diffs(patch)]
    return [str(diffs.apply_to_copy(series, root / series[0].package)) for series in diffs.series_of(parsed)] or None


def probe(patch_id: str, timeout: float, with_diff: bool = True, forced: bool = True) -> Dict[str, Any]:
    """``forced=False`` leaves out the patched leg (``metapatch diffs check --run`` asks only whether
    the diff fixes what reproduces)."""
    import metapatch
    from metapatch.selftest import run_scenario

    patch = metapatch.registry.patches[patch_id]
    off = {"METAPATCH_DISABLE": patch_id}
    report: Dict[str, Any] = {"patch": patch_id, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="metapatch-survey-diff-") as tmp:
        copies: Optional[List[str]] = None
        diff_error = ""
        if with_diff:
            try:
                copies = diff_copies(patch, Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a diff that does not apply is a result
                diff_error = f"{DOES_NOT_APPLY}: {str(exc).splitlines()[0][:200]}"
        for scenario in scenarios_of(patch):
            row = {"unpatched": summarise(run_scenario(scenario, patched=True, env=off, timeout=timeout))}
            if row["unpatched"]["result"] == "n/a":
                report["scenarios"][scenario.key] = row
                continue
            if forced:
                outcome = run_scenario(scenario, patched=True, pythonpath=[str(FORCE_DIR)],
                                       env={"METAPATCH_SURVEY_FORCE": patch_id}, timeout=timeout)
                row["patched"] = summarise(outcome)
                row["patched"]["state"] = outcome.states.get(patch_id)
            if copies:
                # The diff changes its targets' code, so other patches on them go stale in the copy, as they
                # would on a release with the fix: METAPATCH_STRICT=1 would make that an import error.
                row["diff"] = summarise(run_scenario(scenario, patched=True, pythonpath=copies,
                                                     env={**off, "METAPATCH_STRICT": "0"}, timeout=timeout))
            else:
                row["diff"] = {"result": diff_error or ("skipped" if not with_diff else "no diff")}
            report["scenarios"][scenario.key] = row
    return report


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metapatch.survey.probe")
    parser.add_argument("patch_id")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--no-diff", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.patch_id, args.timeout, not args.no_diff), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
