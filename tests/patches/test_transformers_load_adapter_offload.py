"""transformers-load-adapter-offload: three-way proof on real offloaded models (subprocesses), plus in-process
checks of the refusal and of the device maps load_adapter is given."""

from __future__ import annotations

import pytest

from metapatch import MetapatchError
from metapatch.patches import transformers_load_adapter_offload as patch_module

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

PATCH = patch_module.PATCH


class TestThreeWay(ThreeWayCase):
    """Per-range unpatched errors are on the scenarios. The diff is written against transformers main
    (5.24.0; 4.57 re-dispatches instead, 5.0-5.3 load differently); its leg runs with everything
    disabled, peft's own placement included: the transformers fix alone must be enough."""

    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"load-adapter-offloaded", "from-pretrained-adapter-dir"}}

    def check_unpatched(self, scenario, outcome):
        assert "wrote outside the offload folder" not in (outcome.error or ""), outcome.error


# -- in-process -------------------------------------------------------------------------------------


def test_disk_entries_are_read_as_cpu_for_the_adapter():
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "disk", "lm_head": "disk"}
    assert patch_module._adapter_loading_map(device_map) == {
        "model.embed_tokens": "cpu", "model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "cpu"}
    assert device_map["lm_head"] == "disk"  # the model's own map is not modified


def test_a_new_placement_is_refused_with_what_to_do():
    def load_adapter(peft_model_id=None, adapter_name=None, revision=None, token=None, device_map="auto",
                     max_memory=None, offload_folder=None):  # transformers 4.57's signature, abridged
        return None

    patch_module._refuse_new_placement(load_adapter, ("adapter",), {})
    patch_module._refuse_new_placement(load_adapter, ("adapter",), {"offload_folder": "x"})
    for kwargs in ({"device_map": {"": "cpu"}}, {"max_memory": {"cpu": "1GiB"}}, {"device_map": "sequential"}):
        with pytest.raises(MetapatchError, match="choose the placement when loading the base model"):
            patch_module._refuse_new_placement(load_adapter, ("adapter",), kwargs)


def test_redispatch_skipped_only_inside_load_adapter():
    calls = []
    assert patch_module.dispatch_accelerate_model(lambda *a, **k: calls.append(a) or "dispatched", None, (1,), {}) \
        == "dispatched"
    token = patch_module._KEEPING_PLACEMENT.set(True)
    try:
        assert patch_module.dispatch_accelerate_model(lambda *a, **k: calls.append(a), None, (2,), {}) is None
    finally:
        patch_module._KEEPING_PLACEMENT.reset(token)
    assert calls == [(1,)]
