"""tied-device-map-transformers-v4: three-way proof on its scenarios (subprocesses; the transformers 4.57 device maps). What the tied-map family's files share, and
the releases measured, is in _tied_three_way.py."""

from __future__ import annotations

from metapatch.patches.tied_device_map_transformers_v4 import PATCH

from _tied_three_way import TiedThreeWay  # tests/patches/_tied_three_way.py


class TestThreeWay(TiedThreeWay):
    patch_ids = (PATCH.id,)
