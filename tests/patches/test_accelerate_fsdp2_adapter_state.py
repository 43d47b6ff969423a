"""accelerate-fsdp2-adapter-state: three-way proof on two real ranks (gloo on CPU), and the fixed release
(accelerate 1.15) passing the same flow without metapatch."""

from __future__ import annotations

import pytest

from metapatch.patches.accelerate_fsdp2_adapter_state import PATCH
from metapatch.selftest import scenarios_for

from _fsdp_three_way import FsdpThreeWay, check_fixed_release_passes_unpatched  # tests/patches/_fsdp_three_way.py

pytestmark = pytest.mark.ranks


class TestThreeWay(FsdpThreeWay):
    patch_ids = (PATCH.id,)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", scenarios_for(PATCH.id), ids=lambda s: s.key)
def test_fixed_release_passes_unpatched(scenario):
    check_fixed_release_passes_unpatched(scenario)
