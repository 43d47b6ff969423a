"""Upstream diffs as files: where they live, their DEP-3 header and sections, and how a series is named.

A patch has one diff per package, ``upstream_diffs/<id>/<package>.diff``, or a series of them, one pull
request each, ``<id>/<package>-<N>-<slug>.diff``. The folder is ``upstream_diffs/`` next to the
``metapatch`` package; ``METAPATCH_DIFFS_ROOT`` points it elsewhere (the tests use it for synthetic
fixtures). A patch record's ``diffs`` are what :func:`diff_paths_of` finds here. Reading only: applying
and checking are :mod:`metapatch.diffs`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

DIFFS_ROOT = Path(__file__).resolve().parents[2] / "upstream_diffs"
DIFFS_ROOT_ENV = "METAPATCH_DIFFS_ROOT"
DEP3_FIELDS = ("Description", "Origin", "Bug", "Forwarded", "Applied-Upstream", "Last-Update")
# Optional, metapatch's own: the upstream release the diff was written against (a PR targets main; on
# older releases the code around the fix may differ, see commands/diffs.judge).
EXTRA_FIELDS = ("Author", "Reviewed-by", "Subject", "Upstream-Base")



@dataclass
class FileSection:
    path: str  # repository-relative, without a/ b/
    text: str

    @property
    def creates(self) -> bool:
        return any(line.startswith("--- /dev/null") for line in self.text.splitlines())

    def hunks(self) -> List[str]:
        """Each ``@@`` hunk's text, in order (hunk #1 is ``hunks()[0]``)."""
        lines = self.text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.startswith("@@ ")]
        return ["".join(lines[b:starts[n + 1] if n + 1 < len(starts) else len(lines)]) for n, b in enumerate(starts)]

    def header(self) -> str:
        """Everything before the first hunk (``diff --git``, ``---``, ``+++`` lines)."""
        lines = self.text.splitlines(keepends=True)
        first = next((i for i, line in enumerate(lines) if line.startswith("@@ ")), len(lines))
        return "".join(lines[:first])


@dataclass
class UpstreamDiff:
    path: Path
    patch_id: str
    package: str  # import name: the diff's file stem, or its part before "-<N>-" in a series
    header: Dict[str, str]
    sections: List[FileSection] = field(default_factory=list)
    series_index: Optional[int] = None  # N of ``<package>-<N>-<slug>.diff``; None for ``<package>.diff``

    def package_sections(self) -> List[FileSection]:
        return [s for s in self.sections if package_relative(s.path, self.package) is not None]

    def other_sections(self) -> List[FileSection]:
        """Sections outside the package (upstream's tests, docs): they only apply to a clone."""
        return [s for s in self.sections if package_relative(s.path, self.package) is None]

    @property
    def description(self) -> Tuple[str, str]:
        """(subject, body) of the DEP-3 Description (or Subject); a ``.`` line is a blank line."""
        text = self.header.get("Description") or self.header.get("Subject") or ""
        lines = ["" if line.strip() == "." else line for line in text.splitlines()]
        subject = lines[0].strip() if lines else ""
        return subject, "\n".join(lines[1:]).strip()

    @property
    def text(self) -> str:
        return self.path.read_text()


# ``peft-2-keep-placement`` -> ("peft", 2); import names have no "-", so the first one ends the package.
_SERIES_STEM = re.compile(r"^(?P<package>[A-Za-z_][A-Za-z0-9_]*)-(?P<index>[0-9]+)(?:-[A-Za-z0-9_.-]+)?$")


def name_parts(path: "Path | str") -> Tuple[str, Optional[int]]:
    """(package, position in its series or None) from a diff's file name."""
    stem = Path(path).stem
    match = _SERIES_STEM.match(stem)
    return (match.group("package"), int(match.group("index"))) if match else (stem, None)


def _order(diff: "UpstreamDiff") -> Tuple[str, int, str]:
    return diff.package, diff.series_index or 0, diff.path.name


def series_of(diffs: Iterable["UpstreamDiff"]) -> List[List["UpstreamDiff"]]:
    """The diffs grouped by package, each group in series order (a plain ``<package>.diff`` is a
    series of one); groups sorted by package."""
    groups: Dict[str, List[UpstreamDiff]] = {}
    for diff in sorted(diffs, key=_order):
        groups.setdefault(diff.package, []).append(diff)
    return list(groups.values())


def series_problem(series: Sequence["UpstreamDiff"]) -> Optional[str]:
    """Why a package's diffs do not form a series 1..M (None: they do)."""
    if len(series) == 1 and series[0].series_index in (None, 1):
        return None
    numbers = [d.series_index for d in series]
    if None in numbers or numbers != list(range(1, len(series) + 1)):
        names = ", ".join(d.path.name for d in series)
        return (f"the {series[0].package} diffs ({names}) are not a series numbered 1..{len(series)}: name them "
                f"{series[0].package}-1-<what>.diff, {series[0].package}-2-<what>.diff, ...")
    return None


def package_relative(path: str, package: str) -> Optional[str]:
    from .records import project_of

    for prefix in (f"src/{package}/", f"{package}/", f"{project_of(package).package_folder}{package}/"):
        if path.startswith(prefix):
            return package + "/" + path[len(prefix):]
    return None


def diffs_root() -> Path:
    """Where the diffs live: ``$METAPATCH_DIFFS_ROOT`` if set, else the project's upstream_diffs/
    (a source checkout or editable install), else ``metapatch/upstream_diffs`` should a wheel ship
    them as package data."""
    override = os.environ.get(DIFFS_ROOT_ENV, "").strip()
    if override:
        return Path(override)
    packaged = Path(__file__).resolve().parents[1] / "upstream_diffs"
    return packaged if not DIFFS_ROOT.is_dir() and packaged.is_dir() else DIFFS_ROOT


def resolve_diff_path(relative: str) -> Path:
    """A ``Patch.diffs`` entry (``upstream_diffs/<id>/<package>.diff``) as a file path, honouring
    ``$METAPATCH_DIFFS_ROOT``."""
    path = Path(relative)
    if path.is_absolute():
        return path
    parts = path.parts
    if parts and parts[0] == "upstream_diffs":
        return diffs_root().joinpath(*parts[1:])
    return DIFFS_ROOT.parent / path


def parse(path: Path) -> UpstreamDiff:
    path = Path(path)
    text = path.read_text()
    header: Dict[str, str] = {}
    lines = text.splitlines(keepends=True)
    body_start = len(lines)
    current_key = None
    for i, line in enumerate(lines):
        if line.startswith("diff --git ") or line.startswith("--- "):
            body_start = i
            break
        match = re.match(r"^([A-Za-z-]+):\s?(.*)$", line.rstrip("\n"))
        if match and match.group(1) in DEP3_FIELDS + EXTRA_FIELDS:
            current_key = match.group(1)
            header[current_key] = match.group(2).strip()
        elif current_key and line.startswith(" "):
            header[current_key] += "\n" + line.strip()
    body = lines[body_start:]
    git_style = any(line.startswith("diff --git ") for line in body)
    starts = [i for i, line in enumerate(body)
              if (line.startswith("diff --git ") if git_style
                  else line.startswith("--- ") and i + 1 < len(body) and body[i + 1].startswith("+++ "))]
    sections: List[FileSection] = []
    for n, begin in enumerate(starts):
        chunk = body[begin:starts[n + 1] if n + 1 < len(starts) else len(body)]
        target = next((l[4:].strip().split("\t")[0] for l in chunk if l.startswith("+++ ")), None)
        if target == "/dev/null":  # a deletion: the file is named on the --- line
            target = next((l[4:].strip().split("\t")[0] for l in chunk if l.startswith("--- ")), None)
            target = target[2:] if target and target.startswith("a/") else target
        if target:
            sections.append(FileSection(target[2:] if target.startswith("b/") else target, "".join(chunk)))
    package, index = name_parts(path)
    return UpstreamDiff(path, path.parent.name, package, header, sections, index)


def diffs_for(patch_id: str) -> List[UpstreamDiff]:
    """The patch's diffs in the diffs folder, by package and in series order."""
    folder = diffs_root() / patch_id
    return sorted((parse(p) for p in folder.glob("*.diff")), key=_order) if folder.is_dir() else []


def diff_paths_of(patch_id: str) -> Tuple[str, ...]:
    """``Patch.diffs`` of a record that does not list them: ``upstream_diffs/<id>/<file>`` for every
    diff in the patch's folder, by package and in series order (as :func:`diffs_for`), without parsing."""
    folder = diffs_root() / patch_id
    if not folder.is_dir():
        return ()
    found = sorted(folder.glob("*.diff"), key=lambda p: (name_parts(p)[0], name_parts(p)[1] or 0, p.name))
    return tuple(f"upstream_diffs/{patch_id}/{path.name}" for path in found)


def all_diff_paths() -> List[Path]:
    """Every ``<patch-id>/<package>[-<N>-<slug>].diff`` under the diffs root."""
    root = diffs_root()
    return sorted(root.glob("*/*.diff")) if root.is_dir() else []
