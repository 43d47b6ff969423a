"""The three legs every patch test runs on its selftest scenarios (subprocesses, real libraries):
unpatched (the upstream error where the install is affected), patched (equal to the in-memory
reference), and the upstream diff alone (applied to a copy of the installed package, metapatch
disabled; a series of diffs, all of them in order). Shared so that each test file states only what
is particular to its patch."""

from __future__ import annotations

from typing import Optional

import pytest

from metapatch.diffs import APPLIES, apply_to_copy, check, diffs_for


def assert_equals_reference(outcome) -> None:
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] == 0, outcome.metrics


def assert_upstream_error(outcome, scenario, why: str, message: Optional[str]) -> None:
    """Failed the way upstream fails: the scenario's error class, with ``message`` in its text."""
    assert not outcome.passed, f"{scenario.key} passed unpatched on an affected install ({why})"
    assert outcome.error_type == scenario.expected_error, outcome.traceback or outcome.stderr_tail
    if message is not None:
        assert message in outcome.error, outcome.error


def upstream_diff_copy(patch_id: str, tmp_path_factory, skip_reason: str = "") -> str:
    """A copy of the installed package with the patch's upstream diff (or its series of diffs, in
    order) applied; skipped, with the reason, where a diff (written against upstream main) does not
    apply to this release."""
    series = diffs_for(patch_id)
    assert len({diff.package for diff in series}) == 1, [d.path.name for d in series]  # one package
    for n, diff in enumerate(series):
        assert diff.header["Forwarded"] == "no" and diff.header["Last-Update"]
        verdict = check(diff, previous=series[:n])
        if verdict.verdict != APPLIES:
            pytest.skip(f"{diff.path.name} does not apply to the installed {diff.package} "
                        f"{verdict.installed}: {verdict.verdict}" + (f" ({skip_reason})" if skip_reason else ""))
    return str(apply_to_copy(series, tmp_path_factory.mktemp(patch_id)))
