"""tied-device-map-disk-index: three-way proof on its scenarios (subprocesses; disk-offloaded tied weights get offload-index entries). What the tied-map family's files share, and
the releases measured, is in _tied_three_way.py."""

from __future__ import annotations

from metapatch.patches.tied_device_map_disk_index import PATCH

from _tied_three_way import TiedThreeWay  # tests/patches/_tied_three_way.py


class TestThreeWay(TiedThreeWay):
    patch_ids = (PATCH.id,)
