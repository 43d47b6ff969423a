"""Upstream diffs: read their DEP-3 headers, and apply them to a copy of an installed package.

Diff paths are relative to the upstream repository root (``src/accelerate/hooks.py``,
``bitsandbytes/functional.py``, ``tests/test_hooks.py``); only the sections under the installed
package's own directory can be applied to an installed copy, the rest (upstream's tests) belong to
the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

DIFFS_ROOT = Path(__file__).resolve().parent.parent / "upstream_diffs"
DEP3_FIELDS = ("Description", "Origin", "Bug", "Forwarded", "Applied-Upstream", "Last-Update")


@dataclass
class FileSection:
    path: str  # repository-relative, without a/ b/
    text: str


@dataclass
class UpstreamDiff:
    path: Path
    patch_id: str
    package: str  # import name == the diff's file stem
    header: Dict[str, str]
    sections: List[FileSection] = field(default_factory=list)

    def package_sections(self) -> List[FileSection]:
        return [s for s in self.sections if _package_relative(s.path, self.package) is not None]


def _package_relative(path: str, package: str) -> Optional[str]:
    for prefix in (f"src/{package}/", f"{package}/"):
        if path.startswith(prefix):
            return package + "/" + path[len(prefix):]
    return None


def parse(path: Path) -> UpstreamDiff:
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
        if match and match.group(1) in DEP3_FIELDS + ("Author", "Reviewed-by", "Subject"):
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
        if target:
            sections.append(FileSection(target[2:] if target.startswith("b/") else target, "".join(chunk)))
    return UpstreamDiff(path, path.parent.name, path.stem, header, sections)


def diffs_for(patch_id: str) -> List[UpstreamDiff]:
    folder = DIFFS_ROOT / patch_id
    return [parse(p) for p in sorted(folder.glob("*.diff"))] if folder.is_dir() else []


def installed_package_dir(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _run_patch(diff_text: str, directory: Path, *, reverse: bool = False, dry_run: bool = False) -> subprocess.CompletedProcess:
    args = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-r", "-", "-d", str(directory)]
    if reverse:
        args[args.index("--forward")] = "--reverse"
    if dry_run:
        args.append("--dry-run")
    return subprocess.run(args, input=diff_text, capture_output=True, text=True)


def _as_package_relative(diff: UpstreamDiff) -> str:
    """The package sections, with paths rewritten from repository-relative to package-relative
    (``a/src/accelerate/hooks.py`` -> ``a/accelerate/hooks.py``)."""
    out = []
    for section in diff.package_sections():
        rel = _package_relative(section.path, diff.package)
        text = section.text.replace(f"a/{section.path}", f"a/{rel}").replace(f"b/{section.path}", f"b/{rel}")
        out.append(text)
    return "".join(out)


def apply_to_copy(diff: UpstreamDiff, dest: Path) -> Path:
    """Copy the installed package into ``dest`` and apply the diff's package sections there.
    Returns ``dest``, to put first on ``PYTHONPATH``. Raises with patch's output if any hunk fails."""
    source = installed_package_dir(diff.package)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest / diff.package, ignore=shutil.ignore_patterns("__pycache__"))
    result = _run_patch(_as_package_relative(diff), dest)
    if result.returncode != 0:
        raise RuntimeError(f"{diff.path} does not apply to the installed {diff.package}:\n{result.stdout}{result.stderr}")
    return dest
