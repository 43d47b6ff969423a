"""The corpus reports whose reproducers live in peft_reports.py and quantized_reports.py (see
test_reports.py, which holds the checks and the other reports)."""

from __future__ import annotations

import pytest

from metapatch.reports import Report, reports

from .test_reports import check_classification, params

GROUP = ("peft_reports.py", "quantized_reports.py")


@pytest.mark.parametrize("report", params(GROUP))
def test_report_classification(report: Report) -> None:
    check_classification(report)


def test_every_report_is_in_one_group() -> None:
    from . import test_reports, test_reports_distributed

    groups = set(GROUP) | set(test_reports.GROUP) | set(test_reports_distributed.GROUP)
    modules = {r.reproducer.partition(":")[0].rpartition("/")[2] for r in reports()}
    assert modules <= groups, sorted(modules - groups)
