"""tied-device-map-meta-pointer: three-way proof on its scenarios (subprocesses; offloaded tied weights get their own values). What the tied-map family's files share, and
the releases measured, is in _tied_three_way.py."""

from __future__ import annotations

from metapatch.patches.tied_device_map_meta_pointer import PATCH

from _tied_three_way import TiedThreeWay  # tests/patches/_tied_three_way.py


class TestThreeWay(TiedThreeWay):
    patch_ids = (PATCH.id,)
