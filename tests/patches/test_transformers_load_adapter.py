"""transformers-load-adapter-offload: three-way proof on real offloaded models (subprocesses), plus in-process
checks of the refusal and of the device maps load_adapter is given."""

from __future__ import annotations

import pytest

import metapatch
from metapatch import MetapatchError
from metapatch.patches import transformers_load_adapter_offload as patch_module
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, upstream_diff_copy  # tests/patches/_three_way.py

PATCH = patch_module.PATCH
PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, VERSIONS, _ = metapatch.registry.gate(PATCH)


def _transformers_version():
    from packaging.version import Version

    return Version(VERSIONS.get("transformers") or "0")


def _expected_unpatched(scenario):
    """(error type, text) upstream fails with here, or None where the scenario passes unpatched (measured)."""
    from packaging.version import Version

    version = _transformers_version()
    if not AFFECTED:
        return None
    if version < Version("5.0.0"):
        # 4.57: load_adapter re-dispatches with a freshly inferred map and calls model.to
        return "RuntimeError", "You can't move a model that has some modules offloaded"
    if version < Version("5.4.0") and scenario.name == "load-adapter-offloaded":
        # 5.0-5.3 load a direct load_adapter without the base's map: all adapter tensors land on cpu, which
        # is right on a CPU-only machine (from_pretrained(adapter_dir) still passes the user's map)
        return None
    return "AssertionError", "differ from the in-memory reference"


def test_scenarios_exist():
    assert {s.name for s in SCENARIOS} == {"load-adapter-offloaded", "from-pretrained-adapter-dir"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[PATCH_ID] == "disabled"
    expected = _expected_unpatched(scenario)
    if expected is None:
        assert outcome.passed, outcome.traceback or outcome.stderr_tail
        return
    assert not outcome.passed, f"{scenario.key} passed unpatched on an affected install ({WHY})"
    assert outcome.error_type == expected[0], outcome.traceback or outcome.stderr_tail
    assert expected[1] in outcome.error, outcome.error
    assert "wrote outside the offload folder" not in outcome.error


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    assert_equals_reference(outcome)
    assert outcome.states[PATCH_ID] == ("applied" if AFFECTED else "not-affected")


@pytest.fixture(scope="module")
def transformers_with_diff(tmp_path_factory):
    # written against transformers main (5.24.0): 4.57 re-dispatches instead, 5.0-5.3 load differently
    return upstream_diff_copy(PATCH_ID, tmp_path_factory, "4.57 re-dispatches instead; 5.0-5.3 load differently")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_upstream_diff_alone(scenario, transformers_with_diff):
    # Everything disabled, peft's own placement included: the transformers fix alone must be enough here.
    assert_equals_reference(run_scenario(scenario, patched=False, pythonpath=[transformers_with_diff]))


# -- in-process -------------------------------------------------------------------------------------


def test_disk_entries_are_read_as_cpu_for_the_adapter():
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "disk", "lm_head": "disk"}
    assert patch_module._adapter_loading_map(device_map) == {
        "model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "cpu"}
    assert device_map["lm_head"] == "disk"  # the model's own map is not modified


def test_a_new_placement_is_refused_with_what_to_do():
    def load_adapter(peft_model_id=None, adapter_name=None, revision=None, token=None, device_map="auto",
                     max_memory=None, offload_folder=None):  # transformers 4.57's signature, abridged
        return None

    patch_module._refuse_new_placement(load_adapter, ("adapter",), {})
    patch_module._refuse_new_placement(load_adapter, ("adapter",), {"offload_folder": "x"})
    for kwargs in ({"device_map": {"": "cpu"}}, {"max_memory": {"cpu": "1GiB"}}, {"device_map": "sequential"}):
        with pytest.raises(MetapatchError, match="choose the placement when loading the base model"):
            patch_module._refuse_new_placement(load_adapter, ("adapter",), kwargs)


def test_redispatch_skipped_only_inside_load_adapter():
    calls = []
    assert patch_module.dispatch_accelerate_model(lambda *a, **k: calls.append(a) or "dispatched", None, (1,), {}) \
        == "dispatched"
    token = patch_module._KEEPING_PLACEMENT.set(True)
    try:
        assert patch_module.dispatch_accelerate_model(lambda *a, **k: calls.append(a), None, (2,), {}) is None
    finally:
        patch_module._KEEPING_PLACEMENT.reset(token)
    assert calls == [(1,)]
