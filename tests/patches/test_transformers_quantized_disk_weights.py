"""transformers-quantized-disk-weights: three-way proof per scenario (unpatched: the upstream error; patched:
equal to the in-memory 4-bit model; the transformers diff together with bitsandbytes' meta-safe QuantState diff,
without metapatch), on the execution device (cuda:0 where CUDA is present), and what the patch leaves alone."""

from __future__ import annotations

import pytest

from metapatch.diffs import diffs_for
from metapatch.patches.bnb_cpu_repack_copy import PATCH as REPACK_PATCH
from metapatch.patches.bnb_quant_state_offload import PATCH as QUANT_STATE_PATCH
from metapatch.patches.transformers_quantized_disk_weights import (PATCH, _FINAL_MAPS, _entry, _main_device,
                                                                  bnb4bit_quantize_convert, validate_environment)
from tests.patches._three_way import ThreeWayCase


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"auto-map-disk-layers", "auto-map-generate-save", "auto-map-peft-adapter",
                        "prequantized-checkpoint", "explicit-map-fp32-offload"}}

    def diff_companions(self, patch_id):
        # The placeholder's quant_state must survive accelerate's moves to meta: bitsandbytes' own fix.
        return (QUANT_STATE_PATCH.id,)

    def diff_series(self, patch_id):
        if patch_id == QUANT_STATE_PATCH.id:
            # bitsandbytes' fixes on one copy: the meta-safe QuantState, and the lossless save of a layer
            # repacked for the CPU kernel (AVX512-BF16 CPUs), which save_pretrained after a forward needs there
            return [*diffs_for(QUANT_STATE_PATCH.id), *diffs_for(REPACK_PATCH.id)]
        return super().diff_series(patch_id)

    def diff_skip(self, scenario):
        if scenario.name == "auto-map-peft-adapter":
            # without metapatch, PeftModel.from_pretrained over an offloaded base has peft's own bugs
            # (peft-offload-redispatch: a re-dispatch that writes an offload folder into the working directory)
            return "needs peft's own fixes (peft-offload-redispatch's diff series) besides these"
        return super().diff_skip(scenario)

    def check_patched(self, scenario, outcome):
        if scenario.name == "auto-map-disk-layers":
            combos = {key for key in outcome.metrics if key.count("/") == 2}
            assert len(combos) == 8, outcome.metrics  # nf4/fp4 x double quant x two compute dtypes
        if scenario.name == "auto-map-generate-save":
            assert outcome.metrics["generated_tokens"] == 8 and "reloaded" in outcome.metrics, outcome.metrics


def test_main_device_is_the_first_accelerator_of_the_map():
    torch = pytest.importorskip("torch")
    assert _main_device({"a": "cpu", "b": "disk"}) is None
    assert _main_device({"a": "cpu", "b": 0, "c": "disk"}) == torch.device("cuda", 0)
    assert _main_device({"a": "cuda:1", "b": "disk"}) == torch.device("cuda", 1)


def test_entry_is_the_longest_matching_module_prefix():
    device_map = {"model": 0, "model.layers.1": "disk", "model.layers.10": "cpu"}
    assert _entry(device_map, "model.layers.1.mlp.up_proj.weight") == "disk"
    assert _entry(device_map, "model.layers.10.mlp.up_proj.weight") == "cpu"
    assert _entry(device_map, "model.layers.11.mlp.up_proj.weight") == 0
    assert _entry({"": "disk"}, "lm_head.weight") == "disk"


class _Quantizer:  # stands in for transformers' quantizer: the wrappers only key a weak map on it
    pass


def test_final_map_is_recorded_only_where_it_offloads():
    quantizer = _Quantizer()
    validate_environment(lambda *a, **k: None, quantizer, (), {"device_map": "auto"})
    assert quantizer not in _FINAL_MAPS
    validate_environment(lambda *a, **k: None, quantizer, (), {"device_map": {"": 0, "model.layers.1": "disk"}})
    assert _FINAL_MAPS[quantizer] == {"": "cuda:0", "model.layers.1": "disk"}
    validate_environment(lambda *a, **k: None, quantizer, (), {"device_map": {"": 0}})
    assert quantizer not in _FINAL_MAPS


def test_final_map_reads_every_spelling_of_a_device():
    """accelerate takes ``torch.device("cpu")`` and ``0`` in a map as it takes "cpu" and "cuda:0": a map spelled so
    offloads to the CPU and computes on GPU 0 (it was not recorded at all, so the offloaded weight was quantized
    on the CPU)."""
    torch = pytest.importorskip("torch")
    quantizer = _Quantizer()
    device_map = {"model.embed_tokens": torch.device("cpu"), "model.layers.0": torch.device("cuda", 0),
                  "lm_head": 0}
    validate_environment(lambda *a, **k: None, quantizer, (), {"device_map": device_map})
    assert _main_device(_FINAL_MAPS[quantizer]) == torch.device("cuda", 0)
    assert _entry(_FINAL_MAPS[quantizer], "model.embed_tokens.weight") == "cpu"


def test_quantization_op_moves_offloaded_weights_to_the_main_device_and_back(monkeypatch):
    """The path only a GPU map takes, with the CPU standing in for the accelerator: the op gets the offloaded
    weight on the main device, and its quantized result comes back on the cpu, still naming its module."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from metapatch.patches import transformers_quantized_disk_weights as patch

    layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
    op = type("Op", (), {"hf_quantizer": _Quantizer()})()
    patch._FINAL_MAPS[op.hf_quantizer] = {"model.layers.0": 0, "model.layers.1": "disk"}
    moved_to = []
    original_to = patch._to
    monkeypatch.setattr(patch, "_to", lambda value, device: moved_to.append(device) or original_to(value, device))
    monkeypatch.setattr(patch, "_main_device", lambda device_map: torch.device("cpu"))

    def convert(input_dict, full_layer_name=None, model=None, **kwargs):  # what transformers' op returns
        (value,) = input_dict[full_layer_name]  # a list of one tensor, as the loader collects it
        return {full_layer_name: bnb.nn.Params4bit(value, requires_grad=False, quant_type="nf4", module=layer).to("cpu")}

    weight = torch.randn(64, 64)
    kept = bnb4bit_quantize_convert(convert, op, ({"model.layers.1.q.weight": [weight]},),
                                    {"full_layer_name": "model.layers.1.q.weight", "model": None})
    value = kept["model.layers.1.q.weight"]
    assert set(moved_to) == {torch.device("cpu")} and value.bnb_quantized and value.module is layer
    assert value.device.type == "cpu" and value.quant_state.absmax.device.type == "cpu"
    moved_to.clear()  # a weight the map keeps on the main device is quantized where it is, untouched
    bnb4bit_quantize_convert(convert, op, ({"model.layers.0.q.weight": [weight]},),
                             {"full_layer_name": "model.layers.0.q.weight", "model": None})
    assert moved_to == []
