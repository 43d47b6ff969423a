"""tied-device-map-accelerate: three-way proof on its scenarios (subprocesses; accelerate's infer_auto_device_map keeps tied groups together). What the tied-map family's files share, and
the releases measured, is in _tied_three_way.py."""

from __future__ import annotations

from metapatch.patches.tied_device_map_accelerate import PATCH

from _tied_three_way import TiedThreeWay  # tests/patches/_tied_three_way.py


class TestThreeWay(TiedThreeWay):
    patch_ids = (PATCH.id,)
