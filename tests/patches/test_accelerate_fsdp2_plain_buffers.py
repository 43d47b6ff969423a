"""accelerate-fsdp2-plain-buffers: three-way proof on two real ranks (gloo on CPU)."""

from __future__ import annotations

import pytest

from metapatch.patches.accelerate_fsdp2_plain_buffers import PATCH

from _fsdp_three_way import FsdpThreeWay  # tests/patches/_fsdp_three_way.py

pytestmark = pytest.mark.ranks


class TestThreeWay(FsdpThreeWay):
    patch_ids = (PATCH.id,)
