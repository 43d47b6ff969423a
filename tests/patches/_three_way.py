"""The three legs every patch test runs on its selftest scenarios (subprocesses, real libraries):
unpatched (the upstream error where the install is affected), patched (equal to the in-memory
reference), and the upstream diff alone (applied to a copy of the installed package, metapatch
disabled; a series of diffs, all of them in order).

:class:`ThreeWayCase` generates the three tests from the record and its scenarios: what each leg
expects is declared on the ``Scenario`` (``requires``, ``unpatched``/``expected_error``/
``expected_message``, ``tolerance``) and the patch's gate, so a test file states only what is
particular to its patch::

    class TestThreeWay(ThreeWayCase):
        patch_ids = (PATCH.id,)

        def check_patched(self, scenario, outcome):  # optional: what only this patch measures
            assert outcome.metrics["head_tied"] is bool(scenario.expected_error)

The loose assertions below stay for the files with runners of their own (the bitsandbytes files).

Devices: every run computes on the execution device its child decides (``metapatch.selftest._device``:
``cuda:0`` where CUDA is present, ``cpu`` otherwise, ``METAPATCH_SELFTEST_DEVICE`` to force one), or on the
CPU where the scenario is pinned there; each leg checks the device its run reports (:func:`expected_device`).
The patched and diff legs allow the scenario's tolerance for that device (``Scenario.tolerance_on``), the
unpatched leg expects what was measured for that device (``Scenario.expected_unpatched(..., device=)``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

import metapatch
from metapatch.diffs import APPLIES, apply_to_copy, check, diffs_for
from metapatch.selftest import Outcome, Scenario, _device, run_scenario, scenarios_for

LEGS = ("unpatched", "patched", "diff")
NOT_APPLICABLE = ("NotApplicable", "ModelUnavailable")  # the error types of an n/a outcome


def assert_equals_reference(outcome, tolerance: float = 0.0) -> None:
    """Passed, and equal to the in-memory reference (within the scenario's stated ``tolerance``)."""
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] <= tolerance, outcome.metrics


def assert_upstream_error(outcome, scenario, why: str, message: Optional[str]) -> None:
    """Failed the way upstream fails: the scenario's error class, with ``message`` in its text."""
    assert not outcome.passed, f"{scenario.key} passed unpatched on an affected install ({why})"
    assert outcome.error_type == scenario.expected_error, outcome.traceback or outcome.stderr_tail
    if message is not None:
        assert message in outcome.error, outcome.error


def diff_copy(series: Sequence, dest: Path) -> Tuple[Optional[str], str]:
    """(a copy of the installed package with ``series`` applied in order, '') or (None, why not): a
    diff written against upstream main may not apply to this release."""
    assert len({diff.package for diff in series}) == 1, [d.path.name for d in series]  # one package
    for n, diff in enumerate(series):
        assert diff.header["Forwarded"] == "no" and diff.header["Last-Update"]
        verdict = check(diff, previous=list(series[:n]))
        if verdict.verdict != APPLIES:
            return None, (f"{diff.path.name} does not apply to the installed {diff.package} "
                          f"{verdict.installed}: {verdict.verdict}")
    return str(apply_to_copy(list(series), dest)), ""


def upstream_diff_copy(patch_id: str, tmp_path_factory, skip_reason: str = "") -> str:
    """A copy of the installed package with the patch's upstream diff (or its series of diffs, in
    order) applied; skipped, with the reason, where a diff does not apply to this release."""
    path, why = diff_copy(diffs_for(patch_id), tmp_path_factory.mktemp(patch_id))
    if path is None:
        pytest.skip(why + (f" ({skip_reason})" if skip_reason else ""))
    return path


_VISIBLE: List[int] = []


def expected_device(scenario: Scenario) -> str:
    """Where a run of ``scenario`` computes, as its child decides it: ``cpu`` where the scenario is pinned
    there, else METAPATCH_SELFTEST_DEVICE or what torch sees (asked once per test process)."""
    if scenario.device == "cpu":
        return "cpu"
    request = _device.requested(os.environ.get(_device.DEVICE_ENV))
    if request == "cpu":
        return "cpu"
    if not _VISIBLE:
        _VISIBLE.append(_device.visible_cuda_devices())
    return _device.choose(request, _VISIBLE[0])


def assert_device(scenario: Scenario, outcome: Outcome) -> None:
    """The run computed where the scenario's device rule says, and a pinned one says why."""
    assert outcome.device == expected_device(scenario), (outcome.device, expected_device(scenario), explain(outcome))
    assert bool(outcome.device_note) == (scenario.device == "cpu"), outcome.device_note


def explain(outcome: Outcome) -> str:
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback[-3000:]}\n{outcome.stderr_tail[-1500:]}"


def _log(scenario: Scenario, leg: str, outcome: Outcome) -> None:
    """One JSON line per run to $METAPATCH_THREE_WAY_LOG, where set: outcomes to compare across changes."""
    path = os.environ.get("METAPATCH_THREE_WAY_LOG")
    if path:
        row = {"scenario": scenario.key, "leg": leg, "passed": outcome.passed, "error_type": outcome.error_type,
               "not_applicable": outcome.not_applicable, "seconds": round(outcome.seconds, 1)}
        with _LOG_LOCK, open(path, "a") as log:
            log.write(json.dumps(row) + "\n")


_LOG_LOCK = threading.Lock()


class _Runs:
    """Every (scenario, leg) run once per class, on demand or started ahead in ``workers`` threads;
    each run in its own empty working directory, which must stay empty."""

    def __init__(self, case: "ThreeWayCase", root: Path, scenarios: List[Scenario]) -> None:
        self.case, self.root = case, root
        self.lock = threading.Lock()
        self.copies: Dict[str, Tuple[Optional[str], str]] = {}
        self.futures: Dict[Tuple[str, str], object] = {}
        self.pool = ThreadPoolExecutor(max_workers=max(1, case.workers))
        if case.workers > 1:
            for scenario in scenarios:
                for leg in LEGS:
                    if leg != "diff" or not case.diff_skip(scenario):
                        self._submit(scenario, leg)

    def copy_for(self, patch_id: str) -> Tuple[Optional[str], str]:
        with self.lock:
            if patch_id not in self.copies:
                series = self.case.diff_series(patch_id)
                self.copies[patch_id] = diff_copy(series, self.root / "diffs" / patch_id) if series else \
                    (None, f"{patch_id} has no upstream diff")
            return self.copies[patch_id]

    def _submit(self, scenario: Scenario, leg: str):
        with self.lock:
            key = (scenario.key, leg)
            if key not in self.futures:
                self.futures[key] = self.pool.submit(self._run, scenario, leg)
            return self.futures[key]

    def _run(self, scenario: Scenario, leg: str):
        pythonpath: List[str] = []
        if leg == "diff":
            for patch_id in (scenario.patch_id, *self.case.diff_companions(scenario.patch_id)):
                path, why = self.copy_for(patch_id)
                if path is None:
                    return None, why
                pythonpath.append(path)
        cwd = self.root / "cwd" / f"{scenario.key.replace('/', '-')}-{leg}"
        cwd.mkdir(parents=True)
        outcome = run_scenario(scenario, patched=leg == "patched", pythonpath=pythonpath, cwd=str(cwd))
        _log(scenario, leg, outcome)
        return outcome, sorted(p.name for p in cwd.iterdir())

    def get(self, scenario: Scenario, leg: str) -> Outcome:
        outcome, extra = self._submit(scenario, leg).result()
        if outcome is None:
            pytest.skip(f"{leg} leg does not apply: {extra}")
        assert extra == [], f"{scenario.key} ({leg}) wrote into its working directory: {extra}"
        return outcome

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class ThreeWayCase:
    """Unpatched, patched and upstream-diff legs for every scenario of ``patch_ids``. Override the
    ``check_*`` hooks for what is particular to a patch, ``diff_skip`` / ``diff_series`` where its
    diff leg differs from "the patch's own diffs, where they apply"."""

    patch_ids: Tuple[str, ...] = ()
    names: Dict[str, set] = {}  # {patch id: its scenario names}, where the file pins them
    # runs started ahead, in threads (1: each run when its test asks); METAPATCH_TEST_WORKERS sets it
    workers = int(os.environ.get("METAPATCH_TEST_WORKERS", "1"))

    # -- generation ---------------------------------------------------------------------------

    def pytest_generate_tests(self, metafunc) -> None:
        if "scenario" in metafunc.fixturenames:
            scenarios = self.scenarios()
            name = (lambda s: s.key) if len(self.patch_ids) > 1 else (lambda s: s.name)
            metafunc.parametrize("scenario", scenarios, ids=name)

    @classmethod
    def scenarios(cls) -> List[Scenario]:
        return [s for patch_id in cls.patch_ids for s in scenarios_for(patch_id)]

    @pytest.fixture(scope="class")
    def runs(self, tmp_path_factory):
        started = _Runs(self, tmp_path_factory.mktemp("three-way"), self.scenarios())
        yield started
        started.close()

    # -- what a patch may override -------------------------------------------------------------

    def gate(self, patch_id: str):
        return metapatch.registry.gate(metapatch.registry.patches[patch_id])

    def diff_series(self, patch_id: str) -> list:
        """The diffs applied to one copy for the diff leg of ``patch_id``'s scenarios."""
        return list(diffs_for(patch_id))

    def diff_companions(self, patch_id: str) -> Tuple[str, ...]:
        """Other patches whose diffs (another package's) go on the path with ``patch_id``'s in its diff leg:
        an upstream fix that holds only together with another project's (each still its own PR)."""
        return ()

    def diff_skip(self, scenario: Scenario) -> str:
        """Why the diff leg does not run for ``scenario`` ('' = it runs)."""
        if not diffs_for(scenario.patch_id):
            fixed = metapatch.registry.patches[scenario.patch_id].upstream.fixed_in
            return "no upstream diff" + (f": fixed upstream in {fixed}" if fixed else "")
        return ""

    def not_applicable_reason(self, scenario: Scenario) -> Optional[str]:
        """Where a scenario whose ``requires`` are met must report n/a by itself (its model class or
        API is missing): the text its reason contains; '' where it must run; None (the default) where
        the file does not say (an n/a is then accepted after ``own_not_applicable``)."""
        return None

    def own_not_applicable(self, scenario: Scenario, outcome: Outcome) -> None:
        """Checks an n/a the scenario reported by itself, where ``not_applicable_reason`` is None."""

    def patched_states(self, scenario: Scenario) -> Tuple[str, ...]:
        """The states the patch may report in the patched child: ``applied`` where the gate says
        affected, else the gate's own state."""
        gate = self.gate(scenario.patch_id)
        return ("applied" if gate.affected else gate.state.value,)

    def check_unpatched(self, scenario: Scenario, outcome: Outcome) -> None:
        pass

    def check_patched(self, scenario: Scenario, outcome: Outcome) -> None:
        pass

    def check_diff(self, scenario: Scenario, outcome: Outcome) -> None:
        pass

    # -- the legs ------------------------------------------------------------------------------

    def _applies(self, scenario: Scenario, outcome: Outcome) -> None:
        """Skips (after checking it) where the scenario is n/a here: exactly where ``requires`` is unmet,
        with that reason, or where the scenario itself says so and ``own_not_applicable`` accepts it."""
        unmet = scenario.not_applicable_here()
        if unmet:
            assert outcome.not_applicable == unmet and not outcome.passed, explain(outcome)
            assert outcome.error_type in NOT_APPLICABLE, explain(outcome)
            pytest.skip(f"n/a here: {unmet}")
        expected = self.not_applicable_reason(scenario)
        if expected is not None:
            if not expected:
                assert not outcome.not_applicable, f"{scenario.key} reported n/a on a stack that has what it needs"
                return
            assert outcome.not_applicable and expected in outcome.not_applicable, explain(outcome)
        if outcome.not_applicable:
            assert not outcome.passed and outcome.error_type in NOT_APPLICABLE, explain(outcome)
            if expected is None:
                self.own_not_applicable(scenario, outcome)
            pytest.skip(f"n/a here: {outcome.not_applicable}")

    def test_scenarios_exist(self):
        for patch_id in self.patch_ids:
            found = {s.name for s in scenarios_for(patch_id)}
            assert found, f"{patch_id} has no selftest scenario"
            if patch_id in self.names:
                assert found == self.names[patch_id]

    def test_unpatched(self, runs, scenario):
        outcome = runs.get(scenario, "unpatched")
        assert set(outcome.states.values()) <= {"disabled"}, outcome.states
        self._applies(scenario, outcome)
        assert_device(scenario, outcome)
        gate = self.gate(scenario.patch_id)
        expect = scenario.expected_unpatched(gate.affected, device=outcome.device)
        if expect.error:
            assert not outcome.passed, f"{scenario.key} passed without metapatch here ({gate.why})"
            assert outcome.error_type in expect.error.split("|"), explain(outcome)
            if expect.message:
                assert re.search(expect.message, outcome.error or ""), (expect.message, outcome.error)
        else:
            assert outcome.passed, explain(outcome)
        self.check_unpatched(scenario, outcome)

    def test_patched(self, runs, scenario):
        outcome = runs.get(scenario, "patched")
        self._applies(scenario, outcome)
        assert outcome.passed, explain(outcome)
        assert_device(scenario, outcome)
        assert outcome.metrics["max_abs_diff"] <= scenario.tolerance_on(outcome.device), outcome.metrics
        assert outcome.states[scenario.patch_id] in self.patched_states(scenario), (scenario.patch_id, outcome.states)
        self.check_patched(scenario, outcome)

    def test_upstream_diff_alone(self, runs, scenario):
        why = self.diff_skip(scenario)
        if why:
            pytest.skip(f"diff leg does not apply: {why}")
        outcome = runs.get(scenario, "diff")
        self._applies(scenario, outcome)
        assert outcome.passed, explain(outcome)
        assert_device(scenario, outcome)
        assert outcome.metrics["max_abs_diff"] <= scenario.tolerance_on(outcome.device), outcome.metrics
        self.check_diff(scenario, outcome)
