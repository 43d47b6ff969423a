"""offloaded-model-device (transformers 5.x; offloaded-model-device-v4 is the 4.57 line, its three-way proof in
test_offloaded_model_device_v4.py): three-way proof on a Llama loaded with its embedding on disk
(subprocesses), plus in-process checks of the property on models offloaded with accelerate's own entry points.

Measured unpatched (RuntimeError "Tensor.item() cannot be called on meta tensors" in generate()'s
_prepare_special_tokens): transformers 4.57.6, 5.11.0, 5.17.0, 5.24.0."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.offloaded_model_device import PATCH
from metapatch.patches.offloaded_model_device_v4 import PATCH as V4_PATCH
from metapatch.selftest import scenarios_for

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

GATES = {p.id: metapatch.registry.gate(p) for p in (PATCH, V4_PATCH)}
# The patch for the installed release line; the other line's scenarios report n/a here (their requires).
ACTIVE = V4_PATCH if GATES[V4_PATCH.id][0] else PATCH
AFFECTED, WHY, _, _ = GATES[ACTIVE.id]
NAMES = {"generate-embedding-on-disk", "device-unchanged-when-not-offloaded"}


def test_exactly_one_release_line_is_affected():
    assert not (GATES[PATCH.id][0] and GATES[V4_PATCH.id][0])


def test_each_release_line_runs_where_the_other_does_not():
    for name in NAMES:
        (new,), (old,) = ([s for s in scenarios_for(p.id) if s.name == name] for p in (PATCH, V4_PATCH))
        assert bool(new.not_applicable_here()) != bool(old.not_applicable_here()), (new.requires, old.requires)


class TestThreeWay(ThreeWayCase):
    """The 5.x line; tests/patches/test_offloaded_model_device_v4.py runs the same scenarios for 4.57."""

    patch_ids = (PATCH.id,)
    names = {PATCH.id: NAMES}

    def check_patched(self, scenario, outcome):
        if scenario.name == "generate-embedding-on-disk" and AFFECTED:
            # the offload hook's execution device (cuda:0 where CUDA is present), for the model and its base
            assert outcome.metrics["model_device"] == outcome.metrics["inner_model_device"] == outcome.device


# -- in-process: the property as installed in this test process --------------------------------

torch = pytest.importorskip("torch")
accelerate = pytest.importorskip("accelerate")
needs_patch = pytest.mark.skipif(not AFFECTED, reason=f"patch not active here: {WHY}")


def _tiny_llama():
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2)).eval()


@needs_patch
def test_cpu_offload_reports_the_execution_device():
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    accelerate.cpu_offload(model, execution_device="cpu")  # every weight on meta behind a leaf hook
    assert model.model.embed_tokens.weight.is_meta
    assert model.device == torch.device("cpu") and model.model.device == torch.device("cpu")
    with torch.no_grad():
        assert torch.equal(model(ids.to(model.device)).logits, expected)


@needs_patch
def test_hook_on_an_ancestor_that_places_submodules():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from accelerate.utils import OffloadedWeightsLoader

    model = _tiny_llama()
    state = dict(model.model.state_dict())
    # one hook on the whole base model, as accelerate's hooks on blocks do with place_submodules; it puts
    # every parameter of the base model on meta
    add_hook_to_module(model.model, AlignDevicesHook(execution_device="cpu", offload=True, place_submodules=True,
                                                     weights_map=OffloadedWeightsLoader(state_dict=state)))
    assert model.model.embed_tokens.weight.is_meta
    assert model.model.device == torch.device("cpu") and model.device == torch.device("cpu")
    # an offload hook below the first parameter's owner does not govern it: a meta embedding is still meta
    genuinely_meta = _tiny_llama()
    add_hook_to_module(genuinely_meta.model.layers[0], AlignDevicesHook(execution_device="cpu", offload=True,
                                                                        place_submodules=True))
    genuinely_meta.model.embed_tokens.to("meta")
    assert genuinely_meta.device == torch.device("meta")


def test_models_that_are_not_offloaded_keep_upstream_answer():
    from accelerate import init_empty_weights
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from transformers import LlamaForCausalLM

    from metapatch.selftest._models import tiny_llama_config

    model = _tiny_llama()
    assert model.device == torch.device("cpu")
    add_hook_to_module(model, AlignDevicesHook(execution_device="cpu", io_same_device=True))  # dispatched, no offload
    assert model.device == torch.device("cpu")
    with init_empty_weights():
        empty = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=1))
    assert empty.device == torch.device("meta")


@needs_patch
def test_unpatch_restores_the_original_property():
    from transformers.modeling_utils import ModuleUtilsMixin

    installed = vars(ModuleUtilsMixin)["device"]
    original = getattr(installed, "_self_metapatch")[2]
    model = _tiny_llama()
    accelerate.cpu_offload(model, execution_device="cpu")
    metapatch.unpatch(ACTIVE.id)
    try:
        assert vars(ModuleUtilsMixin)["device"] is original
        assert model.device == torch.device("meta")  # upstream's answer
    finally:
        metapatch.install([ACTIVE.id])
    assert vars(ModuleUtilsMixin)["device"] is installed or model.device == torch.device("cpu")
    assert {r["id"]: r["state"] for r in metapatch.status()}[ACTIVE.id] == "applied"
