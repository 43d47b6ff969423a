"""peft-offload-redispatch through ``PeftMixedModel``'s own entry points over an offloaded base: ``add_adapter``,
``load_adapter`` and ``set_adapter`` with several adapters active. PEFT passes the mixed wrapper itself to
``inject_adapter``; its ``__dict__`` holds neither the base's ``hf_device_map`` nor its hook, so the patch must
find the offloaded base inside the wrapper, or the new adapter's tensors stay on meta (logits off by tens, or
NaN). The oracle is the same flow on an in-memory base; the adapters are non-zero
(``init_lora_weights=False``), so an adapter that was lost changes the logits.

The maps name ``cpu`` and ``disk`` only: every model computes on the CPU whatever the machine has."""

from __future__ import annotations

import pytest

import metapatch  # first: the patch under test
from metapatch.patches.peft_offload_redispatch import PATCH
from metapatch.selftest._models import input_ids, save_tiny_llama

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)
pytestmark = pytest.mark.skipif(not AFFECTED, reason=f"peft-offload-redispatch not in range here: {WHY}")


def _device_map(placement):
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": placement}
    device_map.update({f"model.layers.{i}": ("disk" if i % 2 else placement) for i in range(4)})
    return device_map


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-mixed")
    checkpoint = save_tiny_llama(root / "base")
    # A saved LoRA adapter (non-zero) for load_adapter, written from an in-memory PeftModel.
    from transformers import LlamaForCausalLM

    torch.manual_seed(11)
    donor = peft.get_peft_model(LlamaForCausalLM.from_pretrained(checkpoint),
                                peft.LoraConfig(r=2, target_modules=["o_proj", "down_proj"], init_lora_weights=False))
    donor.save_pretrained(root / "adapter")
    return root, checkpoint, root / "adapter"


def _flow(files, offload_dir, entry):
    """A PeftMixedModel over an offloaded base (``offload_dir``) or an in-memory one (None): the first adapter at
    construction, then ``entry``; logits with every adapter active."""
    from transformers import LlamaForCausalLM

    _, checkpoint, adapter = files
    if offload_dir is None:
        base = LlamaForCausalLM.from_pretrained(checkpoint)
    else:
        base = LlamaForCausalLM.from_pretrained(checkpoint, device_map=_device_map(offload_dir[1]),
                                                offload_folder=str(offload_dir[0]))
    torch.manual_seed(3)
    model = peft.PeftMixedModel(base.eval(), peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False),
                                "first")
    torch.manual_seed(4)
    if entry == "add_adapter":
        model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["v_proj", "lm_head"], init_lora_weights=False))
    elif entry == "add_adapter-loha":
        model.add_adapter("second", peft.LoHaConfig(r=2, target_modules=["v_proj", "up_proj"], init_weights=False))
    else:
        model.load_adapter(str(adapter), "second")
    model.set_adapter(["first", "second"])
    with torch.no_grad():
        return model.eval()(input_ids=input_ids()).logits, model


@pytest.mark.parametrize("placement", ["cpu", "disk"])
@pytest.mark.parametrize("entry", ["add_adapter", "add_adapter-loha", "load_adapter"])
def test_mixed_model_entry_points_over_an_offloaded_base(files, tmp_path, entry, placement):
    want, _ = _flow(files, None, entry)
    got, model = _flow(files, (tmp_path / "offload", placement), entry)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), f"max abs diff {(got - want).abs().max().item():.3g}"
    # the base is still offloaded (the adapters follow its hooks; nothing was onloaded for good)
    assert any(p.is_meta for n, p in model.named_parameters() if "lora" not in n and "hada" not in n)
