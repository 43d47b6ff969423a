"""`metapatch pr` for a series of diffs (``<package>-1-<what>.diff``, ``<package>-2-<what>.diff``,
...): the branch and body file of each, what is printed, and the script that opens the pull
requests in order, each one's body naming the PR it depends on. No checks here: pr.py runs them."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, List, Optional, Sequence


def branch_name(stem: str, diff: Any) -> str:
    """``metapatch/<id>`` and ``peft-2-keep-placement.diff`` -> ``metapatch/<id>-2-keep-placement``."""
    return f"{stem}-{diff.path.stem[len(diff.package) + 1:]}"


def body_path(git_dir: Path, patch_id: str, body_file: Optional[Path], number: Optional[int]) -> Path:
    """Where the PR body goes: inside the clone's git directory unless ``--body-file`` says; diff N
    of a series gets ``...-N-pr-body.md`` (``BODY-N.md``)."""
    if body_file is None:
        return git_dir / "metapatch" / (f"{patch_id}-{number}-pr-body.md" if number else f"{patch_id}-pr-body.md")
    body_file = Path(body_file)
    return body_file.with_name(f"{body_file.stem}-{number}{body_file.suffix}") if number else body_file


def series_script(series: Sequence[Any]) -> Path:
    """A shell script that opens the PRs of a series in order, putting each PR's number into the
    next body in place of ``#DEPENDS_ON`` (``gh pr create`` prints the new PR's URL)."""
    from .pr_body import DEPENDS_ON

    lines = ["#!/bin/sh", "# Opens the pull requests of this series in order (metapatch pr).", "set -e"]
    for n, prepared in enumerate(series):
        if n:
            body = shlex.quote(str(prepared.body_file))
            lines.append(f'sed -i.orig "s|{DEPENDS_ON}|#$number|g" {body} && rm -f {body}.orig')
        lines += [f"url=$({prepared.command})", 'echo "$url"', 'number="${url##*/}"']
    script = series[0].body_file.parent / f"{series[0].diff.patch_id}-create-prs.sh"
    script.write_text("\n".join(lines) + "\n")
    return script


def print_series(series: Sequence[Any], skipped: List[str]) -> None:
    """What `metapatch pr` prints once every diff of a series passed (``series``: pr.Prepared)."""
    for n, prepared in enumerate(series, 1):
        print(f"== diff {n} of {len(series)}: {prepared.diff.path.name}")
        if prepared.report is not None:
            print(prepared.report.format())
        print(f"created branch {prepared.branch} from {prepared.base} with commit {prepared.commit[:12]}: {prepared.title}")
        print(f"PR body written to {prepared.body_file}")
    if skipped:
        print(f"not checked (skipped on request): {', '.join(skipped)}")
    print(f"{series[-1].branch} (the whole series) is checked out")
    print("open the pull requests in this order, each based on the one before (the script puts each one's number "
          "into the next body, in place of #DEPENDS_ON):")
    print(f"  sh {shlex.quote(str(series_script(series)))}")
    print("or one by one, replacing #DEPENDS_ON in each body by the number of the PR before it:")
    for prepared in series:
        print(f"  {prepared.command}")
