"""Releases inside the support window, from PyPI's JSON API, and their wheels, downloaded into the
survey cache (in parallel, verified against PyPI's sha256, reused on the next run)."""

from __future__ import annotations

import hashlib
import json
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import cache_dir

PYPI_JSON = "https://pypi.org/pypi/{dist}/json"
INDEX_MAX_AGE_S = 6 * 3600  # a day-old release list misses at most a release or two; rerun with --refresh


def window_for(dist: str) -> Optional[str]:
    from ..tested_versions import SUPPORT_WINDOW

    return SUPPORT_WINDOW.get(dist)


def _index(dist: str, refresh: bool = False) -> dict:
    path = cache_dir() / "pypi" / f"{dist}.json"
    if path.exists() and not refresh and time.time() - path.stat().st_mtime < INDEX_MAX_AGE_S:
        return json.loads(path.read_text())
    try:
        with urllib.request.urlopen(PYPI_JSON.format(dist=dist), timeout=60) as response:
            data = json.loads(response.read())
    except OSError as exc:
        if path.exists():  # offline: an older list is better than none (its age is on the file)
            sys.stderr.write(f"metapatch survey: PyPI unreachable ({exc}); using the cached release list of {dist}\n")
            return json.loads(path.read_text())
        raise
    slim = {"releases": {v: [{k: f.get(k) for k in ("filename", "url", "packagetype", "yanked", "digests")}
                             for f in files] for v, files in data["releases"].items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(slim, sort_keys=True))
    return slim


def releases_in_window(dist: str, refresh: bool = False, window: Optional[str] = None) -> List[str]:
    """Final, non-yanked releases of ``dist`` inside its support window (or ``window``), oldest first."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    window = SpecifierSet(window or window_for(dist) or "")
    found = []
    for version, files in _index(dist, refresh)["releases"].items():
        try:
            parsed = Version(version)
        except InvalidVersion:
            continue
        if parsed.is_prerelease or parsed.is_devrelease or not files or all(f.get("yanked") for f in files):
            continue
        if parsed in window and _pick_file(files) is not None:
            found.append(parsed)
    return [str(v) for v in sorted(found)]


def _pick_file(files: Sequence[dict]) -> Optional[dict]:
    """A pure-Python wheel if there is one, else a Linux x86-64 wheel (bitsandbytes ships only
    platform wheels; their Python sources are the same), else any wheel, else the sdist."""
    usable = [f for f in files if not f.get("yanked")]
    ranked = (
        [f for f in usable if f["filename"].endswith("-none-any.whl")],
        [f for f in usable if f["filename"].endswith(".whl") and "x86_64" in f["filename"]],
        [f for f in usable if f["filename"].endswith(".whl")],
        [f for f in usable if f.get("packagetype") == "sdist"],
    )
    for group in ranked:
        if group:
            return sorted(group, key=lambda f: f["filename"])[0]
    return None


def archive_path(dist: str, version: str) -> Path:
    """The downloaded wheel (or sdist) of one release; downloads it if it is not cached yet."""
    files = _index(dist)["releases"].get(version) or []
    chosen = _pick_file(files)
    if chosen is None:
        raise FileNotFoundError(f"PyPI lists no usable file for {dist} {version}")
    path = cache_dir() / "archives" / dist / chosen["filename"]
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    digest = hashlib.sha256()
    url = urllib.parse.urljoin(PYPI_JSON.format(dist=dist), chosen["url"])  # some indexes give relative links
    with urllib.request.urlopen(url, timeout=300) as response, open(partial, "wb") as out:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
            out.write(block)
    expected = (chosen.get("digests") or {}).get("sha256")
    if expected and digest.hexdigest() != expected:
        partial.unlink()
        raise IOError(f"{chosen['filename']}: sha256 {digest.hexdigest()} != PyPI's {expected}")
    partial.replace(path)  # atomic: an interrupted download never looks finished
    return path


class Progress:
    """One self-overwriting status line on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, label: str, total: int, stream=None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] {self.label}: {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line + ("\n" if self.done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def fetch_all(dist: str, versions: Sequence[str], workers: int = 4,
              on_done: Optional[Callable[[str], None]] = None) -> Dict[str, Tuple[Optional[Path], str]]:
    """Download every release's archive in parallel: {version: (path or None, error text)}."""
    results: Dict[str, Tuple[Optional[Path], str]] = {}

    def one(version: str) -> Tuple[str, Optional[Path], str]:
        try:
            return version, archive_path(dist, version), ""
        except Exception as exc:  # noqa: BLE001 - reported in the table, the survey goes on
            return version, None, f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for version, path, error in pool.map(one, versions):
            results[version] = (path, error)
            if on_done:
                on_done(f"{dist} {version}" + (f" FAILED {error}" if error else ""))
    return results
