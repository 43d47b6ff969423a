"""The device-map step of transformers 4.57's ``from_pretrained`` (``modeling_utils._get_device_map``),
with the two repairs ``tied-device-map-transformers`` makes on 5.x:

* a map that offloads everything to disk (``device_map="auto"`` with a cpu budget smaller than the
  largest layer, tied or untied model) fails while loading (``SafetensorError: device disk is
  invalid``); one small module with no tie crossing it is kept on cpu, within the cpu budget, and the
  model loads and dispatches with offload hooks;
* an explicit map that puts a tied copy and its source on different devices (``{"model": "cpu",
  "lm_head": "disk"}`` on a tied Llama) fails at the first forward (``KeyError: 'lm_head.weight'``)
  or in dispatch (``weight is on the meta device``); the copy is moved to its source's device, with a
  warning naming the pairs;
* a tied group offloaded to disk as a whole has an offload-index entry only for the name the
  checkpoint stores (its source), so the tied copy's hook fails with ``KeyError: 'lm_head.weight'``
  at the first forward (``tied-device-map-disk-index`` backports the same fix to transformers 5.0-5.12).

transformers 5 moved this function to ``transformers.integrations.accelerate`` (patched there by
``tied-device-map-transformers``); 4.57 infers ``"auto"`` maps with accelerate's
``infer_auto_device_map``, which ``tied-device-map-accelerate`` covers.
"""

from __future__ import annotations

from typing import Any

from .._framework.records import Patch, Target, Upstream
from .tied_device_map_transformers import _get_device_map

PATCH_ID = "tied-device-map-transformers-v4"

def _load_pretrained_model(wrapped, instance, args, kwargs):
    """Give each disk-offloaded tied copy its source's entry in the returned offload index."""
    from .._offload.tied_members import index_tied_members
    from .._framework.calls import call_arguments

    result = wrapped(*args, **kwargs)
    index = result[4] if isinstance(result, tuple) and len(result) == 6 else None
    if isinstance(index, dict) and index:
        model: Any = call_arguments(wrapped, args, kwargs).get("model")
        if model is not None:
            index_tied_members(index, model)
    return result


PATCH = Patch(
    id=PATCH_ID,
    title="transformers 4.57 device maps: an all-disk map is dispatched (one module kept on cpu), an explicit map "
          "splitting a tied group is repaired",
    # Measured (selftest untied-llama-all-offload, tied-llama-all-offload, tied-llama-explicit-split,
    # tied-llama-both-on-disk) on 4.57.6; 5.x has these functions elsewhere (tied-device-map-transformers,
    # tied-device-map-disk-index).
    affects={"transformers": ">=4.57.0,<5.0.0.dev0"},
    targets=(
        Target(
            "transformers.modeling_utils", "_get_device_map",
            fingerprints=("bee828b9582cb663",),  # 4.57.0 - 4.57.6 (one source; measured on 4.57.6)
            wrapper=_get_device_map,
        ),
        Target(
            "transformers.modeling_utils", "PreTrainedModel._load_pretrained_model",
            fingerprints=("adb7e834d076ba72",),  # 4.57.0 - 4.57.6 (one source; measured on 4.57.6)
            wrapper=_load_pretrained_model,
        ),
    ),
    upstream=Upstream(
        bug=("https://github.com/huggingface/transformers/pull/46625",),
        forwarded="not-needed",
        note="transformers 4.57 is a maintenance line; the fix for current releases is "
             "upstream_diffs/tied-device-map-transformers/transformers.diff.",
    ),
    diagnoses=("tied-split", "no-hf-device-map"),  # metapatch.diagnose findings this fixes
)
