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

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

FIXED_BY_METAPATCH = "fixed-by-metapatch"
FIXED_UPSTREAM = "fixed-upstream"
NEEDS_GPU = "needs-gpu"
NOT_META_BUG = "not-meta-bug"
OPEN = "open"
STATUSES = (FIXED_BY_METAPATCH, FIXED_UPSTREAM, NEEDS_GPU, NOT_META_BUG, OPEN)


@dataclass(frozen=True)
class Report:
    id: str  # slug, unique
    url: str  # as the report is published
    title: str  # as published
    tracker: str  # "owner/repo" (or the forum's host)
    reporter_versions: str  # what the reporter ran, as they wrote it
    mechanism: str  # one sentence: what goes wrong, and where
    mechanism_key: str  # reports sharing a mechanism share this key (often the patch id)
    signatures: Tuple[str, ...]  # regexes over the error text the reporter saw
    status: str  # one of STATUSES
    reason: str  # why this status; for open reports, the workaround
    reproducer: str  # "tests/reports/cases/<module>.py:<function>"
    patch: Optional[str] = None  # the metapatch patch id that fixes it (fixed-by-metapatch)
    fixed_upstream_in: Mapping[str, str] = field(default_factory=dict)  # dist -> first fixed release
    frames: Tuple[str, ...] = ()  # "module:qualname" frames typical of its traceback (for explain)
    extra_patches: Tuple[str, ...] = ()  # other patches the fix needs on some stacks
    # dist -> specifier where the upstream bug is measured (fixed-upstream); default: below fixed_upstream_in
    affected: Mapping[str, str] = field(default_factory=dict)
    # CUDA devices the reproducer needs (0: runs on the CPU); its test is skipped, with the reason, with fewer
    gpus: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"report {self.id}: unknown status {self.status!r}")
        if self.status == FIXED_BY_METAPATCH and not self.patch:
            raise ValueError(f"report {self.id}: fixed-by-metapatch needs a patch id")
        if self.status == FIXED_UPSTREAM and not self.fixed_upstream_in:
            raise ValueError(f"report {self.id}: fixed-upstream needs fixed_upstream_in")

    @property
    def reproducer_module(self) -> str:
        path, _, _ = self.reproducer.partition(":")
        return path[:-3].replace("/", ".") if path.endswith(".py") else path

    @property
    def reproducer_function(self) -> str:
        return self.reproducer.partition(":")[2]

    @property
    def reproduced_here(self) -> bool:
        """Whether the reproducer runs without a GPU (counted as reproduced in the README)."""
        return self.status != NEEDS_GPU and not self.gpus

    @property
    def cuda_devices_needed(self) -> int:
        """CUDA devices its test needs: ``gpus``, at least one for a report classified needs-gpu."""
        return max(self.gpus, 1 if self.status == NEEDS_GPU else 0)


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


README_SENTENCE_PATTERN = r"(\d+) public reports reproduced, (\d+) fixed by metapatch"


def upstream_status(report: Report) -> str:
    if report.fixed_upstream_in:
        return "fixed in " + ", ".join(f"{d} {v}" for d, v in report.fixed_upstream_in.items())
    if report.status == NOT_META_BUG:
        return "by design (not a meta-device bug)"
    if report.status == NEEDS_GPU:
        return "not measured (needs a GPU)"
    return "not fixed"


def render_docs() -> str:
    """docs/reports.md: the corpus as a table."""
    from ._render import render

    return render(reports())
