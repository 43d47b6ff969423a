"""accelerate-dispatch-skip-keys: three-way proof on a tiny Gemma 4 whose KV-shared layers are
dispatched with accelerate.dispatch_model over cpu and disk (subprocesses), plus the in-process
look-up of the skip keys through a PEFT wrapper."""

from __future__ import annotations

from metapatch.patches.accelerate_dispatch_skip_keys import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"gemma4-dispatch-model"}}


def test_skip_keys_are_found_through_a_peft_wrapper():
    from metapatch.patches.accelerate_dispatch_skip_keys import model_skip_keys

    class Base:
        _skip_keys_device_placement = {"shared_kv_states", "past_key_values"}

    class Wrapper:
        def __init__(self, base):
            self.base = base

        def get_base_model(self):
            return self.base

    assert model_skip_keys(Wrapper(Base())) == ["past_key_values", "shared_kv_states"]
    assert model_skip_keys(Wrapper(object())) is None
