"""Renders docs/reports.md from the corpus (kept separate: only the docs need it)."""

from __future__ import annotations

from typing import List

HEADER = """# Public reports reproduced by metapatch

Generated from `metapatch/reports/_corpus.py` by `python -m metapatch.reports --write-docs`; do not
edit by hand (`tests/reports/test_docs.py` fails when this file and the data disagree).

Each report below is rebuilt as a tiny CPU reproducer of the reporter's code path (tiny random
checkpoints, real `from_pretrained` with cpu/disk `device_map` and `offload_folder`, real
`dispatch_model`, real `PeftModel`, real bitsandbytes), in `tests/reports/cases/`. Outputs are compared
with the in-memory reference, so a silently different output counts as a failure.
`tests/reports/test_reports.py` runs each reproducer without metapatch (`METAPATCH_DISABLE=all`)
and with it, and checks the classification against the installed versions:

| status | what the test asserts |
|---|---|
| `fixed-by-metapatch` | fails without metapatch where the patch's affected range includes the installed versions, passes with it |
| `fixed-upstream` | passes without metapatch on releases at or after the fix |
| `open` | still fails, with and without metapatch (the test flips when it is fixed) |
| `not-meta-bug` | fails the same way with and without metapatch: the behaviour is by design (the reason says why) |
| `needs-gpu` | skipped without CUDA devices, with the reason |

A reproducer that needs CUDA devices whatever its status (int8 layers, a second GPU) is skipped without
them, with the reason, and is not counted as reproduced here.

`metapatch explain TRACEBACK_FILE` (or `-` for stdin) looks a traceback up in this table.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(reports: List) -> str:
    from . import STATUSES, readme_sentence, upstream_status

    lines = [HEADER, f"**{readme_sentence()}.**", ""]
    summary = ", ".join(f"{sum(1 for r in reports if r.status == s)} {s}" for s in STATUSES)
    lines += [f"By status: {summary}.", ""]
    lines += ["| report | mechanism | upstream status | metapatch | status |", "|---|---|---|---|---|"]
    for r in reports:
        link = f"[{_cell(r.tracker)}: {_cell(r.title)}]({r.url})"
        patch = f"`{r.patch}`" if r.patch else "—"
        lines.append(f"| {link} | {_cell(r.mechanism)} | {_cell(upstream_status(r))} | {patch} | `{r.status}` |")
    lines += ["", "## Notes", ""]
    for r in reports:
        lines.append(f"- **{r.id}** ({r.reporter_versions}): {_cell(r.reason)} Reproducer: "
                     f"`{r.reproducer}`.")
    return "\n".join(lines) + "\n"
