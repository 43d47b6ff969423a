"""peft-prefix-cache-cpu-map: three-way proof on a tiny Llama with a prefix-tuning adapter over a base whose
device map names no accelerator (cpu/disk offload; {"": "cpu"}), in subprocesses; and in-process checks that
every map naming an accelerator, and a base without a map, get upstream's answer untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from metapatch.patches.peft_prefix_cache_cpu_map import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)


def _model(device_map, layers=2):
    return SimpleNamespace(hf_device_map=device_map, config=SimpleNamespace(num_hidden_layers=layers))


@pytest.fixture
def layer_device_map():
    pytest.importorskip("peft")
    import metapatch
    from peft.utils import integrations

    assert {row["id"]: row["state"] for row in metapatch.status()}[PATCH.id] == "applied"
    return integrations.get_layer_device_map


def test_maps_without_an_accelerator_compute_on_the_cpu(layer_device_map):
    assert layer_device_map(_model({"": "cpu"})) == {0: "cpu", 1: "cpu"}
    assert layer_device_map(_model({"": "disk"})) == {0: "cpu", 1: "cpu"}
    assert layer_device_map(_model({"model.layers.0": "cpu", "model.layers.1": "disk", "lm_head": "disk"})) == \
        {0: "cpu", 1: "cpu"}


def test_maps_with_an_accelerator_are_upstream_s(layer_device_map):
    torch = pytest.importorskip("torch")
    # offloaded layers compute on the map's first accelerator, as upstream decides
    mixed = {"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": 1, "lm_head": "disk"}
    assert layer_device_map(_model(mixed)) == {0: 0, 1: 1}
    # transformers 4.57's device_map="cpu": a torch.device, which upstream's own test does not take for "cpu"
    assert layer_device_map(_model({"": torch.device("cpu")})) == {0: torch.device("cpu"), 1: torch.device("cpu")}
    with pytest.raises(RuntimeError, match="layer 1 has not been mapped"):  # upstream's own check still runs
        layer_device_map(_model({"model.layers.0": 0, "lm_head": "cpu"}))
