"""How `metapatch selftest` spends its time: the schedule (a patch's representative
first, both runs of a scenario in flight at once, progress on stderr), the warm parent that serves
several runs at once and reports their CPU time, and the proof that a child forked from a parent that
preloaded the stack sees the patches exactly as a fresh interpreter does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import metapatch
from metapatch.commands import selftest
from metapatch.selftest import Outcome, Scenario, _harness

ROOT = Path(__file__).resolve().parents[1]


# -- the schedule, on constructed outcomes (no subprocess) ------------------------------------------

def _scenarios():
    return [Scenario("patch-a", "slow-first", "m:f", expected_error="KeyError"),
            Scenario("patch-a", "representative", "m:f", expected_error="KeyError", quick=True),
            Scenario("patch-b", "not-reproduced", "m:f", expected_error="KeyError"),
            Scenario("patch-b", "decides", "m:f", expected_error="KeyError"),
            Scenario("patch-b", "never-reached", "m:f", expected_error="KeyError"),
            Scenario("patch-c", "na-here", "m:f", expected_error="KeyError"),
            Scenario("patch-c", "after-na", "m:f", expected_error="KeyError")]


class _Registry:
    """Every patch affected, nothing missing: the verdicts follow from the outcomes alone."""

    patches = {p: object() for p in ("patch-a", "patch-b", "patch-c")}

    @staticmethod
    def gate(patch):
        return True, "affected", {"transformers": "5"}, None


class _FakeRuns:
    """run_scenario stand-in: each scenario's outcomes by name, and a log of what ran at once."""

    def __init__(self, delay=0.05):
        self.delay, self.lock, self.running, self.overlaps, self.calls = delay, threading.Lock(), set(), [], []

    def __call__(self, scenario, *, patched, timeout):
        leg = (scenario.name, patched)
        with self.lock:
            self.running.add(leg)
            self.overlaps.append(frozenset(self.running))
            self.calls.append(leg)
        time.sleep(self.delay)
        with self.lock:
            self.running.discard(leg)
        if scenario.name == "na-here" and not patched:
            return Outcome(scenario.key, patched, False, "NotApplicable", "needs x", not_applicable="needs x",
                           seconds=self.delay)
        broken = not patched and scenario.name != "not-reproduced"
        return Outcome(scenario.key, patched, not broken, "KeyError" if broken else None, seconds=self.delay,
                       cpu_seconds=0.5)


def _run(monkeypatch, quick, jobs=2):
    import metapatch.selftest as package

    fake = _FakeRuns()
    monkeypatch.setattr(package, "run_scenario", fake)
    lines = []
    progress = selftest.Progress(0, jobs, enabled=True)
    work = selftest.chains(_scenarios(), quick)
    progress.total = len(work)
    rows = selftest.run_chains(work, quick, jobs, _Registry(), 10, lines.append, progress)
    return rows, fake


def test_quick_run_tries_the_representative_first_and_stops_at_a_decision(monkeypatch, capsys):
    rows, fake = _run(monkeypatch, quick=True)
    ran = [(r.scenario, r.verdict) for r in rows]
    assert ran == [("patch-a/representative", "fixed"),  # marked quick: before the declared first
                   ("patch-b/not-reproduced", "not reproduced"), ("patch-b/decides", "fixed"),
                   ("patch-c/na-here", "n/a (needs x)"), ("patch-c/after-na", "fixed")]
    assert ("slow-first", False) not in fake.calls and ("never-reached", False) not in fake.calls
    na = next(r for r in rows if r.scenario == "patch-c/na-here")
    assert na.patched is None  # dropped, even if it ran: n/a does not depend on metapatch
    fixed = rows[0]
    assert fixed.cpu_seconds == pytest.approx(1.0) and fixed.unpatched["cpu_seconds"] == 0.5
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert len(progress) == len(rows)
    assert progress[0].startswith("[1/3] patch-a/representative: fixed (")
    assert "next for this patch: decides" in next(line for line in progress if "not-reproduced" in line)
    assert all(re.search(r"\[\d+:\d\d elapsed", line) for line in progress)
    assert re.search(r"about \d+:\d\d left\]$", progress[0]) and progress[-1].endswith("elapsed]")
    assert progress[-1].startswith("[3/3] ")


def test_both_runs_of_a_scenario_go_out_at_once_within_the_job_limit(monkeypatch):
    rows, fake = _run(monkeypatch, quick=False, jobs=2)
    assert [r.scenario for r in rows] == [s.key for s in _scenarios()]  # --all: every one, declared order
    assert max(len(at_once) for at_once in fake.overlaps) == 2
    assert any(at_once == {(name, False), (name, True)} for at_once in fake.overlaps for name in ("decides",))
    _, one = _run(monkeypatch, quick=False, jobs=1)
    assert max(len(at_once) for at_once in one.overlaps) == 1
    # one at a time, the unpatched run of each scenario still comes first
    assert [leg for leg in one.calls if leg[0] == "decides"] == [("decides", False), ("decides", True)]


def test_the_parent_does_not_start_a_patched_run_that_requires_rule_out(monkeypatch):
    import metapatch.selftest as package

    fake = _FakeRuns(delay=0.01)
    monkeypatch.setattr(package, "run_scenario", fake)
    never = Scenario("patch-a", "na-here", "m:f", requires={"transformers": ">=99"})
    rows = selftest.run_chains([[never]], False, 2, _Registry(), 10, lambda row: None,
                               selftest.Progress(1, 2, enabled=False))
    assert fake.calls == [("na-here", False)] and rows[0].verdict == "n/a (needs x)"


def test_chains_keep_the_declared_order_behind_the_representative():
    chains = selftest.chains(_scenarios(), quick=True)
    assert [[s.name for s in chain] for chain in chains] == [
        ["representative", "slow-first"], ["not-reproduced", "decides", "never-reached"], ["na-here", "after-na"]]
    assert [[s.name for s in chain] for chain in selftest.chains(_scenarios(), quick=False)] == [
        [s.name] for s in _scenarios()]


def test_every_marked_representative_is_in_the_default_run():
    """A marked scenario that the bare run leaves out (in_selftest=False) would be a mark without effect."""
    from metapatch.selftest import all_scenarios

    marked = [s for s in all_scenarios() if s.quick]
    assert marked, "no scenario is marked quick"
    assert all(s.in_selftest for s in marked)
    per_patch = {}
    for scenario in marked:
        per_patch.setdefault(scenario.patch_id, []).append(scenario.name)
    assert all(len(names) == 1 for names in per_patch.values()), per_patch


# -- the warm parent ---------------------------------------------------------------------------------

def test_a_warm_parent_serves_runs_from_several_threads_and_reports_cpu(tmp_path):
    pytest.importorskip("torch")
    parent = _harness._WarmParent(None)  # torch only: quick to start
    try:
        results = {}

        def one(n):
            work = tmp_path / f"run{n}"
            (work / "work").mkdir(parents=True)
            env = dict(os.environ, PYTHONPATH=str(ROOT), METAPATCH_DISABLE="all")
            results[n] = parent.run("os:fspath", work / "work", work / "result.json", env, str(work), 60, work)
            results[n] += (json.loads((work / "result.json").read_text()),)

        threads = [threading.Thread(target=one, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert sorted(results) == [0, 1, 2]
        for n, (rc, timed_out, _log, cpu, result) in results.items():
            assert (rc, timed_out) == (0, False)
            assert result["passed"] and result["metrics"] == str(tmp_path / f"run{n}" / "work")  # its own request
            assert isinstance(cpu, float) and 0 < cpu < 60
    finally:
        parent.close()
    assert parent.proc.poll() is not None


# -- forked from a preloaded parent = a fresh interpreter ---------------------------------------------

PROBE = Scenario("offloaded-move-guard", "patch-sites", "metapatch.selftest._child:patch_sites")


@pytest.mark.slow
@pytest.mark.parametrize("patched", [True, False])
def test_a_child_of_the_preloaded_parent_sees_the_patches_as_a_fresh_interpreter(patched, monkeypatch):
    """The warm parent imports metapatch and then the stack (transformers, accelerate, peft, bitsandbytes)
    before it forks a child: every patch site, and every module that holds a patched original by name,
    must be what a fresh interpreter gets when its run imports the same modules after metapatch."""
    pytest.importorskip("transformers")
    # Tests run before this one in the same worker may have started preloaded parents for other environments up to
    # the harness's cap (the three-way files' runs): room for this environment's own, as `metapatch selftest` has.
    monkeypatch.setattr(_harness, "_MAX_PRELOADED", len(_harness._STARTING) + 2)
    forked = _harness.run_scenario(PROBE, patched=patched, timeout=300)
    assert any(p is not None and "transformers" in p.preloaded  # the preloaded kind served it
               for k, p in _harness._PARENTS.items() if k != "torch" and (("METAPATCH_DISABLE", "all") in k) != patched)
    monkeypatch.setenv("METAPATCH_SELFTEST_FORK", "0")
    fresh = _harness.run_scenario(PROBE, patched=patched, timeout=300)
    assert forked.passed and fresh.passed, (forked.traceback, fresh.traceback)
    assert forked.metrics == fresh.metrics
    states = {p["state"] for p in forked.metrics["patches"].values()}
    assert ("applied" in states) == patched and (states == {"disabled"}) == (not patched)


@pytest.mark.slow
def test_the_probe_tells_a_parent_that_imported_the_stack_before_metapatch():
    """The comparison above can fail: imported before metapatch, accelerate and transformers keep
    unpatched functions by name (what a parent preloading in the wrong order would hand every child)."""
    pytest.importorskip("transformers")
    fresh = _harness.run_scenario(PROBE, patched=True, env={"METAPATCH_SELFTEST_PRELOAD": "0"}, timeout=300)
    code = ("import importlib, json, sys\n"
            f"for name in {list(_harness.PRELOAD)!r}:\n"  # (importing _harness would import metapatch first)
            "    try:\n        importlib.import_module(name)\n    except ImportError:\n        pass\n"
            "import metapatch\n"
            "from metapatch.selftest._child import patch_sites\n"
            "print(json.dumps(patch_sites(None)))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("METAPATCH_DISABLE", None)
    late = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert late.returncode == 0, late.stderr[-2000:]
    late_view = json.loads(late.stdout.splitlines()[-1])
    assert fresh.passed and late_view != fresh.metrics
    bypassed = [site for patch in late_view["patches"].values() for site in patch["sites"].values()
                if site["original_in"]]
    assert bypassed, "importing the stack first left no original captured by name"
    assert not [site for patch in fresh.metrics["patches"].values() for site in patch["sites"].values()
                if site["original_in"]]
    assert metapatch  # the package under test is importable here too
