"""Releases inside the support window, from PyPI's JSON API, and their wheels, downloaded into the
survey cache (in parallel, verified against PyPI's sha256, reused on the next run); the wheels of a
read-only distribution (torch: gigabytes each) are read where they lie instead (:class:`RemoteWheel`)."""

from __future__ import annotations

import hashlib
import io
import json
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import cache_dir

PYPI_JSON = "https://pypi.org/pypi/{dist}/json"
INDEX_MAX_AGE_S = 6 * 3600  # a day-old release list misses at most a release or two; rerun with --refresh


def window_for(dist: str) -> Optional[str]:
    from ..tested_versions import SUPPORT_WINDOW

    return SUPPORT_WINDOW.get(dist)


def read_only_window_for(dist: str) -> Optional[str]:
    """The releases of ``dist`` whose code the survey reads without installing them (torch), or None."""
    from ..tested_versions import READ_ONLY_WINDOW

    return READ_ONLY_WINDOW.get(dist)


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


class _RangeReader(io.RawIOBase):
    """A seekable, read-only file over HTTP range requests, fetched in blocks and kept: zipfile reads a
    wheel's central directory at its end, then only the members asked for."""

    _BLOCK = 1 << 18

    def __init__(self, url: str) -> None:
        super().__init__()
        self._url = url
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as response:
            self._size = int(response.headers["Content-Length"])
        self._position = 0
        self._blocks: Dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def _block(self, index: int) -> bytes:
        if index not in self._blocks:
            start = index * self._BLOCK
            end = min(self._size, start + self._BLOCK) - 1
            request = urllib.request.Request(self._url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=120) as response:
                data = response.read()
            if response.status != 206 and len(data) != end - start + 1:
                raise IOError(f"{self._url}: the server ignored a range request")
            self._blocks[index] = data
        return self._blocks[index]

    def readinto(self, buffer: Any) -> int:
        wanted = min(len(buffer), max(0, self._size - self._position))
        done = 0
        while done < wanted:
            index, offset = divmod(self._position, self._BLOCK)
            chunk = self._block(index)[offset:offset + wanted - done]
            buffer[done:done + len(chunk)] = chunk
            done += len(chunk)
            self._position += len(chunk)
        return done


class RemoteWheel:
    """A wheel on the index, opened like a downloaded one (``open("rb")``) but read by range requests:
    the survey needs a few modules' source out of a torch wheel of gigabytes. PyPI's sha256 covers the
    whole file, so it cannot be checked here; what is read is the index's own file over HTTPS."""

    def __init__(self, url: str, filename: str) -> None:
        self.url = url
        self.name = filename
        self.suffix = Path(filename).suffix

    def open(self, mode: str = "rb") -> io.BufferedReader:
        if mode != "rb":
            raise ValueError("a remote wheel is read only")
        return io.BufferedReader(_RangeReader(self.url), buffer_size=1 << 16)

    def __repr__(self) -> str:
        return f"RemoteWheel({self.name!r})"


def archive_path(dist: str, version: str) -> Any:
    """The downloaded wheel (or sdist) of one release, a ``Path`` (downloaded if it is not cached yet); for a
    read-only distribution a :class:`RemoteWheel` (nothing downloaded)."""
    files = _index(dist)["releases"].get(version) or []
    chosen = _pick_file(files)
    if chosen is None:
        raise FileNotFoundError(f"PyPI lists no usable file for {dist} {version}")
    if read_only_window_for(dist) and chosen["filename"].endswith(".whl"):
        return RemoteWheel(urllib.parse.urljoin(PYPI_JSON.format(dist=dist), chosen["url"]), chosen["filename"])
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
    """Download every release's archive in parallel (a read-only distribution's: found, not downloaded):
    {version: (path or None, error text)}."""
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
