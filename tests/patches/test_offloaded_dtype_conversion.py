"""offloaded-dtype-conversion: three-way proof on a tiny Llama loaded with layers on disk and converted
with model.to(dtype) / model.to(<execution device>, dtype) (subprocesses, real from_pretrained), and
in-process checks of the installed `to`: real moves still reach accelerate's refusal, models without
offload keep accelerate's (or torch's) own `to`."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.offloaded_dtype_conversion import PATCH
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, assert_upstream_error, upstream_diff_copy

PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
REFUSAL = "You can't move a model that has some modules offloaded"


def test_scenarios_exist():
    assert {s.name for s in SCENARIOS} == {"to-dtype-layers-on-disk", "to-own-device-and-dtype-layers-on-disk"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[PATCH_ID] == "disabled"
    assert_upstream_error(outcome, scenario, WHY, REFUSAL)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    if not AFFECTED:
        pytest.skip(f"not affected here: {WHY}")
    assert_equals_reference(outcome)


@pytest.fixture(scope="module")
def accelerate_with_diff(tmp_path_factory):
    return upstream_diff_copy(PATCH_ID, tmp_path_factory)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_upstream_diff_alone(scenario, accelerate_with_diff):
    assert_equals_reference(run_scenario(scenario, patched=False, pythonpath=[accelerate_with_diff]))


torch = pytest.importorskip("torch")


def _dispatched(tmp_path, offload: bool):
    from metapatch.selftest._models import save_tiny_llama
    from transformers import AutoModelForCausalLM

    checkpoint = save_tiny_llama(tmp_path / "ckpt", num_hidden_layers=2)
    device_map = {"model": "cpu", "lm_head": "disk" if offload else "cpu"}
    return AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                offload_folder=str(tmp_path / "offload")).eval()


@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
def test_a_real_move_is_still_refused(tmp_path):
    model = _dispatched(tmp_path, offload=True)
    assert getattr(model.__dict__["to"], "_metapatch_conversion_to", False)
    with pytest.raises(RuntimeError, match=REFUSAL):
        model.to("meta")  # a device other than the execution device
    with pytest.raises(RuntimeError, match=REFUSAL):
        model.to("meta", torch.float16)
    assert model.lm_head.weight.is_meta and model.lm_head.weight.dtype == torch.float32  # nothing converted


@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
def test_memory_format_and_no_argument_calls_convert_in_place(tmp_path):
    model = _dispatched(tmp_path, offload=True)
    assert model.to(memory_format=torch.channels_last) is model
    assert model.to() is model
    assert model.lm_head.weight.is_meta


def test_nothing_installed_without_offload(tmp_path):
    model = _dispatched(tmp_path, offload=False)
    assert not getattr(model.__dict__.get("to"), "_metapatch_conversion_to", False)
    assert model.to(torch.bfloat16).dtype == torch.bfloat16
