"""Run reproducers in subprocesses, with and without metapatch, and collect their outcomes."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Scenario:
    patch_id: str
    name: str
    function: str  # "module:function", called with the working directory
    description: str = ""
    expected_error: str = ""  # the upstream error class name, where the version is affected
    in_selftest: bool = True  # False for slow variants that only the test suite runs

    @property
    def key(self) -> str:
        return f"{self.patch_id}/{self.name}"


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

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


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
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "metapatch.selftest._child", scenario.function, str(workdir), str(result_file)],
                env=child_env, cwd=cwd or tmp, capture_output=True, text=True, timeout=timeout,
            )
            stderr = proc.stderr
        except subprocess.TimeoutExpired as exc:
            return Outcome(scenario.key, patched, False, "TimeoutExpired", f"no result after {timeout} s",
                           seconds=time.perf_counter() - started, stderr_tail=str(exc.stderr or "")[-4000:])
        seconds = time.perf_counter() - started
        if not result_file.exists():
            return Outcome(scenario.key, patched, False, "ChildCrashed",
                           f"exit code {proc.returncode}, no result written", seconds=seconds,
                           stderr_tail=stderr[-4000:])
        data = json.loads(result_file.read_text())
    return Outcome(scenario.key, patched, data["passed"], data.get("error_type"), data.get("error"),
                   data.get("traceback", ""), data.get("metrics", {}), seconds, stderr[-4000:],
                   data.get("metapatch_status", {}))
