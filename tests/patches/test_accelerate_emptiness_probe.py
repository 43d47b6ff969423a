"""accelerate-emptiness-probe: three-way proof on a real dispatch_model of layers whose state_dict() reads their
weight (subprocesses); bnb-quant-state-offload's tests show the same probe on bitsandbytes' Linear4bit."""

from __future__ import annotations

from metapatch.patches.accelerate_emptiness_probe import PATCH

from _three_way import ThreeWayCase  # tests/patches/_three_way.py


class TestThreeWay(ThreeWayCase):
    patch_ids = (PATCH.id,)
    names = {PATCH.id: {"dispatch-layer-that-serializes-its-weight"}}
