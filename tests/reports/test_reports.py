"""The corpus reports (metapatch/reports/_corpus.py) whose reproducers live in accelerate_reports.py
and transformers_reports.py, reproduced on the installed stack without and with metapatch in one
child process, and checked against their classification (the PEFT and quantized ones:
test_reports_peft_quantized.py; two files, so that ``-n 2 --dist loadfile`` runs them in parallel).

One child per report (forked from the selftest's warm parent): the first leg runs with
``METAPATCH_DISABLE=all``, the second after ``metapatch.install()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest

from metapatch.reports import FIXED_BY_METAPATCH, FIXED_UPSTREAM, NEEDS_GPU, NOT_META_BUG, OPEN, Report, reports
from metapatch.selftest._harness import Scenario, run_scenario

from ._expect import describe, matches_signature, unpatched_should_fail

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def run_report(report: Report, legs: str = "both") -> Dict[str, Any]:
    path, _, function = report.reproducer.partition(":")
    outcome = run_scenario(Scenario("report", report.id, "metapatch.reports._legs:both_legs"), patched=False,
                           env={"METAPATCH_REPORT_CASE": f"{REPO / path}:{function}", "METAPATCH_REPORT_LEGS": legs},
                           timeout=TIMEOUT)
    assert outcome.passed, (f"{report.id}: the child did not report ({outcome.error_type}: {outcome.error})\n"
                            f"{outcome.stderr_tail[-2000:]}")
    return outcome.metrics


GROUP = ("accelerate_reports.py", "transformers_reports.py")


def params(modules):
    for report in reports():
        if report.reproducer.partition(":")[0].rpartition("/")[2] not in modules:
            continue
        needed = report.cuda_devices_needed
        marks = [pytest.mark.gpu(count=needed)] if needed else []
        yield pytest.param(report, id=report.id, marks=marks)


@pytest.mark.parametrize("report", params(GROUP))
def test_report_classification(report: Report) -> None:
    check_classification(report)


def check_classification(report: Report) -> None:
    legs = run_report(report)
    unpatched, patched = legs["unpatched"], legs["patched"]
    for leg in (unpatched, patched):
        if leg.get("not_applicable"):
            pytest.skip(f"{report.id}: {leg['not_applicable']}")
    if report.status == NEEDS_GPU:
        # Only reached with CUDA devices: the measurement decides the classification.
        pytest.fail(f"{report.id} ran on a GPU: without metapatch {describe(unpatched)}; with it {describe(patched)}. "
                    f"Classify it from this measurement.")
    should_fail, why = unpatched_should_fail(report)
    if should_fail is None:
        pytest.skip(f"{report.id}: installed versions outside the support window ({why})")
    where = f"{report.id} ({report.status}; {why})"
    if should_fail:
        assert not unpatched["passed"], f"{where}: expected to fail without metapatch, but it {describe(unpatched)}"
        assert matches_signature(report, unpatched), (
            f"{where}: fails without metapatch, but not the reported way: {describe(unpatched)}")
    else:
        assert unpatched["passed"], f"{where}: expected to pass without metapatch, but it {describe(unpatched)}"
    if report.status == FIXED_UPSTREAM and should_fail:
        # An install older than the upstream fix: metapatch has no patch for it, so it still fails.
        assert not patched["passed"], (f"{where}: fails without metapatch but passes with it (states "
                                       f"{patched.get('states')}): classify it fixed-by-metapatch")
    elif report.status in (FIXED_BY_METAPATCH, FIXED_UPSTREAM):
        assert patched["passed"], f"{where}: expected to pass with metapatch, but it {describe(patched)} (states {patched.get('states')})"
    elif report.status == OPEN:
        assert not patched["passed"], (
            f"{where}: classified open but passes with metapatch (states {patched.get('states')}): "
            f"reclassify it as fixed-by-metapatch with the patch that fixes it")
    elif report.status == NOT_META_BUG:
        assert not patched["passed"] and matches_signature(report, patched), (
            f"{where}: metapatch changed a by-design behaviour: {describe(patched)}")
