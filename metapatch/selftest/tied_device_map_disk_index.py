"""Reproducers for tied-device-map-disk-index: a tied Llama pair both offloaded to disk (transformers 5;
tied-device-map-transformers-v4 runs the same scenario on 4.57)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Expect, Scenario
from ._tied import LOGITS_TOLERANCE, load_llama, on_main

PATCH_ID = "tied-device-map-disk-index"

LLAMA_BOTH_ON_DISK_MAP = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu",
                          "model.rotary_emb": "cpu", "lm_head": "disk"}


def tied_llama_both_on_disk(workdir: Path) -> Dict[str, Any]:
    """A tied pair both offloaded to disk: only the source is in the checkpoint, so before transformers
    5.13 the offload index has no entry for lm_head.weight (KeyError at the first forward)."""
    return load_llama(workdir, True, device_map=on_main(LLAMA_BOTH_ON_DISK_MAP))



SCENARIOS = [
    Scenario(PATCH_ID, "tied-llama-both-on-disk", f"{__name__}:tied_llama_both_on_disk",
             "tied Llama with embed_tokens and lm_head both on disk: no offload-index entry for the tied "
             "copy before transformers 5.13 (KeyError 'lm_head.weight')", expected_error="KeyError",
             requires={"transformers": ">=5.0.0.dev0"}, tolerance=LOGITS_TOLERANCE, unpatched=(
                 Expect("KeyError", "lm_head.weight", when={"transformers": "<5.13.0.dev0"}), Expect(""))),
]
