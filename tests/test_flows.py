"""The differential flow tester's CI run (tests/_flows.py, issue 22): a few derandomized sequences of user steps
on an in-memory tiny Llama and on an offloaded copy, with metapatch active; equal results or MetapatchError at
every step, nothing written outside the named folders. The long run is a command (see tests/_flows.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, settings  # noqa: E402

import _flows  # noqa: E402 - tests/_flows.py

FlowMachine = _flows.make_machine(_flows.INITS)


class TestFlowsCI(FlowMachine.TestCase):
    settings = settings(max_examples=6, stateful_step_count=6, derandomize=True, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))


def test_flows_ran_steps():
    """The run above did run sequences of steps (a strategy or precondition mistake would make it vacuous)."""
    if _flows.STATS["sequences"] == 0:
        pytest.skip("run together with TestFlowsCI (it fills the counters)")
    assert _flows.STATS["steps"] > 2 * _flows.STATS["sequences"]
