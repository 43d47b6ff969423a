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
    # The execution device types where this was measured (_device: "cpu", "cuda"). An expectation
    # applies on those only; where none applies on a device, :meth:`Scenario.expected_unpatched` says
    # what is known there (see its docstring).
    devices: Tuple[str, ...] = ("cpu",)


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
    # The patch's representative for a bare ``metapatch selftest``, tried before its other scenarios:
    # the cheapest one that shows the bug and the fix on the releases it was measured on (where it
    # cannot decide, n/a or not reproduced, the others follow in declared order).
    quick: bool = False
    # Where it computes (see _device): "" the execution device (cuda:0 where CUDA is present, GPU 0 in
    # the map, else cpu); "cpu" pinned there, its process started with CUDA hidden, for ``device_reason``.
    device: str = ""
    device_reason: str = ""
    # The largest max_abs_diff counted as equal where it computes on a GPU (None: ``tolerance``), and
    # why GPU kernels may differ there (an in-memory GPU model and an offloaded one computing on the
    # same GPU run the same kernels on the same values: bit-equal unless a kernel is nondeterministic).
    gpu_tolerance: Optional[float] = None
    tolerance_reason: str = ""

    def __post_init__(self) -> None:
        if self.device not in ("", "cpu"):
            raise ValueError(f"{self.key}: device must be '' (the execution device) or 'cpu', not {self.device!r}")
        if self.device == "cpu" and not self.device_reason:
            raise ValueError(f"{self.key}: a scenario pinned to the CPU says why (device_reason)")

    @property
    def key(self) -> str:
        return f"{self.patch_id}/{self.name}"

    def tolerance_on(self, device: Optional[str]) -> float:
        """The tolerance for a run that computed on ``device`` (an outcome's ``device``)."""
        if device and device.startswith("cuda") and self.gpu_tolerance is not None:
            return self.gpu_tolerance
        return self.tolerance

    def run_environment(self) -> Dict[str, str]:
        """What the harness adds to a run's environment for the scenario's device (pinned: CUDA hidden)."""
        from ._device import pin_environment

        return pin_environment(self.device_reason) if self.device == "cpu" else {}

    def not_applicable_here(self, versions: Optional[Mapping[str, Optional[str]]] = None) -> str:
        """Why ``requires`` is not met on this install ('' when it is)."""
        return unmet(self.requires, versions)

    def expected_unpatched(self, affected: bool, versions: Optional[Mapping[str, Optional[str]]] = None,
                           device: Optional[str] = None) -> Expect:
        """The declared :class:`Expect` for this install; ``affected``: the patch's gate; ``device``: where
        the run computed (None or "cpu": the CPU).

        The declarations were measured on the CPU (``Expect.devices``). On a device where none of them was
        measured, the bug's mechanism (offload hooks, device maps, meta tensors) is the device's too, so the
        CPU's expectation stands, with two differences that follow from the device rather than from the
        bug: the error text is not checked (message ``""``), and where the CPU computes silently wrong
        values from a meta tensor (``AssertionError``), a GPU kernel refuses the meta operand
        (``RuntimeError``), so either is accepted."""
        kind = (device or "cpu").partition(":")[0]
        declared = [e for e in self.unpatched if not unmet(e.when, versions)]
        for expect in declared:
            if kind in expect.devices:
                return expect
        on_cpu = [e for e in declared if "cpu" in e.devices]
        expect = on_cpu[0] if on_cpu else (Expect(self.expected_error, self.expected_message) if affected
                                           else Expect(""))
        if kind == "cpu" or not expect.error:
            return expect
        errors = expect.error.split("|")
        if "AssertionError" in errors and "RuntimeError" not in errors:
            errors.append("RuntimeError")
        return Expect("|".join(errors), "", expect.when, (kind,))


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
    # CPU seconds of the run's process and the subprocesses it waited for (None where unknown): what a
    # quiet machine would need, where ``seconds`` is stretched by whatever else runs.
    cpu_seconds: Optional[float] = None
    # Where the run computed (_device.execution_device(): "cpu", "cuda:0"; None where the scenario never
    # asked, e.g. it was n/a first), and why it is pinned to the CPU where it is.
    device: Optional[str] = None
    device_note: Optional[str] = None

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
    """Run one scenario in a process of its own: a child forked from a warm parent (see
    :func:`_warm_parent`), or a fresh interpreter where ``pythonpath`` is given or forking is off.
    ``patched=False`` sets METAPATCH_DISABLE=all; ``pythonpath`` entries go first on the child's path
    (a patched copy of an upstream package); a scenario pinned to the CPU gets CUDA hidden
    (:meth:`Scenario.run_environment`). Safe to call from several threads at once."""
    if isinstance(scenario, str):
        scenario = find(scenario)
    parent_env = _child_env(scenario.requires, patched, pythonpath, env)
    child_env = dict(parent_env, **scenario.run_environment())
    with tempfile.TemporaryDirectory(prefix="metapatch-selftest-") as tmp:
        result_file = Path(tmp) / "result.json"
        workdir = Path(tmp) / "work"
        workdir.mkdir()
        started = time.perf_counter()
        warm = None if pythonpath else _warm_parent(parent_env, preload=not env)
        if warm is not None:
            rc, timed_out, stderr, cpu = warm.run(scenario.function, workdir, result_file, child_env, cwd or tmp, timeout, Path(tmp))
        else:
            rc, timed_out, stderr, cpu = _run_fresh(scenario.function, workdir, result_file, child_env, cwd or tmp, timeout)
        seconds = time.perf_counter() - started
        if timed_out:
            return Outcome(scenario.key, patched, False, "TimeoutExpired", f"no result after {timeout} s",
                           seconds=seconds, stderr_tail=stderr[-4000:], cpu_seconds=cpu)
        if not result_file.exists():
            return Outcome(scenario.key, patched, False, "ChildCrashed",
                           f"exit code {rc}, no result written", seconds=seconds, stderr_tail=stderr[-4000:],
                           cpu_seconds=cpu)
        data = json.loads(result_file.read_text())
    return Outcome(scenario.key, patched, data["passed"], data.get("error_type"), data.get("error"),
                   data.get("traceback", ""), data.get("metrics", {}), seconds, stderr[-4000:],
                   data.get("metapatch_status", {}), data.get("not_applicable"), cpu,
                   device=data.get("device"), device_note=data.get("device_note"))


def _child_env(requires: Mapping[str, str], patched: bool, pythonpath: Sequence[str] = (),
               env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    child_env = dict(os.environ)
    child_env.pop("METAPATCH_DISABLE", None)
    child_env.pop(REQUIRES_ENV, None)
    # One intra-op thread per run unless the caller says otherwise: runs go two at a time on tiny models,
    # where torch's default (a thread per core, each spinning while it waits) made two runs fight over the
    # cores (measured on 2 cores: a patch's scenarios at --jobs 2 took 30-40 % less wall time with it).
    child_env.setdefault("OMP_NUM_THREADS", "1")
    # transformers >= 5.25 with the kernels package fetches hub kernels in every from_pretrained on a GPU, and
    # fails there without network access; the scenarios compare with in-memory models built without them.
    child_env.setdefault("USE_HUB_KERNELS", "0")
    if requires:  # judged in the child, where the upstream copy under test is importable
        child_env[REQUIRES_ENV] = json.dumps(dict(requires))
    if env:
        child_env.update(env)
    if not patched:
        child_env["METAPATCH_DISABLE"] = "all"
    here = str(Path(__file__).resolve().parents[2])  # so the child imports this very metapatch
    child_env["PYTHONPATH"] = os.pathsep.join([*pythonpath, here, child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return child_env


def warm_up() -> Optional[List[str]]:
    """Start the warm parents of plain runs (without and with metapatch) at once, before the first run
    needs them, so that no scenario's time includes their start. Returns what the patched runs' parent
    preloaded ([]: torch only), None where runs start fresh interpreters (no parent); what it left out of
    the preload, and why, is in ``PRELOAD_SKIPPED``."""
    found: Dict[bool, Optional[List[str]]] = {}

    def start(patched: bool) -> None:
        parent = _warm_parent(_child_env({}, patched), preload=True)
        found[patched] = None if parent is None else list(parent.preloaded)
        if patched and parent is not None:
            PRELOAD_SKIPPED.clear()
            PRELOAD_SKIPPED.update(parent.skipped)

    threads = [threading.Thread(target=start, args=(patched,)) for patched in (False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found.get(True)


def _run_fresh(function: str, workdir: Path, result_file: Path, env: Mapping[str, str], cwd: str,
               timeout: float) -> "tuple[int, bool, str, Optional[float]]":
    log = workdir.parent / "child.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "metapatch.selftest._child", function, str(workdir),
                                 str(result_file)], env=dict(env), cwd=cwd, stdout=subprocess.DEVNULL, stderr=out)
    rc, timed_out, cpu = _reap(proc, timeout)
    return rc, timed_out, log.read_text(errors="replace"), cpu


def _reap(proc: "subprocess.Popen", timeout: float) -> "tuple[int, bool, Optional[float]]":
    """Wait for ``proc`` (killed at the deadline) through wait4, which also gives its CPU time, its own
    waited-for children included: a busy machine stretches wall time, not CPU time."""
    if not hasattr(os, "wait4"):
        try:
            return proc.wait(timeout=timeout), False, None
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True, None
    deadline, timed_out = time.monotonic() + timeout, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    proc.returncode = -9 if timed_out else os.waitstatus_to_exitcode(status)
    return proc.returncode, timed_out, round(usage.ru_utime + usage.ru_stime, 3)


# Imported once by a warm parent that serves runs in the selftest's own environment (after
# ``import metapatch``: see _zygote): what nearly every scenario imports, and what costs a child
# most of its start-up. A module missing from the install is left out, and so is one that initialises
# CUDA at import where torch may meet a GPU (_device.preload_plan: bitsandbytes).
PRELOAD = ("transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "accelerate", "peft", "bitsandbytes")
PRELOAD_SKIPPED: Dict[str, str] = {}  # what warm_up()'s parent left out of PRELOAD, and why


class _WarmParent:
    """A long-lived interpreter that forks one child per run (see _zygote); runs from several
    threads at once, each request and reply matched by its id."""

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        here = Path(__file__).resolve()
        if env is None:  # torch only: serves runs of any environment (each child sets its own)
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            env.setdefault("OMP_NUM_THREADS", "1")  # as _child_env: read once, when torch starts, before a fork
        else:
            env = dict(env, METAPATCH_ZYGOTE_PRELOAD=",".join(PRELOAD))
        env["METAPATCH_ZYGOTE_REPO"] = str(here.parents[2])
        self.proc = subprocess.Popen([sys.executable, str(here.with_name("_zygote.py"))], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        hello = json.loads(self.proc.stdout.readline() or "{}")
        if hello.get("ready") is not True:
            self.close()
            raise RuntimeError(f"the warm parent did not start: {hello.get('error', 'no answer')}")
        self.preloaded: List[str] = hello.get("preloaded", [])
        self.skipped: Dict[str, str] = hello.get("skipped", {})  # left out of the preload: why (_device)
        self.lock = threading.Lock()  # writes, the id counter and the table of pending runs
        self.pending: Dict[int, list] = {}  # id -> [event, reply]
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.lock:
                slot = self.pending.pop(reply["id"], None)
            if slot is not None:
                slot[1] = reply
                slot[0].set()
        with self.lock:  # the parent is gone: whoever still waits gets a crash, not a hang
            orphans, self.pending = list(self.pending.values()), {}
        for slot in orphans:
            slot[1] = {"rc": -1, "timed_out": False, "cpu": None}
            slot[0].set()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the parent's read loop ends, and with it the process
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def run(self, function: str, workdir: Path, result_file: Path, env: Mapping[str, str], cwd: str,
            timeout: float, tmp: Path) -> "tuple[int, bool, str, Optional[float]]":
        log = tmp / "child.log"
        slot: list = [threading.Event(), None]
        with self.lock:
            self.next_id += 1
            request = {"id": self.next_id, "function": function, "workdir": str(workdir),
                       "result": str(result_file), "env": dict(env), "cwd": cwd, "timeout": timeout,
                       "log": str(log)}
            self.pending[self.next_id] = slot
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            except OSError:
                self.pending.pop(self.next_id, None)
                slot[1] = {"rc": -1, "timed_out": False, "cpu": None}
                slot[0].set()
        slot[0].wait()
        reply = slot[1]
        return (reply["rc"], reply["timed_out"], log.read_text(errors="replace") if log.exists() else "",
                reply.get("cpu"))


_PARENTS: Dict[Any, Optional[_WarmParent]] = {}  # environment key -> parent (None: it would not start)
_STARTING: Dict[Any, threading.Lock] = {}  # environment key -> held while its parent starts
_PARENTS_LOCK = threading.Lock()  # guards both tables; never held while a parent starts
_MAX_PRELOADED = 4  # distinct environments with a preloaded parent at once (the selftest needs 2)


def _warm_parent(env: Mapping[str, str], preload: bool) -> Optional[_WarmParent]:
    """The warm parent for a run in ``env``, or None where forking is off (METAPATCH_SELFTEST_FORK=0),
    impossible (no os.fork) or broken - then the run starts a fresh interpreter, slower but equivalent.

    ``preload``: the run is in the selftest's own environment (no caller overrides), so a parent
    started in exactly that environment (one per environment: patched, unpatched) imports metapatch
    and then the stack (PRELOAD) once for all its children. Otherwise, or with
    METAPATCH_SELFTEST_PRELOAD=0, or where such a parent fails to start, one torch-only parent
    serves every environment. Either kind serves several threads at once; parents of different
    environments start at the same time."""
    if os.environ.get("METAPATCH_SELFTEST_FORK", "1") == "0" or not hasattr(os, "fork"):
        return None
    if preload and os.environ.get("METAPATCH_SELFTEST_PRELOAD", "1") != "0":
        own = {k: v for k, v in env.items() if k != REQUIRES_ENV}  # read at run time, in the child
        key = tuple(sorted(own.items()))
        with _PARENTS_LOCK:
            room = key in _STARTING or sum(1 for k in _STARTING if k != "torch") < _MAX_PRELOADED
        parent = _parent(key, own) if room else None
        if parent is not None:
            return parent
    return _parent("torch", None)


def _parent(key: Any, env: Optional[Mapping[str, str]]) -> Optional[_WarmParent]:
    with _PARENTS_LOCK:
        starting = _STARTING.setdefault(key, threading.Lock())
    with starting:
        parent = _PARENTS.get(key, False)
        if parent is False or (parent is not None and not parent.alive()):
            try:
                parent = _WarmParent(env)
            except Exception:  # noqa: BLE001 - torch missing or the parent failed: fall back, do not fail
                parent = None
            with _PARENTS_LOCK:
                _PARENTS[key] = parent
        return parent
