"""Throw-away venvs per combination of versions, and the reproducer runs in them.

A venv is ``python3 -m venv --system-site-packages`` (torch comes from the base interpreter and is
never named to pip; where the base has none, the running interpreter's torch release is pinned, see
:func:`torch_pin`), keyed by its pins, and kept in the survey cache: the next survey that needs
the same combination reuses it. When pip cannot resolve a combination the combination is recorded
``uninstallable`` with pip's reason: a measured fact about the ecosystem, not a failure.
Results are cached per (patch, combination, patch source), so a rerun only runs what changed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping

from . import cache_dir

REPO = Path(__file__).resolve().parents[2]  # the probe runs from here, so this very metapatch is imported
EXTRAS = ("safetensors", "wrapt", "packaging")  # what the reproducers need besides the pinned stack
UNINSTALLABLE_MARKERS = ("ResolutionImpossible", "conflicting dependencies", "No matching distribution",
                         "Could not find a version")


def _key(pins: Mapping[str, str]) -> str:
    text = ",".join(f"{d}=={v}" for d, v in sorted(pins.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def base_python() -> str:
    """The interpreter venvs are made from: ``$METAPATCH_SURVEY_PYTHON``, else the base of the
    running one (whose site-packages carry torch)."""
    return os.environ.get("METAPATCH_SURVEY_PYTHON") or getattr(sys, "_base_executable", sys.executable)


@functools.lru_cache(maxsize=None)
def torch_pin() -> Dict[str, str]:
    """``{"torch": release}`` when the base interpreter has no torch, else ``{}``. Unpinned, pip resolves
    the stack's ``torch`` requirement to its newest release (a CUDA build of gigabytes, another torch than
    the suite's: on a machine whose pip is capped at 2.14.1, every venv got 2.14.1); pinned to the running
    interpreter's release (a local ``+cpu`` label dropped), the runs measure the torch the tests use."""
    import importlib.metadata

    has_torch = subprocess.run([base_python(), "-c", "import importlib.util as u, sys; "
                                "sys.exit(u.find_spec('torch') is None)"], capture_output=True).returncode == 0
    try:
        running = importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        running = ""
    return {"torch": running} if running and not has_torch else {}


_LOCKS: Dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def ensure_venv(pins: Mapping[str, str], log=None) -> Dict[str, Any]:
    """{"status": "ready", "python": path} or {"status": "uninstallable"|"install-error", "reason"}.
    Thread-safe per venv: the prefetcher may be building the one a run is waiting for."""
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(_key(pins), threading.Lock())
    with lock, _across_processes(pins):
        return _ensure_venv(pins, log)


@contextmanager
def _across_processes(pins: Mapping[str, str]) -> Iterator[None]:
    """Two surveys running at once (one per core) may need the same venv: without this the second
    takes the first one's half-built venv for an interrupted build and deletes it."""
    locks = cache_dir() / "venvs" / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / _key(pins), "w") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: one survey at a time
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prefetch(all_pins: List[Mapping[str, str]], log=None) -> threading.Thread:
    """Build venvs ahead of the runs in one background thread: pip waits on the network while a
    reproducer uses the CPU, so the two overlap."""
    def build() -> None:
        for pins in all_pins:
            try:
                ensure_venv(pins, log)
            except Exception:  # noqa: BLE001 - the run itself will build it again and report
                pass

    thread = threading.Thread(target=build, name="metapatch-survey-prefetch", daemon=True)
    thread.start()
    return thread


def _ensure_venv(pins: Mapping[str, str], log=None) -> Dict[str, Any]:
    pins = {**torch_pin(), **pins}
    root = cache_dir() / "venvs" / _key(pins)
    python = root / "bin" / "python"
    done, refused = root / "metapatch-survey-ready.json", root / "metapatch-survey-uninstallable.json"
    if done.exists():
        return {"status": "ready", "python": str(python)}
    if refused.exists():
        return json.loads(refused.read_text())
    if root.exists():
        shutil.rmtree(root)  # an interrupted build: start over
    subprocess.run([base_python(), "-m", "venv", "--system-site-packages", str(root)], check=True,
                   capture_output=True)
    requirements = [f"{d}=={v}" for d, v in sorted(pins.items())] + list(EXTRAS)
    if log:
        log(f"pip install {' '.join(requirements)}")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        text = proc.stderr + proc.stdout
        status = "uninstallable" if any(m in text for m in UNINSTALLABLE_MARKERS) else "install-error"
        result = {"status": status, "reason": _pip_reason(text), "pins": dict(pins)}
        if status == "uninstallable":
            refused.write_text(json.dumps(result, indent=1))
        else:
            shutil.rmtree(root, ignore_errors=True)  # a network error: try again next time
        return result
    done.write_text(json.dumps({"pins": dict(pins)}, indent=1))
    return {"status": "ready", "python": str(python)}


def _pip_reason(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    wanted = [line for line in lines if "requires" in line or "ERROR" in line or "conflict" in line]
    return " | ".join((wanted or lines)[-4:])[:600]


def _scenario_files(patch_id: str) -> List[Path]:
    """The selftest modules holding the patch's reproducers (and the module its record names)."""
    import metapatch
    from metapatch._framework import layout
    from metapatch.selftest import all_scenarios

    patch = metapatch.registry.patches.get(patch_id)
    modules = {s.function.partition(":")[0] for s in all_scenarios() if s.patch_id == patch_id}
    named = layout.scenarios(patch) if patch is not None else None
    modules |= {named} if named else set()
    return [REPO / (m.replace(".", "/") + ".py") for m in sorted(modules)]


def patch_source_hash(patch_id: str) -> str:
    """A hash of the patch's module(s), its reproducers' modules, the harness and its diffs: a run
    is repeated when any of them changed, and only then."""
    from metapatch._framework import layout

    digest = hashlib.sha256()
    package = REPO / "metapatch"
    stem = layout.stem(patch_id)
    files = sorted((package / "patches").glob(f"{stem}.py")) + sorted((package / "patches" / stem).glob("*.py"))
    files += _shared_helpers(files)
    files += _scenario_files(patch_id) + sorted((package / "selftest").glob("_*.py"))
    files += sorted((REPO / "upstream_diffs" / patch_id).glob("*.diff"))
    for path in (f for f in files if f.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


# The layers below the patches: a module there that a patch imports (directly or through another one).
_SHARED_FOLDERS = ("_framework", "_offload")


def _imported_files(path: Path, package: Path) -> List[Path]:
    """The files of the ``metapatch`` modules that ``path`` imports (``from`` imports, in functions too),
    a name imported from a package counted where it is a module."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return []
    here = path.relative_to(package.parent).with_suffix("").parts[:-1]  # the file's package
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = list(here[: len(here) - node.level + 1]) if node.level else []
        module = base + (node.module.split(".") if node.module else [])
        if not module or module[0] != "metapatch":
            continue
        for name in [None] + [alias.name for alias in node.names]:
            parts = module + ([name] if name else [])
            for candidate in (package.parent.joinpath(*parts).with_suffix(".py"),
                              package.parent.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    found.append(candidate)
    return found


def _is_shared(path: Path, package: Path) -> bool:
    parts = path.relative_to(package).parts
    if parts[-1] == "__init__.py":
        return False  # the layers' package files hold no code
    return parts[0] in _SHARED_FOLDERS or (parts[0] == "patches" and len(parts) == 2 and parts[1].startswith("_"))


def _shared_helpers(patch_files: List[Path]) -> List[Path]:
    """The shared modules (metapatch/_offload/tied_placement.py, adapter_offload.py, the framework's records,
    patches/_shared_targets.py ...) a patch imports, and the shared modules those import: a change there
    changes the patch's behaviour as much as a change in the patch itself."""
    package = REPO / "metapatch"
    found: set = set()
    pending = [path for path in patch_files if path.is_file()]
    while pending:
        for imported in _imported_files(pending.pop(), package):
            if imported not in found and _is_shared(imported, package):
                found.add(imported)
                pending.append(imported)
    return sorted(found)


def run_combination(patch_id: str, pins: Mapping[str, str], timeout: float, log=None) -> Dict[str, Any]:
    """One combination's outcome, from the cache when this patch's code was already run on it."""
    source = patch_source_hash(patch_id)
    cached = cache_dir() / "results" / patch_id / f"{_key(pins)}-{source}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    venv = ensure_venv(pins, log)
    result: Dict[str, Any] = {"pins": dict(sorted(pins.items())), "status": venv["status"], "patch_source": source}
    if venv["status"] != "ready":
        result["reason"] = venv["reason"]
        if venv["status"] == "install-error":
            return result  # not cached: a transient failure
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "METAPATCH_DISABLE", "METAPATCH_STRICT")}
        proc = subprocess.run([venv["python"], "-m", "metapatch.survey.probe", patch_id, "--timeout", str(timeout)],
                              cwd=str(REPO), env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            result.update(status="probe-error", reason=(proc.stderr or proc.stdout)[-800:])
            return result
        result["status"] = "measured"
        result["scenarios"] = json.loads(proc.stdout.strip().splitlines()[-1])["scenarios"]
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=1, sort_keys=True))
    return result


def verdict(result: Mapping[str, Any]) -> Dict[str, Any]:
    """One combination in the table's words: bug (yes/no/n-a/uninstallable), error class, patched
    and diff results over all the patch's scenarios."""
    if result["status"] != "measured":
        return {"bug": result["status"], "reason": result.get("reason", "")}
    rows = list(result["scenarios"].values())
    ran = [r for r in rows if r["unpatched"]["result"] != "n/a"]
    if not ran:
        return {"bug": "n-a", "reason": "; ".join(sorted({r["unpatched"].get("reason", "") for r in rows}))}
    errors = sorted({r["unpatched"].get("error_type") or "?" for r in ran if r["unpatched"]["result"] == "fail"})
    return {
        "bug": "yes" if errors else "no",
        "error": ", ".join(errors),
        "patched": _combine([r["patched"] for r in ran]),
        "diff": _combine([r["diff"] for r in ran]),
        # scenarios the patch fixes here (fail unpatched, pass patched): what makes a row "affected"
        "fixed": sorted(k for k, r in result["scenarios"].items()
                        if r["unpatched"]["result"] == "fail" and r.get("patched", {}).get("result") == "pass"),
        "scenarios": {k: _scenario_text(r) for k, r in sorted(result["scenarios"].items())},
    }


def _result_text(outcome: Mapping[str, Any]) -> str:
    if outcome["result"] == "fail":
        return f"FAIL {outcome.get('error_type')}"
    return outcome["result"]


def _scenario_text(row: Mapping[str, Any]) -> str:
    parts = [f"unpatched {_result_text(row['unpatched'])}"]
    parts += [f"{label} {_result_text(row[label])}" for label in ("patched", "diff") if label in row]
    return "; ".join(parts)


def _combine(results: List[Mapping[str, Any]]) -> str:
    failed = sorted({r.get("error_type") or "?" for r in results if r["result"] == "fail"})
    if failed:
        return "FAIL " + ", ".join(failed)
    kinds = sorted({r["result"] for r in results})
    return kinds[0] if len(kinds) == 1 else "/".join(kinds)
