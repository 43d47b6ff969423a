"""Reproducers for tied-device-map-transformers-v4: transformers 4.57 has the tied-map bugs of the
5.x patches in other functions. The scenarios are the 5.x ones (the same functions), declared here
for transformers < 5, where they reproduce as 4.57 fails."""

from __future__ import annotations

from ._harness import Expect, Scenario
from ._tied import LOGITS_TOLERANCE
from .tied_device_map_disk_index import tied_llama_both_on_disk
from .tied_device_map_transformers import (ALL_DISK_ON_CPU, tied_llama_all_offload, tied_llama_explicit_split,
                                           untied_llama_all_offload)

PATCH_ID = "tied-device-map-transformers-v4"
TRANSFORMERS_4 = {"transformers": "<5.0.0.dev0"}  # 5.x: tied-device-map-transformers and -disk-index
DISK_IS_INVALID = (Expect("SafetensorError", "device disk is invalid"),)  # while loading


def _function(function) -> str:
    return f"{function.__module__}:{function.__name__}"


SCENARIOS = [
    Scenario(PATCH_ID, "untied-llama-all-offload", _function(untied_llama_all_offload),
             "transformers 4.57: untied Llama, device_map='auto', cpu budget 10%: SafetensorError 'device disk is "
             "invalid' while loading", expected_error="SafetensorError", requires=TRANSFORMERS_4,
             unpatched=DISK_IS_INVALID, tolerance=LOGITS_TOLERANCE, **ALL_DISK_ON_CPU),
    Scenario(PATCH_ID, "tied-llama-all-offload", _function(tied_llama_all_offload),
             "transformers 4.57: the same with tie_word_embeddings=True", expected_error="SafetensorError",
             requires=TRANSFORMERS_4, unpatched=DISK_IS_INVALID, tolerance=LOGITS_TOLERANCE, **ALL_DISK_ON_CPU),
    Scenario(PATCH_ID, "tied-llama-explicit-split", _function(tied_llama_explicit_split),
             "transformers 4.57: tied lm_head on disk, embed_tokens on cpu: KeyError 'lm_head.weight'",
             expected_error="KeyError", requires=TRANSFORMERS_4, unpatched=(Expect("KeyError", "lm_head.weight"),),
             tolerance=LOGITS_TOLERANCE),
    Scenario(PATCH_ID, "tied-llama-both-on-disk", _function(tied_llama_both_on_disk),
             "transformers 4.57: embed_tokens and the tied lm_head both on disk: KeyError 'lm_head.weight'",
             expected_error="KeyError", requires=TRANSFORMERS_4, unpatched=(Expect("KeyError", "lm_head.weight"),),
             tolerance=LOGITS_TOLERANCE),
]
