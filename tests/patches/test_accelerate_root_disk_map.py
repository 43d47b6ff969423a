"""accelerate-root-disk-map: three-way proof on a tiny Llama given the map infer_auto_device_map returns
when nothing fits ({"": "disk"}) and a real dispatch_model (subprocesses), and in-process checks that
every other extraction calls upstream untouched."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.accelerate_root_disk_map import PATCH
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, assert_upstream_error, upstream_diff_copy

PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


def test_scenarios_exist():
    assert {s.name for s in SCENARIOS} == {"inferred-map-all-on-disk"}


def _refused_first(outcome) -> bool:
    """accelerate <= 1.14 refuses {"": "disk"} in dispatch_model before the bug: the scenario says n/a."""
    from packaging.version import Version

    if outcome.not_applicable is None:
        return False
    assert Version(metapatch.registry._version("accelerate")) < Version("1.15"), outcome.not_applicable
    assert "offload the whole model to the disk" in outcome.not_applicable
    return True


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[PATCH_ID] == "disabled"
    if _refused_first(outcome):
        pytest.skip(f"n/a on this accelerate: {outcome.not_applicable}")
    assert_upstream_error(outcome, scenario, WHY, "index.json")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    if _refused_first(outcome):
        pytest.skip(f"n/a on this accelerate: {outcome.not_applicable}")
    assert_equals_reference(outcome)
    assert outcome.states[PATCH_ID] == "applied"


@pytest.fixture(scope="module")
def accelerate_with_diff(tmp_path_factory):
    return upstream_diff_copy(PATCH_ID, tmp_path_factory)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_upstream_diff_alone(scenario, accelerate_with_diff):
    outcome = run_scenario(scenario, patched=False, pythonpath=[accelerate_with_diff])
    if _refused_first(outcome):
        pytest.skip(f"n/a on this accelerate: {outcome.not_applicable}")
    assert_equals_reference(outcome)


torch = pytest.importorskip("torch")


def test_other_names_extract_as_upstream():
    from accelerate.utils import extract_submodules_state_dict

    state = {"a.weight": torch.ones(1), "ab.weight": torch.zeros(1), "b.bias": torch.ones(2)}
    assert set(extract_submodules_state_dict(state, ["a"])) == {"a.weight"}  # not "ab.weight"
    assert set(extract_submodules_state_dict(state, ["a", "b"])) == {"a.weight", "b.bias"}
    assert extract_submodules_state_dict(state, []) == {}
    everything = extract_submodules_state_dict(state, ["", "a"])
    assert everything == state and everything is not state  # a copy: dispatch_model may not own the dict
