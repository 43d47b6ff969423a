"""docs/reports.md and the README's count sentence agree with the corpus data; the data is sound."""

from __future__ import annotations

import re
from pathlib import Path

from metapatch.reports import (FIXED_BY_METAPATCH, README_SENTENCE_PATTERN, counts, readme_sentence, render_docs,
                               reports)

REPO = Path(__file__).resolve().parents[2]


def test_docs_match_the_corpus() -> None:
    docs = REPO / "docs" / "reports.md"
    assert docs.exists() and docs.read_text() == render_docs(), (
        "docs/reports.md is out of date: run `python -m metapatch.reports --write-docs` "
        "(`--check-docs` prints the diff)")


def test_readme_states_the_corpus_count() -> None:
    readme = (REPO / "README.md").read_text()
    found = re.search(README_SENTENCE_PATTERN, readme)
    assert found, f"README.md must state the corpus count: add the sentence {readme_sentence()!r}"
    assert found.group(0) == readme_sentence(), f"README.md says {found.group(0)!r}; the corpus says {readme_sentence()!r}"


def test_corpus_is_sound() -> None:
    from metapatch.patches import INDEX

    found = reports()
    assert len(found) >= 30
    ids = [r.id for r in found]
    assert len(ids) == len(set(ids)), "duplicate report ids"
    urls = [r.url for r in found]
    assert len(urls) == len(set(urls)), "the same report is cited twice"
    for r in found:
        assert re.match(r"https://(github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+|discuss\.huggingface\.co/t/)", r.url), r.url
        path, _, function = r.reproducer.partition(":")
        assert f"def {function}(" in (REPO / path).read_text(), f"{r.id}: no reproducer {r.reproducer}"
        for pattern in r.signatures:
            re.compile(pattern)
        for patch in filter(None, (r.patch, *r.extra_patches)):
            assert patch in INDEX, f"{r.id}: unknown patch {patch}"
    assert counts()[FIXED_BY_METAPATCH] == sum(1 for r in found if r.patch and r.status == FIXED_BY_METAPATCH)
