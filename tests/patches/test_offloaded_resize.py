"""offloaded-resize-token-embeddings: three-way proof on real offloaded models (subprocesses), plus in-process
checks of the resized weights map and of the refusal for an embedding offloaded inside a larger block."""

from __future__ import annotations

import pytest

import metapatch
from metapatch import MetapatchError
from metapatch.patches import offloaded_resize_token_embeddings as patch_module
from metapatch.selftest import run_scenario, scenarios_for

from _three_way import assert_equals_reference, assert_upstream_error, upstream_diff_copy  # tests/patches/_three_way.py

PATCH = patch_module.PATCH
PATCH_ID = PATCH.id
SCENARIOS = scenarios_for(PATCH_ID)
AFFECTED, WHY, VERSIONS, _ = metapatch.registry.gate(PATCH)
UPSTREAM_ERRORS = {
    "RuntimeError": "Tensor.item() cannot be called on meta tensors",
    "ValueError": "Trying to set a tensor of shape torch.Size([128, 64])",
}


def test_scenarios_exist():
    assert {s.name for s in SCENARIOS} == {"resize-offloaded-untied", "resize-offloaded-tied",
                                           "resize-offloaded-no-mean-resizing"}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_unpatched(scenario):
    outcome = run_scenario(scenario, patched=False)
    assert outcome.states[PATCH_ID] == "disabled"
    if AFFECTED:
        assert_upstream_error(outcome, scenario, WHY, UPSTREAM_ERRORS[scenario.expected_error])
    else:
        assert outcome.passed, outcome.traceback or outcome.stderr_tail


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_patched(scenario):
    outcome = run_scenario(scenario, patched=True)
    assert_equals_reference(outcome)
    assert outcome.metrics["tied"] is (scenario.name == "resize-offloaded-tied")
    assert outcome.states[PATCH_ID] == ("applied" if AFFECTED else "not-affected")


@pytest.fixture(scope="module")
def transformers_with_diff(tmp_path_factory):
    return upstream_diff_copy(PATCH_ID, tmp_path_factory, "written against transformers main, 5.24.0")


def _tied_disk_pair_loads_unpatched() -> tuple:
    """A tied embedding/head pair on disk loads (KeyError 'lm_head.weight' at the first forward before
    transformers 5.13) only with the tied-device-map patches there, which the diff-alone run disables."""
    for patch_id in ("tied-device-map-disk-index", "tied-device-map-transformers-v4"):
        patch = metapatch.registry.patches.get(patch_id)
        if patch is not None and metapatch.registry.gate(patch).affected:
            return False, f"{patch_id} is needed here to load a tied pair offloaded to disk"
    return True, ""


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_upstream_diff_alone(scenario, transformers_with_diff):
    loads, why = _tied_disk_pair_loads_unpatched()
    if scenario.name == "resize-offloaded-tied" and not loads:
        pytest.skip(why)
    assert_equals_reference(run_scenario(scenario, patched=False, pythonpath=[transformers_with_diff]))


# -- in-process -------------------------------------------------------------------------------------


def test_resized_weights_are_served_in_front_of_the_old_map():
    old = {"weight": "old weight", "bias": "old bias"}
    weights = patch_module.ResizedWeights({"weight": "new weight"}, old)
    assert weights["weight"] == "new weight" and weights["bias"] == "old bias"
    assert sorted(weights) == ["bias", "weight"] and len(weights) == 2 and "bias" in weights
    assert old == {"weight": "old weight", "bias": "old bias"}  # the old map is only read
    with pytest.raises(KeyError):
        patch_module.ResizedWeights({}, None)["weight"]


needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


@needs_patch
def test_embedding_offloaded_inside_a_block_is_refused():
    torch = pytest.importorskip("torch")
    hooks = pytest.importorskip("accelerate.hooks")
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    weights = {name: tensor.detach().clone() for name, tensor in model.model.state_dict().items()}
    # accelerate's own hook, offloading the whole decoder as one block (its submodules have no hook of their own)
    hooks.add_hook_to_module(model.model, hooks.AlignDevicesHook(execution_device="cpu", offload=True,
                                                                 weights_map=weights, place_submodules=True))
    assert model.model.embed_tokens.weight.is_meta
    with pytest.raises(MetapatchError, match="own device_map entries"):
        model.resize_token_embeddings(140)
    assert model.config.vocab_size == 128  # refused before anything changed
