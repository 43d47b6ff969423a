"""offloaded-dtype-conversion: three-way proof on a tiny Llama loaded with layers on disk and converted
with model.to(dtype) / model.to(<execution device>, dtype) (subprocesses, real from_pretrained), and
in-process checks of the installed `to`: real moves still reach accelerate's refusal, models without
offload keep accelerate's (or torch's) own `to`."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.offloaded_dtype_conversion import PATCH
from metapatch.selftest.offloaded_dtype_conversion import REFUSAL

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


_STORED = {"to-bf16-then-fp32-layers-on-disk", "half-then-float-layers-on-disk", "half-then-save-layers-on-disk"}


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"to-dtype-layers-on-disk", "to-own-device-and-dtype-layers-on-disk", *_STORED}}


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
def test_a_real_move_to_another_device_is_metapatchs_refusal(tmp_path):
    """A move that would need the offloaded head's values (to a GPU, from this model's CPU execution device): a
    MetapatchError naming the offloaded weights and what to do; still a RuntimeError, as accelerate's refusal was."""
    from metapatch.selftest._models import input_ids

    model = _dispatched(tmp_path, offload=True)
    with torch.no_grad():
        before = model(input_ids()).logits
    with pytest.raises(metapatch.MetapatchError, match="lm_head") as refused:
        model.to("cuda:0", torch.float16)
    assert isinstance(refused.value, RuntimeError) and PATCH.id in str(refused.value)
    assert model.lm_head.weight.is_meta and model.lm_head.weight.dtype == torch.float32  # nothing converted
    with torch.no_grad():
        assert torch.equal(model(input_ids()).logits, before)


@pytest.mark.gpu(count=1)
@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
def test_cuda_on_a_model_computing_on_gpu_0_moves_nothing_as_in_memory(tmp_path):
    """accelerate guards ``model.cuda`` on a GPU machine as it guards ``to``: on a model whose every tensor in memory
    and every hook is on GPU 0 it is a no-op in memory, and here; a move to another device is metapatch's refusal."""
    from metapatch.selftest._models import input_ids, save_tiny_llama
    from transformers import AutoModelForCausalLM

    checkpoint = save_tiny_llama(tmp_path / "ckpt", num_hidden_layers=2)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"": 0}).eval()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map={"model": 0, "lm_head": "disk"},
                                                 offload_folder=str(tmp_path / "offload")).eval()
    assert model.lm_head.weight.is_meta
    assert model.cuda() is model and model.cuda(0) is model
    with torch.no_grad():
        assert torch.equal(model(input_ids().to(0)).logits, reference(input_ids().to(0)).logits)
    with pytest.raises(metapatch.MetapatchError, match="lm_head"):
        model.to("cpu")


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


def _pair(tmp_path, device_map):
    from metapatch.selftest._models import save_tiny_llama
    from transformers import AutoModelForCausalLM

    checkpoint = save_tiny_llama(tmp_path / "ckpt", num_hidden_layers=2)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload")).eval()
    return reference, model


_CHAINS = {
    "to-bf16-float": lambda m: m.to(torch.bfloat16).float(),
    "bfloat16-to-fp32": lambda m: m.bfloat16().to(dtype=torch.float32),
    "half-double-float": lambda m: m.half().double().float(),
    "to-own-device-fp16-fp32": lambda m: m.to("cpu", torch.float16).to(torch.float32),
}


@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
@pytest.mark.parametrize("chain", sorted(_CHAINS))
def test_conversion_chains_keep_every_lossy_step(tmp_path, chain):
    """Every conversion method and chain gives the in-memory model's logits and saved tensors (torch.equal);
    the offloaded layers stay on meta (nothing loaded as a whole)."""
    from metapatch.selftest._models import input_ids

    reference, model = _pair(tmp_path, {"model.embed_tokens": "cpu", "model.layers.0": "disk",
                                        "model.layers.1": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                                        "lm_head": "disk"})
    assert _CHAINS[chain](reference) is reference and _CHAINS[chain](model) is model
    assert model.model.layers[0].mlp.up_proj.weight.is_meta and model.lm_head.weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(input_ids()).logits, reference(input_ids()).logits)
    # save_pretrained reads the offloaded tensors through the hooks' weights maps: served converted
    from transformers.integrations.accelerate import load_offloaded_parameter

    for name in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        got = load_offloaded_parameter(model, name)
        assert got.dtype == torch.float32 and torch.equal(got, reference.state_dict()[name])


@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
@pytest.mark.parametrize("chain", ["to-bf16-float", "half-double-float"])
def test_a_deep_copy_converts_itself_and_not_the_original(tmp_path, chain):
    """``copy.deepcopy`` (a reference model for DPO/PPO) copies the conversion methods bound to the copy: the flow
    tester found ``copy.to(torch.bfloat16)`` converting the original's offloaded weights and not the copy's."""
    import copy

    from metapatch.selftest._models import input_ids

    reference, model = _pair(tmp_path, {"model.embed_tokens": "cpu", "model.layers.0": "disk",
                                        "model.layers.1": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                                        "lm_head": "disk"})
    with torch.no_grad():
        untouched = model(input_ids()).logits
    copies = [copy.deepcopy(reference), copy.deepcopy(model)]
    for duplicate in copies:
        assert _CHAINS[chain](duplicate) is duplicate
    with torch.no_grad():
        assert torch.equal(copies[1](input_ids()).logits, copies[0](input_ids()).logits)
        assert not torch.equal(copies[1](input_ids()).logits, untouched)
        assert torch.equal(model(input_ids()).logits, untouched)  # the original is as it was


def test_nothing_offloaded_converts_as_upstream(tmp_path):
    """Without offload nothing is installed: the chain is torch's own, byte-equal to the in-memory model."""
    from metapatch.selftest._models import input_ids

    reference, model = _pair(tmp_path, {"": "cpu"})
    assert "half" not in model.__dict__ and "to" not in model.__dict__
    model.to(torch.bfloat16).half().float()
    reference.to(torch.bfloat16).half().float()
    with torch.no_grad():
        assert torch.equal(model(input_ids()).logits, reference(input_ids()).logits)


@pytest.mark.skipif(not AFFECTED, reason=f"not affected here: {WHY}")
def test_removing_the_hooks_removes_the_conversion_methods_on_accelerate_that_tracks_them(tmp_path):
    from accelerate.hooks import remove_hook_from_module

    model = _dispatched(tmp_path, offload=True)
    assert {"to", "half", "float", "bfloat16", "double"} <= set(model.__dict__)
    remove_hook_from_module(model, recurse=True)
    left = {name for name in ("to", "half", "float", "bfloat16", "double") if name in model.__dict__}
    import accelerate.hooks as hooks

    if hasattr(hooks, "_accelerate_added_attributes"):  # older releases remove a fixed list of names
        assert "to" not in left
    else:
        assert not left
