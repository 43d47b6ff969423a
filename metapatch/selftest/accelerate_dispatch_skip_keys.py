"""Reproducer for accelerate-dispatch-skip-keys: accelerate.dispatch_model of a Gemma 4 with KV-shared
layers offloaded to cpu/disk (n/a before transformers 5.5). The Gemma 4 builders are peft_offload's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from ._harness import Scenario

PATCH_ID = "accelerate-dispatch-skip-keys"


def gemma4_dispatch_model(workdir: Path) -> Dict[str, Any]:
    """Plain ``accelerate.dispatch_model`` on Gemma 4, no ``skip_keys``: each hooked layer gets a copy
    of ``shared_kv_states`` and the first KV-shared layer finds nothing to reuse."""
    import torch
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from ._device import to_device
    from ._models import device_input_ids
    from ._peft import _compare, _logits_and_tokens, offload_map, require_gemma4, save_tiny_gemma4

    require_gemma4()
    checkpoint = save_tiny_gemma4(workdir / "base")
    ids = device_input_ids()
    reference = _logits_and_tokens(to_device(AutoModelForCausalLM.from_pretrained(checkpoint).eval()), ids)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    dispatch_model(model, device_map=offload_map("gemma4"), offload_dir=str(workdir / "offload"))
    with torch.no_grad():
        got = _logits_and_tokens(model, ids)
    return {"max_abs_diff": _compare("dispatch_model", got, reference)}


SCENARIOS = [
    Scenario(PATCH_ID, "gemma4-dispatch-model", f"{__name__}:gemma4_dispatch_model",
             "accelerate.dispatch_model(Gemma 4) without skip_keys: every hooked layer writes the shared KV "
             "into a copy, the first KV-shared layer finds nothing", expected_error="KeyError"),
]
