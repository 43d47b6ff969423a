"""offloaded-model-device-v4 (transformers 4.57): the three-way proof of offloaded-model-device's scenarios on the
4.57 release line, where ``ModuleUtilsMixin.device`` has another source (n/a on 5.x: the scenarios' requires).
test_offloaded_model_device.py checks that exactly one of the two lines is affected on any install."""

from __future__ import annotations

import metapatch
from metapatch.patches.offloaded_model_device_v4 import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py

AFFECTED = metapatch.registry.gate(PATCH).affected


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"generate-embedding-on-disk", "device-unchanged-when-not-offloaded"}}

    def check_patched(self, scenario, outcome):
        if scenario.name == "generate-embedding-on-disk" and AFFECTED:
            assert outcome.metrics["model_device"] == outcome.metrics["inner_model_device"] == outcome.device

    def diff_skip(self, scenario):
        return ("no upstream diff: 4.57 is a maintenance line; the fix for transformers main is "
                "offloaded-model-device's diff")
