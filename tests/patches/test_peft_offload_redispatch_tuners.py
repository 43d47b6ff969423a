"""peft-offload-redispatch over every tuner and entry point, the all-disk re-dispatch and one training
step: unpatched (the upstream errors or silently different results) / patched (equal to the
in-memory model) / upstream fix (accelerate 1.15 for the all-disk map).

Every reproducer runs in its own interpreter; all runs of this file start together once per
session, two at a time (the machine is small), and the tests read their outcomes.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from metapatch import registry
from metapatch.diffs import apply_to_copy, diffs_for
from metapatch.patches.peft_offload_redispatch import PATCH as REDISPATCH
from metapatch.selftest import run_scenario, scenarios_for

SCENARIOS = {s.name: s for s in scenarios_for(REDISPATCH.id)}
NEW = ("tuners-from-pretrained", "tuners-get-peft-model", "lora-entry-points", "all-disk-redispatch",
       "train-step-fp32", "train-step-nf4")
# What the upstream peft diff alone (metapatch disabled) must fix. Not lora-entry-points: the diff
# leaves PeftMixedModel.from_pretrained as it is (it removes the hooks first; metapatch wraps it).
# all-disk-redispatch also needs accelerate >= 1.15 (the accelerate side is fixed there).
WITH_DIFF = ("tuners-from-pretrained", "tuners-get-peft-model", "train-step-fp32", "all-disk-redispatch")
# Where the series does less than the patch (written in the patch's docstring and in the diffs'
# descriptions): what the scenario says with the series alone.
DIFF_FALLS_SHORT = {
    "lora-entry-points": "PeftMixedModel/lora: FAILED",  # left removing the hooks first
    # The backward dequantizes with a QuantState moved to meta: whatever memory it reads (NaN on one run, 6.7e+24 on
    # another), never the in-memory gradient.
    "train-step-nf4": "gradient differs (max abs diff ",  # bitsandbytes moves the saved QuantState
}


def affected() -> bool:
    return registry.gate(REDISPATCH).affected


def _accelerate_fixes_all_disk() -> bool:
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__) >= Version("1.15.0")


@pytest.fixture(scope="session")
def outcomes(tmp_path_factory):
    base = tmp_path_factory.mktemp("peft-tuners")
    jobs = {}
    for name in NEW:
        for patched in (False, True):
            cwd = base / f"{name}-{'patched' if patched else 'unpatched'}"
            cwd.mkdir()
            jobs[(name, patched)] = (SCENARIOS[name], patched, cwd)
    copy = apply_to_copy(diffs_for(REDISPATCH.id), base / "upstream-peft")  # the series of peft diffs, in order
    for name in (*WITH_DIFF, *DIFF_FALLS_SHORT):
        cwd = base / f"{name}-diff"
        cwd.mkdir()
        jobs[(name, "diff")] = (SCENARIOS[name], False, cwd)
    # Where the series falls short, it is measured as `metapatch diffs check --run` does: only this
    # patch off (the nf4 step also needs bnb-quant-state-offload to load at all).
    only_this_off = {"METAPATCH_DISABLE": REDISPATCH.id}
    short = {(name, "diff") for name in DIFF_FALLS_SHORT}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run_scenario, s, cwd=str(c), patched=p or key in short,
                                    env=only_this_off if key in short else None,
                                    pythonpath=[str(copy)] if key[1] == "diff" else ())
                   for key, (s, p, c) in jobs.items()}
        results = {key: future.result() for key, future in futures.items()}
    results["cwd"] = {key: c for key, (_, _, c) in jobs.items()}
    return results


def _explain(outcome) -> str:
    return f"{outcome.error_type}: {outcome.error}\n{outcome.traceback[-3000:]}\n{outcome.stderr_tail[-1500:]}"


@pytest.mark.parametrize("name", NEW)
def test_patched_equals_the_in_memory_model_and_writes_nothing_in_the_working_directory(outcomes, name):
    outcome = outcomes[(name, True)]
    assert outcome.passed, _explain(outcome)
    assert outcome.states[REDISPATCH.id] == ("applied" if affected() else "not-affected")
    assert outcome.metrics["max_abs_diff"] == 0.0 if "max_abs_diff" in outcome.metrics else True
    assert list(outcomes["cwd"][(name, True)].iterdir()) == []


def test_patched_tuner_cases_are_all_equal_not_refused(outcomes):
    # Every tuner works: no case was accepted as a MetapatchError refusal.
    for name in ("tuners-from-pretrained", "tuners-get-peft-model", "lora-entry-points"):
        metrics = outcomes[(name, True)].metrics
        assert metrics and all(value == "ok" for value in metrics.values()), metrics


def test_unpatched_get_peft_model_is_silently_wrong_or_fails(outcomes):
    outcome = outcomes[("tuners-get-peft-model", False)]
    if not affected():
        pytest.skip("peft outside the patch's range")
    assert not outcome.passed
    assert outcome.error_type == SCENARIOS["tuners-get-peft-model"].expected_error, _explain(outcome)
    # LoRA: no error at all, other logits (the adapters of the disk layers are on meta)
    assert "get_peft_model/lora: FAILED: logits differ" in outcome.error, outcome.error
    # IA3: the meta vector at the first forward
    assert "get_peft_model/ia3: FAILED: RuntimeError: Tensor on device meta" in outcome.error, outcome.error


def test_unpatched_from_pretrained_fails_for_the_tuners(outcomes):
    outcome = outcomes[("tuners-from-pretrained", False)]
    if not affected():
        pytest.skip("peft outside the patch's range")
    assert not outcome.passed
    assert outcome.error_type == "AssertionError", _explain(outcome)
    assert "PeftModel.from_pretrained/ia3: FAILED" in outcome.error
    assert "Cannot copy out of meta tensor" in outcome.error


def test_unpatched_entry_points_fail(outcomes):
    outcome = outcomes[("lora-entry-points", False)]
    if not affected():
        pytest.skip("peft outside the patch's range")
    assert not outcome.passed, _explain(outcome)
    assert outcome.error_type == "AssertionError", _explain(outcome)


def test_unpatched_all_disk_map_is_refused_before_accelerate_1_15(outcomes):
    outcome = outcomes[("all-disk-redispatch", False)]
    assert not outcome.passed  # PEFT's own re-dispatch bugs remain on every accelerate
    if not _accelerate_fixes_all_disk():
        assert outcome.error_type == "ValueError", _explain(outcome)
        assert "offload the whole model to the disk" in outcome.error


def test_unpatched_training_step_gets_meta_gradients(outcomes):
    outcome = outcomes[("train-step-fp32", False)]
    if not affected():
        pytest.skip("peft outside the patch's range")
    assert not outcome.passed
    assert outcome.error_type == SCENARIOS["train-step-fp32"].expected_error, _explain(outcome)
    assert "meta" in outcome.error


def test_patched_training_step_trains_only_the_adapter(outcomes):
    for name in ("train-step-fp32", "train-step-nf4"):
        metrics = outcomes[(name, True)].metrics
        assert metrics["trainable"] == 32, metrics  # lora_A/lora_B of 4 modules x 4 layers
        assert metrics["max_abs_diff"] == 0.0


@pytest.mark.parametrize("name", WITH_DIFF)
def test_upstream_peft_diff_alone_fixes_the_reproducer(outcomes, name):
    outcome = outcomes[(name, "diff")]
    if name == "all-disk-redispatch" and not _accelerate_fixes_all_disk():
        assert not outcome.passed and "offload the whole model to the disk" in outcome.error, _explain(outcome)
        return
    assert outcome.passed, _explain(outcome)
    assert list(outcomes["cwd"][(name, "diff")].iterdir()) == []


@pytest.mark.parametrize("name", sorted(DIFF_FALLS_SHORT))
def test_where_the_peft_series_falls_short_is_what_the_docs_say(outcomes, name):
    outcome = outcomes[(name, "diff")]
    if outcome.not_applicable:
        pytest.skip(f"{name} is n/a here: {outcome.not_applicable}")
    if not affected():
        pytest.skip("peft outside the patch's range")
    # The day the series (or bitsandbytes) does this too, the patch docstring and the diff
    # descriptions must say so: this test then fails.
    assert not outcome.passed, "the series now does this too: update the docs"
    assert DIFF_FALLS_SHORT[name] in (outcome.error or ""), _explain(outcome)
    if name == "lora-entry-points":
        assert (outcome.error or "").startswith("1 of "), outcome.error  # only PeftMixedModel


# -- in-process checks (cheap) -------------------------------------------------------------------


def test_hold_hook_keeps_an_offloaded_layer_onloaded_for_the_whole_forward():
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from metapatch._offload.adapter_offload import HoldBaseLayerHook, base_layer_onloaded, offload_hook

    layer = torch.nn.Linear(3, 2)
    weight = layer.weight.detach().clone()
    add_hook_to_module(layer, AlignDevicesHook(execution_device="cpu", offload=True))
    assert layer.weight.device.type == "meta"

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = layer

        def get_base_layer(self):
            return self.base_layer

        def forward(self, x):
            out = self.base_layer(x)  # the base hook runs inside: it must not offload here
            return out + x.sum() * self.base_layer.weight.sum()  # a direct read, as DoRA/OFT do

    wrapper = Wrapper()
    add_hook_to_module(wrapper, HoldBaseLayerHook(layer))
    x = torch.ones(1, 3)
    got = wrapper(x)
    want = torch.nn.functional.linear(x, weight, layer._hf_hook.weights_map["bias"]) + x.sum() * weight.sum()
    assert torch.equal(got, want)
    assert layer.weight.device.type == "meta"  # offloaded again afterwards
    assert offload_hook(layer).offload is True
    with base_layer_onloaded(wrapper):
        assert torch.equal(layer.weight, weight)
    assert layer.weight.device.type == "meta"


def _tuner_layer(torch, base, scales):
    """A tuner layer as peft's move reads one: a base layer and a ParameterDict of per-adapter tensors."""

    class Layer(torch.nn.Module):
        adapter_layer_names = ("scales",)
        other_param_names = ()

        def __init__(self):
            super().__init__()
            self.base_layer = base
            self.scales = torch.nn.ParameterDict(scales)

        def get_base_layer(self):
            return self.base_layer

    return Layer()


def test_move_adapter_goes_to_the_execution_device_not_meta():
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from metapatch._offload.adapter_offload import move_adapter_to_execution_device

    layer = _tuner_layer(torch, torch.nn.Linear(3, 2), {"a": torch.nn.Parameter(torch.ones(2, dtype=torch.float64))})
    assert move_adapter_to_execution_device(layer, "a") is False  # not offloaded: upstream decides
    add_hook_to_module(layer.base_layer, AlignDevicesHook(execution_device="cpu", offload=True))
    assert move_adapter_to_execution_device(layer, "a") is True
    assert layer.scales["a"].device.type == "cpu" and layer.scales["a"].dtype == torch.float32
    assert torch.equal(layer.scales["a"], torch.ones(2))
    assert layer.scales["a"].requires_grad  # as it was


def test_moved_adapter_keeps_requires_grad():
    """A cast (or a move to the GPU) makes a new tensor, and a ParameterDict a new Parameter that requires grad:
    a frozen adapter (loaded with is_trainable=False) stays frozen, as peft 0.22 keeps it in its own move."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    from metapatch._offload.adapter_offload import move_adapter_to_execution_device

    layer = _tuner_layer(torch, torch.nn.Linear(3, 2).to(torch.bfloat16),
                         {"frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
                          "trained": torch.nn.Parameter(torch.ones(2))})
    add_hook_to_module(layer.base_layer, AlignDevicesHook(execution_device="cpu", offload=True))
    for name in ("frozen", "trained"):
        assert move_adapter_to_execution_device(layer, name) is True
    assert layer.scales["frozen"].dtype == torch.bfloat16 and not layer.scales["frozen"].requires_grad
    assert layer.scales["trained"].dtype == torch.bfloat16 and layer.scales["trained"].requires_grad


@pytest.mark.parametrize("use_dora", [False, True])
def test_value_free_lora_creation_reads_no_offloaded_weight(tmp_path, monkeypatch, use_dora):
    """A plain LoRA with a value-free initialisation over disk-offloaded layers is created without
    reading one offloaded file (its base layers are stood in for); DoRA reads each targeted base
    weight (its magnitude is the weight's norm). Either way the outputs equal the in-memory model's
    and the base layers stay offloaded."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    if not affected():
        pytest.skip("peft-offload-redispatch is not affected on this stack")
    from accelerate.utils import OffloadedWeightsLoader
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from metapatch.selftest._models import input_ids, save_tiny_llama

    checkpoint = save_tiny_llama(tmp_path / "base")
    layers = AutoModelForCausalLM.from_pretrained(checkpoint).config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "disk" for i in range(layers)}}
    reads = []
    original_getitem = OffloadedWeightsLoader.__getitem__

    def counted(self, key):
        reads.append(key)
        return original_getitem(self, key)

    def lora_over(model):
        torch.manual_seed(0)
        config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=use_dora)
        return get_peft_model(model, config).eval()

    reference = lora_over(AutoModelForCausalLM.from_pretrained(checkpoint))
    base = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                offload_folder=str(tmp_path / "offload"))
    q_proj = base.model.layers[0].self_attn.q_proj
    meta_weight = q_proj.weight
    monkeypatch.setattr(OffloadedWeightsLoader, "__getitem__", counted)
    model = lora_over(base)
    created_reads = list(reads)
    monkeypatch.setattr(OffloadedWeightsLoader, "__getitem__", original_getitem)
    if use_dora:
        assert any(key.endswith("q_proj.weight") for key in created_reads), created_reads
    else:
        assert created_reads == []
        assert q_proj.weight is meta_weight  # stood in for, then given back (no onload/offload round trip)
    assert q_proj.weight.device.type == "meta"
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
