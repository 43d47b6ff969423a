"""bnb-params4bit-extra-attributes: the offload by accelerate < 1.14 of a 4-bit model loaded by
transformers 5.x with bitsandbytes < 0.50 (``TypeError: Params4bit.__new__() got an unexpected
keyword argument '_is_hf_initialized'``). The upstream fixes are bitsandbytes 0.50.0 and accelerate
1.14.0 themselves, so the third leg of the proof is the unpatched run on a stack with either (the
matrix pairs)."""

from __future__ import annotations

import pytest

from metapatch._framework.registry import Registry
from metapatch.patches.bnb_params4bit_extra_attributes import PATCH, _accepting_extra_keywords

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    """Unpatched: the TypeError where affected; passes on bitsandbytes >= 0.50 or accelerate >= 1.14 (the
    upstream fixes, so the diff leg reports "no upstream diff"), or transformers 4.x (no attribute set).
    A scenario n/a here (transformers 5.x with bitsandbytes 0.46.0 loads no 4-bit model) is skipped."""

    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"dispatch-as-loaded"}}

    def check_patched(self, scenario, outcome):
        assert outcome.metrics["offloaded_4bit_layers"] > 0


@pytest.mark.parametrize("bnb, transformers, accelerate, affected, reason", [
    ("0.46.1", "5.0.0", "1.12.0", True, ""),
    ("0.49.2", "5.17.0", "1.13.0", True, ""),
    ("0.49.2", "5.17.0", "1.14.0", False, "fixed upstream in 1.14.0"),
    ("0.49.2", "4.57.6", "1.10.1", False, "transformers 4.57.6 is outside >=5.0.0"),
    ("0.50.0", "5.0.0", "1.12.0", False, "fixed upstream in 0.50.0"),
    ("0.45.5", "5.0.0", "1.12.0", False, "not measured for bitsandbytes 0.45.5"),  # below the support window
])
def test_gate(bnb, transformers, accelerate, affected, reason):
    registry = Registry([PATCH])
    registry._versions.update({"bitsandbytes": bnb, "transformers": transformers, "accelerate": accelerate})
    found, why, _, _ = registry.gate(PATCH)
    assert found is affected
    assert reason in why


def test_replacement_drops_only_unknown_keywords():
    calls = []

    def original(cls, data=None, requires_grad=False, quant_type="fp4", *, module=None):
        calls.append((cls, data, requires_grad, quant_type, module))
        return "made"

    new = _accepting_extra_keywords(original)
    assert new(int, "d", quant_type="nf4", module="m", _is_hf_initialized=True, other=1) == "made"
    assert new(int, "d", True) == "made"  # positional arguments pass through untouched
    assert calls == [(int, "d", False, "nf4", "m"), (int, "d", True, "fp4", None)]
    assert new.__wrapped__ is original
