"""What the two-rank FSDP patches' three-way tests share (one test file per patch id): the legs run only where the
patch's range holds (outside it the two-rank flows are other code variants, measured by each file's
fixed-release test), the diff legs are slow, and every test spawns ranks (marker ``ranks``)."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.selftest import run_scenario

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


def claimed(scenario) -> None:
    affected, why, _, _ = metapatch.registry.gate(metapatch.registry.patches[scenario.patch_id])
    if not affected:
        pytest.skip(f"{scenario.patch_id} does not claim this stack ({why}); its range is what was measured")


class FsdpThreeWay(ThreeWayCase):
    """Only where the patch's range holds; the diff legs are slow."""

    @classmethod
    def scenarios(cls):
        return [s for s in super().scenarios() if s.expected_error]  # train-step-new-head: its own test

    def test_unpatched(self, runs, scenario):
        claimed(scenario)
        super().test_unpatched(runs, scenario)

    def test_patched(self, runs, scenario):
        claimed(scenario)
        super().test_patched(runs, scenario)

    @pytest.mark.slow
    def test_upstream_diff_alone(self, runs, scenario):
        claimed(scenario)
        super().test_upstream_diff_alone(runs, scenario)


def check_fixed_release_passes_unpatched(scenario):
    """Outside the patch's range the upstream fix is what was measured: the same two-rank flow passes without
    metapatch."""
    affected, why, _, _ = metapatch.registry.gate(metapatch.registry.patches[scenario.patch_id])
    if affected:
        pytest.skip(f"{scenario.patch_id} claims this stack; test_unpatched covers it")
    outcome = run_scenario(scenario, patched=False)
    if outcome.not_applicable:
        pytest.skip(outcome.not_applicable)
    assert outcome.passed, outcome.traceback or outcome.stderr_tail
    assert outcome.metrics["max_abs_diff"] == 0, outcome.metrics
