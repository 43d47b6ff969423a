"""moshi-generate-cpu-disk-map: three-way proof on a tiny Moshi with its depth decoder on disk (in subprocesses), and
in-process checks that every other map (one naming an accelerator, {"": ...}, a second generate) gets upstream's
split untouched."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import metapatch
from metapatch.patches.moshi_generate_cpu_disk_map import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED, WHY, _, _ = metapatch.registry.gate(PATCH)


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)


@pytest.fixture
def generate():
    """Upstream's generate, patched, over a stand-in model that stops right after the device-map split (the split
    is the only thing these checks are about; the scenario runs the real generate)."""
    pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.moshi.modeling_moshi")
    if not AFFECTED:
        pytest.skip(f"{PATCH.id} not in range here: {WHY}")
    assert {row["id"]: row["state"] for row in metapatch.status()}[PATCH.id] == "applied"

    class Split(Exception):
        pass

    def model(device_map):
        stop = SimpleNamespace(items=lambda: (_ for _ in ()).throw(Split()))
        return SimpleNamespace(hf_device_map=device_map, depth_decoder=SimpleNamespace(), generation_config=stop)

    def run(instance):
        try:
            generate = modeling.MoshiForConditionalGeneration.__dict__["generate"]  # the patched descriptor
            generate.__get__(instance, type(instance))(input_ids=None)
        except Exception as exc:  # noqa: BLE001 - the split is done before anything else reads the model
            if isinstance(exc, IndexError):
                raise
        return instance

    return model, run


def test_a_map_without_an_accelerator_is_split_with_the_cpu_as_main_device(generate):
    model, run = generate
    instance = run(model({"embed_tokens": "cpu", "decoder": "cpu", "depth_decoder.layers.0": "disk",
                          "depth_decoder.layers.1": "cpu"}))
    assert instance.depth_decoder.hf_device_map == {".layers.0": "cpu", ".layers.1": "cpu"}
    assert instance.hf_device_map == {"embed_tokens": "cpu", "decoder": "cpu"}


@pytest.mark.parametrize("device_map, depth_map", [
    ({"embed_tokens": 0, "decoder": "cpu", "depth_decoder": "disk"}, {"": 0}),  # the GPU is the main device
    ({"embed_tokens": "cpu", "decoder": 1, "depth_decoder.layers.0": "disk"}, {".layers.0": 1}),
    ({"": "disk"}, {"": "disk"}),  # upstream shares the whole map
])
def test_other_maps_are_split_by_upstream(generate, device_map, depth_map):
    model, run = generate
    instance = run(model(dict(device_map)))
    assert instance.depth_decoder.hf_device_map == depth_map


def test_a_second_generate_keeps_the_first_split(generate):
    model, run = generate
    instance = model({"embed_tokens": "cpu", "decoder": "cpu", "depth_decoder": "disk"})
    instance.depth_decoder.hf_device_map = {"": "cpu"}  # as the first generate left it
    run(instance)
    assert instance.hf_device_map == {"embed_tokens": "cpu", "decoder": "cpu", "depth_decoder": "disk"}
