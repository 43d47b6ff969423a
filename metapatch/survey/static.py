"""Fingerprints read statically: the source of ``module:Qual.name`` located in the module's AST,
from a downloaded wheel (or sdist) or from an installed package's file, and hashed with the very
normalisation the runtime check uses (:func:`metapatch._framework.fingerprints.fingerprint_source`).

The segment is what ``inspect.getsource`` returns: a function or class from its first decorator to
its last line. Definitions nested in module- or class-level ``if``/``try``/``with`` blocks count, and
where a name is defined twice the later definition wins, as it does when the module runs.
"""

from __future__ import annotations

import ast
import hashlib
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .._framework.fingerprints import fingerprint_source
from . import cache_dir

ABSENT = "absent"  # the module or the object does not exist in that release
MODULE_ABSENT = "absent-module"
UNREADABLE = "unreadable"  # the module does not parse (a syntax newer than this Python)

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BLOCKS = (ast.If, ast.Try, ast.With)


def _definitions(body: Iterable[ast.stmt]) -> Dict[str, ast.AST]:
    """Names defined by def/class at this level (looking into if/try/with blocks); last wins."""
    found: Dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, _DEFS):
            found[node.name] = node
        elif isinstance(node, _BLOCKS) or type(node).__name__ == "TryStar":
            for field in ("body", "orelse", "finalbody"):
                found.update(_definitions(getattr(node, field, None) or []))
            for handler in getattr(node, "handlers", None) or []:
                found.update(_definitions(handler.body))
    return found


def locate(source: str, qualname: str) -> Optional[str]:
    """The source segment of ``qualname`` (``"Class.method"``) in a module's source, or None."""
    tree = ast.parse(source)
    node: Optional[ast.AST] = None
    body: List[ast.stmt] = tree.body
    for part in qualname.split("."):
        node = _definitions(body).get(part)
        if node is None:
            return None
        body = getattr(node, "body", [])
    lines = source.splitlines(keepends=True)
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    return "".join(lines[first - 1:node.end_lineno])


def fingerprint_in_source(source: Optional[str], qualname: str) -> str:
    if source is None:
        return MODULE_ABSENT
    try:
        segment = locate(source, qualname)
    except SyntaxError:
        return UNREADABLE
    return ABSENT if segment is None else fingerprint_source(segment)


def _module_files(module: str) -> List[str]:
    base = module.replace(".", "/")
    return [base + ".py", base + "/__init__.py"]


def read_module_from_archive(archive: Any, module: str) -> Optional[str]:
    """A module's source from a wheel (``pkg/mod.py``) or an sdist (``name-1.0/[src/]pkg/mod.py``);
    ``archive`` is a ``Path`` or anything that opens like one (a ``releases.RemoteWheel``)."""
    wanted = _module_files(module)
    if archive.name.endswith(".whl") or archive.suffix == ".zip":
        with archive.open("rb") as handle, zipfile.ZipFile(handle) as zf:
            names = set(zf.namelist())
            for name in wanted:
                if name in names:
                    return zf.read(name).decode("utf-8")
            for name in sorted(names):  # an sdist as .zip: a leading folder, perhaps src/
                if any(name.endswith("/" + w) and name.count("/") <= w.count("/") + 2 for w in wanted):
                    return zf.read(name).decode("utf-8")
        return None
    with tarfile.open(archive) as tf:
        for member in tf.getmembers():
            if any(member.name.endswith("/" + w) and member.name.count("/") <= w.count("/") + 2 for w in wanted):
                handle = tf.extractfile(member)
                return handle.read().decode("utf-8") if handle else None
    return None


def read_module_from_site(site_packages: Path, module: str) -> Optional[str]:
    """A module's source from an installed package, located by path (nothing is imported)."""
    for name in _module_files(module):
        path = Path(site_packages) / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def imported_from(source: str, name: str, module: str, is_package: bool) -> Optional[Tuple[str, str]]:
    """(module, name) that a module-level ``from X import name [as alias]`` binds ``name`` to."""
    found = None
    for node in _walk_level(ast.parse(source).body):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = module if is_package else module.rpartition(".")[0]
                    for _ in range(max(0, node.level - 1)):
                        base = base.rpartition(".")[0]
                    target = node.module or ""
                    found = (f"{base}.{target}".strip(".") if node.level else target, alias.name)
    return found


def _walk_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    for node in body:
        yield node
        if isinstance(node, _BLOCKS) or type(node).__name__ == "TryStar":
            for field in ("body", "orelse", "finalbody"):
                yield from _walk_level(getattr(node, field, None) or [])
            for handler in getattr(node, "handlers", None) or []:
                yield from _walk_level(handler.body)


def fingerprints(read_module, targets: Iterable[str]) -> Dict[str, str]:
    """{"module:Qual.name": fingerprint} with ``read_module(module) -> source or None``.

    A first name the module does not define but imports (``from .integrations.accelerate import
    _get_device_map``) is followed to where it is defined, as ``getattr(module, name)`` would."""
    sources: Dict[str, Optional[str]] = {}

    def read(module: str) -> Optional[str]:
        if module not in sources:
            sources[module] = read_module(module)
        return sources[module]

    def measure(module: str, qualname: str, hops: int = 0) -> str:
        source = read(module)
        result = fingerprint_in_source(source, qualname)
        if result == ABSENT and source is not None and hops < 5:
            first, _, rest = qualname.partition(".")
            origin = imported_from(source, first, module, read(module + ".__init__") is not None)
            if origin is not None:
                return measure(origin[0], ".".join(filter(None, (origin[1], rest))), hops + 1)
        return result

    return {dotted: measure(*dotted.split(":", 1)) for dotted in targets}


def archive_fingerprints(dist: str, version: str, archive: Any, targets: Iterable[str]) -> Dict[str, str]:
    """Fingerprints for one release, cached per release (a wheel never changes): only targets not
    measured before are read."""
    from .._framework.fingerprints import __file__ as normaliser

    targets = list(targets)
    path = cache_dir() / "static" / dist / f"{version}.json"
    # the normalisation or this reader changed: measure again
    stamp = hashlib.sha256(Path(normaliser).read_bytes() + Path(__file__).read_bytes()).hexdigest()[:12]
    cached = json.loads(path.read_text()) if path.exists() else {}
    if cached.get("_normaliser") != stamp:
        cached = {"_normaliser": stamp}
    missing = [t for t in targets if t not in cached]
    if missing:
        cached.update(fingerprints(lambda m: read_module_from_archive(archive, m), missing))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, sort_keys=True, indent=1))
    return {t: cached[t] for t in targets}


def installed_fingerprints(targets: Iterable[str]) -> Dict[str, str]:
    """Static fingerprints of the installed packages of the running interpreter: the module file is
    found by ``importlib.util.find_spec`` of its top-level package (which imports nothing below it)
    and read like a wheel's file."""
    import importlib.util

    def read_module(module: str) -> Optional[str]:
        top = module.split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            return None
        return read_module_from_site(Path(list(spec.submodule_search_locations)[0]).parent, module)

    return fingerprints(read_module, targets)
