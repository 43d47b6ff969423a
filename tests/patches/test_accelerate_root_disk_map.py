"""accelerate-root-disk-map: three-way proof on a tiny Llama given the map infer_auto_device_map returns
when nothing fits ({"": "disk"}) and a real dispatch_model (subprocesses), and in-process checks that
every other extraction calls upstream untouched."""

from __future__ import annotations

import pytest

import metapatch
from metapatch.patches.accelerate_root_disk_map import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"inferred-map-all-on-disk"}}

    def own_not_applicable(self, scenario, outcome):
        """accelerate <= 1.14 refuses {"": "disk"} in dispatch_model before the bug: the scenario says n/a."""
        from packaging.version import Version

        assert Version(metapatch.registry._version("accelerate")) < Version("1.15"), outcome.not_applicable
        assert "offload the whole model to the disk" in outcome.not_applicable


torch = pytest.importorskip("torch")


def test_other_names_extract_as_upstream():
    from accelerate.utils import extract_submodules_state_dict

    state = {"a.weight": torch.ones(1), "ab.weight": torch.zeros(1), "b.bias": torch.ones(2)}
    assert set(extract_submodules_state_dict(state, ["a"])) == {"a.weight"}  # not "ab.weight"
    assert set(extract_submodules_state_dict(state, ["a", "b"])) == {"a.weight", "b.bias"}
    assert extract_submodules_state_dict(state, []) == {}
    everything = extract_submodules_state_dict(state, ["", "a"])
    assert everything == state and everything is not state  # a copy: dispatch_model may not own the dict
