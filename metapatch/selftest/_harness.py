"""Run reproducers in subprocesses, with and without metapatch, and collect their outcomes."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Expect:
    """What a scenario does without metapatch where every distribution in ``when`` is installed inside
    its range (``{"transformers": ">=5,<5.13.0.dev0"}``; ``{}`` matches any install): it raises
    ``error`` (a class name, or alternatives ``"RuntimeError|AssertionError"``) whose text matches the
    regular expression ``message`` (searched; ``""`` checks no text), or, with ``error=""``, it passes."""

    error: str
    message: str = ""
    when: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Scenario:
    patch_id: str
    name: str
    function: str  # "module:function", called with the working directory
    description: str = ""
    expected_error: str = ""  # the upstream error class name, where the version is affected
    expected_message: str = ""  # a regular expression its text matches (searched), with expected_error
    in_selftest: bool = True  # False for slow variants that only the test suite runs
    # {distribution: specifier} the scenario needs (its model class, the release line whose code
    # it reproduces): elsewhere the harness reports it n/a without calling it. Judged by the
    # registry's own gate, so pre-releases and local builds count as the patches' ranges do.
    requires: Mapping[str, str] = field(default_factory=dict, hash=False)
    # The unpatched run per range, first match wins; where none matches, the scenario fails with
    # ``expected_error`` (and ``expected_message``) where its patch's gate says affected, else passes.
    unpatched: Tuple[Expect, ...] = ()
    tolerance: float = 0.0  # the largest max_abs_diff from the in-memory reference that counts as equal

    @property
    def key(self) -> str:
        return f"{self.patch_id}/{self.name}"

    def not_applicable_here(self, versions: Optional[Mapping[str, Optional[str]]] = None) -> str:
        """Why ``requires`` is not met on this install ('' when it is)."""
        return unmet(self.requires, versions)

    def expected_unpatched(self, affected: bool, versions: Optional[Mapping[str, Optional[str]]] = None) -> Expect:
        """The declared :class:`Expect` for this install; ``affected``: the patch's gate."""
        for expect in self.unpatched:
            if not unmet(expect.when, versions):
                return expect
        return Expect(self.expected_error, self.expected_message) if affected else Expect("")


def unmet(requires: Mapping[str, str], versions: Optional[Mapping[str, Optional[str]]] = None) -> str:
    """'' when every distribution in ``requires`` is installed inside its range, else why not
    ("needs transformers<5 (installed: 5.24.0)"). The registry's gate decides, on a probe record whose
    ``affects`` is ``requires`` (no support window): one version comparison for patches and
    scenarios. ``versions`` overrides installed versions (tests)."""
    if not requires:
        return ""
    from .._records import Patch, Target
    from .._registry import Registry

    probe = Patch("selftest-requires", "scenario requirements", requires,
                  (Target("metapatch", "__name__", (), replacement=lambda original: original),))
    registry = Registry([probe], support_window={})
    registry._versions.update(versions or {})
    gate = registry.gate(probe)
    if gate.affected:
        return ""
    wanted = ", ".join(f"{dist}{spec}" for dist, spec in requires.items())
    installed = ", ".join(f"{dist} {gate.versions.get(dist) or 'missing'}" for dist in requires)
    return f"needs {wanted} (installed: {installed})"


@dataclass
class Outcome:
    scenario: str
    patched: bool
    passed: bool
    error_type: Optional[str] = None
    error: Optional[str] = None
    traceback: str = ""
    metrics: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    stderr_tail: str = ""
    states: Dict[str, str] = field(default_factory=dict)  # metapatch.status() in the child
    # The scenario raised selftest.NotApplicable (its model class or API is missing here): the
    # message, e.g. "needs transformers >= 5.5 (Gemma4ForCausalLM)". Such an outcome is neither a
    # pass nor a failure; ``passed`` stays False so that code which only reads ``passed`` never
    # mistakes it for a pass.
    not_applicable: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


REQUIRES_ENV = "METAPATCH_SCENARIO_REQUIRES"


def all_scenarios() -> List[Scenario]:
    package = importlib.import_module(__package__)
    found: List[Scenario] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        found.extend(getattr(module, "SCENARIOS", ()))
    return found


def scenarios_for(patch_id: str) -> List[Scenario]:
    return [s for s in all_scenarios() if s.patch_id == patch_id]


def find(key: str) -> Scenario:
    for scenario in all_scenarios():
        if scenario.key == key:
            return scenario
    raise KeyError(f"no selftest scenario {key!r}; known: {[s.key for s in all_scenarios()]}")


def run_scenario(
    scenario: Scenario | str,
    *,
    patched: bool,
    pythonpath: Sequence[str] = (),
    env: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    timeout: float = 600,
) -> Outcome:
    """Run one scenario in a fresh interpreter. ``patched=False`` sets METAPATCH_DISABLE=all;
    ``pythonpath`` entries go first on the child's path (a patched copy of an upstream package)."""
    if isinstance(scenario, str):
        scenario = find(scenario)
    child_env = dict(os.environ)
    child_env.pop("METAPATCH_DISABLE", None)
    child_env.pop(REQUIRES_ENV, None)
    if scenario.requires:  # judged in the child, where the upstream copy under test is importable
        child_env[REQUIRES_ENV] = json.dumps(dict(scenario.requires))
    if env:
        child_env.update(env)
    if not patched:
        child_env["METAPATCH_DISABLE"] = "all"
    here = str(Path(__file__).resolve().parents[2])  # so the child imports this very metapatch
    child_env["PYTHONPATH"] = os.pathsep.join([*pythonpath, here, child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="metapatch-selftest-") as tmp:
        result_file = Path(tmp) / "result.json"
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        started = time.perf_counter()
        warm = None if pythonpath else _warm_parent()
        if warm is not None:
            rc, timed_out, stderr = warm.run(scenario.function, workdir, result_file, child_env, cwd or tmp, timeout, Path(tmp))
        else:
            rc, timed_out, stderr = _run_fresh(scenario.function, workdir, result_file, child_env, cwd or tmp, timeout)
        seconds = time.perf_counter() - started
        if timed_out:
            return Outcome(scenario.key, patched, False, "TimeoutExpired", f"no result after {timeout} s",
                           seconds=seconds, stderr_tail=stderr[-4000:])
        if not result_file.exists():
            return Outcome(scenario.key, patched, False, "ChildCrashed",
                           f"exit code {rc}, no result written", seconds=seconds, stderr_tail=stderr[-4000:])
        data = json.loads(result_file.read_text())
    return Outcome(scenario.key, patched, data["passed"], data.get("error_type"), data.get("error"),
                   data.get("traceback", ""), data.get("metrics", {}), seconds, stderr[-4000:],
                   data.get("metapatch_status", {}), data.get("not_applicable"))


def _run_fresh(function: str, workdir: Path, result_file: Path, env: Mapping[str, str], cwd: str,
               timeout: float) -> "tuple[int, bool, str]":
    try:
        proc = subprocess.run([sys.executable, "-m", "metapatch.selftest._child", function, str(workdir), str(result_file)],
                              env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return -9, True, str(exc.stderr or "")
    return proc.returncode, False, proc.stderr


class _WarmParent:
    """A long-lived interpreter with torch imported that forks one child per run (see _zygote)."""

    def __init__(self) -> None:
        here = Path(__file__).resolve()
        env = dict(os.environ, METAPATCH_ZYGOTE_REPO=str(here.parents[2]))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([sys.executable, str(here.with_name("_zygote.py"))], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if json.loads(self.proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError("the warm parent did not start")
        self.lock = threading.Lock()  # one request/reply at a time on the pipe
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the parent's read loop ends, and with it the process
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def run(self, function: str, workdir: Path, result_file: Path, env: Mapping[str, str], cwd: str,
            timeout: float, tmp: Path) -> "tuple[int, bool, str]":
        log = tmp / "child.log"
        request = {"function": function, "workdir": str(workdir), "result": str(result_file), "env": dict(env),
                   "cwd": cwd, "timeout": timeout, "log": str(log)}
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
        return reply["rc"], reply["timed_out"], log.read_text(errors="replace") if log.exists() else ""


_WARM = threading.local()  # one warm parent per thread: a parent serves one run at a time


def _warm_parent() -> Optional[_WarmParent]:
    """This thread's warm parent, or None where forking is off (METAPATCH_SELFTEST_FORK=0), impossible
    (no os.fork) or broken - then every run starts a fresh interpreter, slower but equivalent. Each
    thread gets its own parent, so ``metapatch selftest --jobs 2`` runs two scenarios at once."""
    if os.environ.get("METAPATCH_SELFTEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    parent = getattr(_WARM, "parent", None)
    if parent is not None and parent.proc.poll() is None:
        return parent
    try:
        _WARM.parent = _WarmParent()
    except Exception:  # noqa: BLE001 - torch missing or the parent failed: fall back, do not fail
        _WARM.parent = None
    return _WARM.parent
