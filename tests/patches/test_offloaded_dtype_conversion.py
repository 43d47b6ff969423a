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


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"to-dtype-layers-on-disk", "to-own-device-and-dtype-layers-on-disk"}}


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
