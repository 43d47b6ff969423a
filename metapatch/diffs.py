"""Upstream diffs: read their DEP-3 headers, apply them to a copy of an installed package, and
check them against the installed package (still needed, fixed upstream, or drifted).

Diff paths are relative to the upstream repository root (``src/accelerate/hooks.py``,
``bitsandbytes/functional.py``, ``tests/test_hooks.py``); only the sections under the installed
package's own directory can be applied to an installed copy, the rest (upstream's tests) belong to
the repository.

A patch has one diff per package, ``<id>/<package>.diff``, or an ordered series of them, one pull
request each, ``<id>/<package>-<N>-<slug>.diff`` (N = 1, 2, ...): diff N is written on top of diffs
1..N-1. "The patch's diff" for a package is then the whole series: :func:`apply_to_copy` applies it
in order, and :func:`check` checks diff N on top of the ones before it.

The folder of diffs is ``upstream_diffs/`` next to the ``metapatch`` package; the environment
variable ``METAPATCH_DIFFS_ROOT`` points it elsewhere (the tests use it for synthetic fixtures).
Nothing here touches an installed package: checks run on temporary copies of the touched files.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from ._framework.diff_files import (DEP3_FIELDS, DIFFS_ROOT, DIFFS_ROOT_ENV, EXTRA_FIELDS, FileSection,  # noqa: F401
                                    UpstreamDiff, all_diff_paths, diff_paths_of, diffs_for, diffs_root, name_parts,
                                    package_relative, parse, resolve_diff_path, series_of, series_problem)
from ._framework.records import PROJECTS  # noqa: F401

# Verdicts of check(): what the installed package says about a diff.
APPLIES = "applies"                # the installed code still has the bug
FIXED_UPSTREAM = "fixed-upstream"  # the diff applies in reverse: the installed code has the fix
DRIFTED = "drifted"                # neither: upstream moved the code (failing hunks are reported)
NOT_INSTALLED = "not-installed"    # nothing to check against
INVALID = "invalid"                # the diff has no section for its package's own files
VERDICTS = (APPLIES, FIXED_UPSTREAM, DRIFTED, NOT_INSTALLED, INVALID)

# Packages that live in a sub-folder of their upstream repository (gguf is llama.cpp's gguf-py/gguf/):
# read from the project records.
PACKAGE_FOLDERS = {name: p.package_folder for name, p in PROJECTS.items() if p.package_folder != "src/"}

def installed_package_dir(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def distribution_of(package: str) -> str:
    """The distribution that installs import package ``package`` (``bitsandbytes`` ->
    ``bitsandbytes``); the import name itself when nothing installed claims it."""
    import importlib.metadata

    try:
        owners = importlib.metadata.packages_distributions().get(package) or []
    except Exception:  # broken metadata of some unrelated distribution must not stop a check
        owners = []
    return owners[0] if owners else package


def installed_version(distribution: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_patch(diff_text: str, directory: Path, *, reverse: bool = False, dry_run: bool = False) -> subprocess.CompletedProcess:
    # --forward stays in reverse mode too: with --batch, GNU patch otherwise "assumes -R" for a
    # hunk that looks reversed, and a reverse check would silently apply the diff forwards.
    args = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-", "-d", str(directory)]
    if reverse:
        args.append("--reverse")
    if dry_run:
        args.append("--dry-run")
    return subprocess.run(args, input=diff_text, capture_output=True, text=True)


def _rewrite_section(section: FileSection, package: str) -> str:
    """``a/src/accelerate/hooks.py`` -> ``a/accelerate/hooks.py``: package-relative paths."""
    rel = package_relative(section.path, package)
    return section.text.replace(f"a/{section.path}", f"a/{rel}").replace(f"b/{section.path}", f"b/{rel}")


def _as_package_relative(diff: UpstreamDiff) -> str:
    """The package sections, with paths rewritten from repository-relative to package-relative
    (``a/src/accelerate/hooks.py`` -> ``a/accelerate/hooks.py``)."""
    return "".join(_rewrite_section(section, diff.package) for section in diff.package_sections())


def apply_to_copy(diffs: Union[UpstreamDiff, Iterable[UpstreamDiff]], dest: Path) -> Path:
    """Copy each installed package the diff(s) touch into ``dest`` and apply their package sections
    there, a series in order (diff N on top of 1..N-1). Returns ``dest``, to put first on
    ``PYTHONPATH``. Raises with patch's output if any hunk fails."""
    dest.mkdir(parents=True, exist_ok=True)
    for series in series_of([diffs] if isinstance(diffs, UpstreamDiff) else diffs):
        package = series[0].package
        shutil.copytree(installed_package_dir(package), dest / package, ignore=shutil.ignore_patterns("__pycache__"))
        for position, diff in enumerate(series, 1):
            result = _run_patch(_as_package_relative(diff), dest)
            if result.returncode != 0:
                on_top = f" (on top of the {position - 1} diff(s) before it in its series)" if position > 1 else ""
                raise RuntimeError(f"{diff.path} does not apply to the installed {package}{on_top}:\n"
                                   f"{result.stdout}{result.stderr}")
    return dest


# ---------------------------------------------------------------------------------------------
# Checking a diff against the installed package


@dataclass
class HunkFailure:
    number: int  # 1-based, as GNU patch counts them within a file
    text: str


@dataclass
class FileCheck:
    path: str  # repository-relative
    result: str  # "applies", "reversed", "missing" (file not in the installed package), "failed"
    failed_hunks: List[HunkFailure] = field(default_factory=list)
    reversed_hunks: List[int] = field(default_factory=list)  # already in the installed code
    notes: List[str] = field(default_factory=list)  # offsets and fuzz patch needed

    def to_dict(self) -> dict:
        return {"path": self.path, "result": self.result, "notes": list(self.notes),
                "reversed_hunks": list(self.reversed_hunks),
                "failed_hunks": [{"number": h.number, "text": h.text} for h in self.failed_hunks]}


@dataclass
class DiffCheck:
    diff: UpstreamDiff
    verdict: str
    distribution: str
    installed: Optional[str]
    files: List[FileCheck] = field(default_factory=list)
    detail: str = ""

    def to_dict(self) -> dict:
        return {"patch_id": self.diff.patch_id, "package": self.diff.package, "series_index": self.diff.series_index,
                "distribution": self.distribution, "installed": self.installed,
                "verdict": self.verdict, "detail": self.detail,
                "files": [f.to_dict() for f in self.files]}


_SUCCEEDED = re.compile(r"Hunk #(\d+) succeeded at (\d+)(?: with fuzz (\d+))?(?: \(offset (-?\d+) lines?\))?")


def _fuzz(output: str) -> int:
    return sum(int(m.group(3) or 0) for m in _SUCCEEDED.finditer(output))


def _notes(output: str) -> List[str]:
    return [f"hunk #{m.group(1)} at line {m.group(2)}"
            + (f" with fuzz {m.group(3)}" if m.group(3) else "")
            + (f" (offset {m.group(4)})" if m.group(4) else "")
            for m in _SUCCEEDED.finditer(output)]


def _check_section(section: FileSection, package: str, package_dir: Path,
                   earlier: Sequence[Tuple[Optional[int], FileSection]] = ()) -> FileCheck:
    """``earlier``: (series number, section) of the same file in the diffs before this one in its
    series, applied to the copy first (one that does not apply, e.g. already upstream, is left out,
    with a note)."""
    rel = package_relative(section.path, package)
    installed_file = package_dir / rel.split("/", 1)[1]
    if not installed_file.is_file() and not section.creates and not any(e.creates for _, e in earlier):
        return FileCheck(section.path, "missing",
                         failed_hunks=[HunkFailure(n, h) for n, h in enumerate(section.hunks(), 1)],
                         notes=[f"{installed_file} does not exist in the installed package"])
    text = _rewrite_section(section, package)
    with tempfile.TemporaryDirectory(prefix="metapatch-diffcheck-") as tmp:
        copy = Path(tmp) / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        if installed_file.is_file():
            shutil.copyfile(installed_file, copy)
        base_notes = []
        for number, previous in earlier:
            previous_text = _rewrite_section(previous, package)
            # all or nothing: a partly applied earlier diff would make this one's verdict meaningless
            if _run_patch(previous_text, Path(tmp), dry_run=True).returncode == 0:
                _run_patch(previous_text, Path(tmp))
            else:
                there = _run_patch(previous_text, Path(tmp), reverse=True, dry_run=True).returncode == 0
                base_notes.append(f"diff {number} of the series is " + ("already in this file" if there else
                                  "not applicable to this file (drifted)") + ": checked on top of the file without it")
        forward = _run_patch(text, Path(tmp), dry_run=True)
        backward = _run_patch(text, Path(tmp), reverse=True, dry_run=True)
        if forward.returncode == 0 and (backward.returncode != 0 or _fuzz(forward.stdout) <= _fuzz(backward.stdout)):
            return FileCheck(section.path, "applies", notes=base_notes + _notes(forward.stdout))
        if backward.returncode == 0:
            return FileCheck(section.path, "reversed", notes=base_notes + _notes(backward.stdout))
        checked = _diagnose_hunks(section, text, Path(tmp))
        checked.notes = base_notes + checked.notes
        return checked


def _diagnose_hunks(section: FileSection, text: str, directory: Path) -> FileCheck:
    """Neither direction applies as a whole: try each hunk alone, to tell hunks upstream already
    has (partly fixed) from hunks whose context moved (drift)."""
    rewritten = FileSection(section.path, text)
    header = rewritten.header()
    failed, already = [], []
    for number, (hunk, original) in enumerate(zip(rewritten.hunks(), section.hunks()), 1):
        if _run_patch(header + hunk, directory, dry_run=True).returncode == 0:
            continue
        if _run_patch(header + hunk, directory, reverse=True, dry_run=True).returncode == 0:
            already.append(number)
        else:
            failed.append(HunkFailure(number, original))
    if not failed and already:
        note = f"hunk(s) {', '.join(map(str, already))} already upstream, the others not: partly fixed upstream"
    elif not failed:
        note = "every hunk applies alone but not all together (overlapping hunks)"
    else:
        note = f"{len(failed)} of {len(section.hunks())} hunk(s) fail in both directions"
    return FileCheck(section.path, "failed", failed_hunks=failed, reversed_hunks=already, notes=[note])


def check(diff: UpstreamDiff, previous: Sequence[UpstreamDiff] = ()) -> DiffCheck:
    """Compare ``diff`` with the installed package (on temporary copies of the touched files); for
    diff N of a series, ``previous`` are diffs 1..N-1, applied to the copies first.

    ``applies``: every package file takes the diff forwards (the bug is present);
    ``fixed-upstream``: every one takes it in reverse (the installed code already has the fix);
    ``drifted``: anything else, with the failing hunks; ``not-installed``; ``invalid``."""
    distribution = distribution_of(diff.package)
    version = installed_version(distribution)
    try:
        package_dir = installed_package_dir(diff.package)
    except (FileNotFoundError, ImportError, ValueError):
        return DiffCheck(diff, NOT_INSTALLED, distribution, version,
                         detail=f"{diff.package} is not installed: nothing to check against")
    sections = diff.package_sections()
    if not sections:
        paths = ", ".join(s.path for s in diff.sections) or "none"
        return DiffCheck(diff, INVALID, distribution, version,
                         detail=f"no section touches {diff.package}'s own files (src/{diff.package}/ or "
                                f"{diff.package}/); sections: {paths}")
    earlier = {s.path: [] for s in sections}
    for earlier_diff in previous:
        for section in earlier_diff.package_sections():
            if section.path in earlier:
                earlier[section.path].append((earlier_diff.series_index, section))
    files = [_check_section(section, diff.package, package_dir, earlier[section.path]) for section in sections]
    results = {f.result for f in files}
    label = f"{distribution} {version or '(unknown version)'}"
    if results == {"applies"}:
        on_top = (f" on top of diff {len(previous)} of its series" if len(previous) == 1 else
                  f" on top of diffs 1..{len(previous)} of its series" if previous else "")
        return DiffCheck(diff, APPLIES, distribution, version, files,
                         f"applies to the installed {label}{on_top}: the bug is present")
    if results == {"reversed"}:
        return DiffCheck(diff, FIXED_UPSTREAM, distribution, version, files,
                         f"applies in reverse to the installed {label}: fixed upstream")
    bad = [f.path for f in files if f.result not in ("applies",)]
    return DiffCheck(diff, DRIFTED, distribution, version, files,
                     f"does not apply to the installed {label} in either direction ({', '.join(bad)})")


def check_series(series: Sequence[UpstreamDiff]) -> List[DiffCheck]:
    """One check per diff of a series (one package's diffs, in order): diff N on top of 1..N-1."""
    return [check(diff, previous=series[:n]) for n, diff in enumerate(series)]
