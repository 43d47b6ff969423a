"""The corpus of public meta-device / offload bug reports that metapatch reproduces.

Each :class:`Report` cites one public report (URL and title as published), names its mechanism,
the error text it shows (regexes, used by ``metapatch explain``), and how it stands: fixed by a
metapatch patch, fixed upstream (from which release), needing a GPU, not a meta-device bug, or
still open. The reproducers live in the repository's ``tests/reports/``; ``tests/reports`` checks
every classification against the installed stack, so this data cannot drift from reality.

Cheap to import: plain data, no torch, no Hugging Face package. ``docs/reports.md`` is generated
from it (``python -m metapatch.reports --write-docs``).
"""

from __future__ import annotations

from typing import Dict, List

from ._report import (FIXED_BY_METAPATCH, FIXED_UPSTREAM, NEEDS_GPU, NOT_META_BUG, OPEN,  # noqa: F401
                      README_SENTENCE_PATTERN, STATUSES, Report, upstream_status)


def reports() -> List[Report]:
    from ._corpus import REPORTS

    return list(REPORTS)


def by_id() -> Dict[str, Report]:
    return {report.id: report for report in reports()}


def counts() -> Dict[str, int]:
    found = {status: 0 for status in STATUSES}
    for report in reports():
        found[report.status] += 1
    return found


def readme_sentence() -> str:
    """The count the README states; tests/reports/test_docs.py keeps the two equal."""
    reproduced = sum(1 for r in reports() if r.reproduced_here)
    fixed = counts()[FIXED_BY_METAPATCH]
    return f"{reproduced} public reports reproduced, {fixed} fixed by metapatch"


def render_docs() -> str:
    """docs/reports.md: the corpus as a table."""
    from ._render import render

    return render(reports(), readme_sentence())
