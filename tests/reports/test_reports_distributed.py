"""The corpus reports whose reproducers live in distributed_reports.py: two-rank runs (gloo on CPU),
so marked `ranks` and `slow` (CI runs them on the latest pair only; see test_reports.py for the checks)."""

from __future__ import annotations

import pytest

from metapatch.reports import Report

from .test_reports import check_classification, params

GROUP = ("distributed_reports.py",)

pytestmark = [pytest.mark.ranks, pytest.mark.slow]


@pytest.mark.parametrize("report", params(GROUP))
def test_report_classification(report: Report) -> None:
    check_classification(report)
